"""The benchmark's load: the model's tokenizer and streamed `/v1/completions` requests.

Both servers get exactly the same requests (greedy, fixed seed, streamed), and each
`Stream` records what the client saw: when the first and last text arrived, the text
and the completion tokens, counted the same way for both servers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

MODEL_ALIAS = "bench"
SEED = 1234


class Tokenizer:
    """The model's own tokenizer (vocab only, no weights), to size prompts exactly."""

    def __init__(self, model_path: Path) -> None:
        from llama_cpp import Llama

        self._llama = Llama(str(model_path), vocab_only=True, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return list(self._llama.tokenize(text.encode(), add_bos=False, special=False))

    def count(self, text: str) -> int:
        return len(self.tokenize(text))

    def truncate(self, text: str, tokens: int) -> str:
        return self._llama.detokenize(self.tokenize(text)[:tokens]).decode(errors="ignore")

    def end_of_generation(self) -> list[int]:
        """Every token that ends a generation (llama.cpp's `llama_vocab_is_eog`).

        The set llama-server's `ignore_eos` bans and Blazar's engine stops on; for the
        bundled Gemma 3, `<eos>`, `<end_of_turn>` and `</s>`.
        """
        import llama_cpp as lc

        vocab = lc.llama_model_get_vocab(self._llama.model)
        return [t for t in range(lc.llama_vocab_n_tokens(vocab)) if lc.llama_vocab_is_eog(vocab, t)]


def no_end_of_generation(tokenizer: Tokenizer) -> dict[str, Any]:
    """Request fields that make every stream run to `max_tokens`: EOG tokens banned.

    A logit bias, because both Blazar and llama-server take it (Blazar has no
    `ignore_eos`). -100 is OpenAI's "ban": Blazar turns it into minus infinity,
    llama-server adds -100 to the logit, which no greedy pick survives.
    """
    return {"logit_bias": {str(t): -100 for t in tokenizer.end_of_generation()}}


# ---------------------------------------------------------------- one streamed request


@dataclass
class Stream:
    """What the client saw of one streamed completion (times are perf_counter seconds)."""

    start: float = 0.0
    first: float | None = None
    last: float | None = None
    end: float = 0.0
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # llama.cpp server's `timings` object (predicted_n, draft_n, ...), where sent.
    timings: dict[str, Any] | None = None
    tokens: int = 0
    token_source: str = ""

    @property
    def ttft(self) -> float:
        if self.first is None:
            raise RuntimeError("the stream produced no text")
        return self.first - self.start

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first one: excludes queueing and prefill."""
        if self.first is None or self.last is None or self.last <= self.first:
            raise RuntimeError(f"too few tokens to time decoding ({self.tokens})")
        return (self.tokens - 1) / (self.last - self.first)


async def stream_completion(
    client: httpx.AsyncClient,
    base_url: str,
    prompt: str,
    *,
    max_tokens: int,
    tokenizer: Tokenizer,
    model: str = MODEL_ALIAS,
    extra: Mapping[str, Any] | None = None,
) -> Stream:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
        # llama-cpp-python applies a 1.1 repeat penalty by default, Blazar none: 1.0 (no
        # penalty) makes both decode the same way.
        "repeat_penalty": 1.0,
        **(extra or {}),
    }
    out = Stream(start=time.perf_counter())
    parts: list[str] = []
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or ""
                if text:
                    out.chunks += 1
                    parts.append(text)
                    if out.first is None:
                        out.first = now
                    out.last = now
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
            if chunk.get("timings"):
                out.timings = chunk["timings"]
            usage = chunk.get("usage")
            if usage:
                out.usage_tokens = usage.get("completion_tokens")
                out.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens")
    out.end = time.perf_counter()
    out.text = "".join(parts)
    # Same count for both servers: a "length" finish is exactly max_tokens; otherwise the
    # server's usage, or (the peer streams no usage) the output re-tokenized.
    if out.finish_reason == "length":
        out.tokens, out.token_source = max_tokens, "max_tokens"
    elif out.usage_tokens is not None:
        out.tokens, out.token_source = out.usage_tokens, "usage"
    else:
        out.tokens, out.token_source = tokenizer.count(out.text), "retokenized"
    return out


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(900.0, connect=10.0),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        trust_env=False,
    )


async def one(
    base_url: str,
    prompt: str,
    *,
    max_tokens: int,
    tokenizer: Tokenizer,
    model: str = MODEL_ALIAS,
    extra: Mapping[str, Any] | None = None,
) -> Stream:
    async with http_client() as client:
        return await stream_completion(
            client,
            base_url,
            prompt,
            max_tokens=max_tokens,
            tokenizer=tokenizer,
            model=model,
            extra=extra,
        )


async def concurrent(
    base_url: str,
    prompts: list[str],
    *,
    max_tokens: int,
    tokenizer: Tokenizer,
    model: str = MODEL_ALIAS,
    extra: Mapping[str, Any] | None = None,
) -> tuple[list[Stream], float]:
    """All prompts at once; returns the streams and the wall time from first send to last end."""
    async with http_client() as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(
                stream_completion(
                    client,
                    base_url,
                    p,
                    max_tokens=max_tokens,
                    tokenizer=tokenizer,
                    model=model,
                    extra=extra,
                )
                for p in prompts
            )
        )
        return list(streams), time.perf_counter() - t0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
