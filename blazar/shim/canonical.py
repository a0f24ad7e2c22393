"""The canonical `blazar.v1` messages as every dialect builds and reads them.

Pure. Request side: `sampling` fills a `Sampling` from the values a dialect read under
its own names, setting only what the client sent, and `json_object` / `json_schema`
are the structured-output constraints (OpenAI's `response_format`, Ollama's `format`).
Response side: `Answer` collects a generation stream for a non-streaming response, and
`truncated` is the error for a stream that ended without its final chunk.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from blazar._proto.v1 import inference_pb2
from blazar.api import errors

# proto3 uint32: clients send any integer seed, so larger ones are folded in.
_SEED_MODULUS = 2**32
# llama.cpp (and Ollama after it) read seed -1, their default, as "a random seed", and
# clients send it to ask for one; as a seed it has no other use.
RANDOM_SEED = -1


def sampling(
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repeat_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: Iterable[str] = (),
) -> inference_pb2.Sampling:
    """A `Sampling` with each given value set and the rest unset (the engine's default).
    Empty stop strings are dropped: they would stop before the first token."""
    out = inference_pb2.Sampling()
    given = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repeat_penalty": repeat_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "max_tokens": max_tokens,
    }
    for name, value in given.items():
        if value is not None:
            setattr(out, name, value)
    if seed is not None and seed != RANDOM_SEED:
        out.seed = seed % _SEED_MODULUS
    out.stop.extend(s for s in stop if s)
    return out


def json_object() -> inference_pb2.Constraint:
    """Any JSON object."""
    return inference_pb2.Constraint(json_object=True)


def json_text(document: dict[str, Any]) -> str:
    """A JSON document as the canonical request carries it (schemas, tool parameters)."""
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


def json_schema(schema: dict[str, Any]) -> inference_pb2.Constraint:
    """A JSON document valid against `schema`."""
    return inference_pb2.Constraint(json_schema=json_text(schema))


def truncated() -> errors.Unavailable:
    """The daemon closed a stream without its final chunk (it is shutting down)."""
    return errors.Unavailable("The generation stream ended before it finished; retry.")


@dataclass
class Answer:
    """A whole generation, collected from its chunks for a non-streaming response."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)
    final: inference_pb2.Final | None = None
    # Tool calls by index: id, name and the arguments' fragments joined.
    calls: dict[int, inference_pb2.ToolCall] = field(default_factory=dict)
    # The log-probabilities of the tokens that made `text`: those of a delta without
    # text wait for the next text (a character's first bytes), and are dropped when a
    # call comes first (its markup's tokens, held back until it parsed, are not text).
    text_logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)
    _held: list[inference_pb2.TokenLogprob] = field(default_factory=list, repr=False)

    def add(self, chunk: inference_pb2.Chunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "delta":
            self.parts.append(chunk.delta.text)
            self.logprobs.extend(chunk.delta.logprobs)
            if chunk.delta.text:
                self.text_logprobs.extend(self._held)
                self.text_logprobs.extend(chunk.delta.logprobs)
                self._held.clear()
            elif chunk.delta.tool_calls:
                self._held.clear()
            else:
                self._held.extend(chunk.delta.logprobs)
            for d in chunk.delta.tool_calls:
                call = self.calls.setdefault(d.index, inference_pb2.ToolCall())
                call.id = call.id or d.id
                call.name = call.name or d.name
                call.arguments += d.arguments
        elif part == "final":
            self.final = chunk.final

    def whole_calls(self) -> list[inference_pb2.ToolCall]:
        """The calls the daemon says are whole (`Final.tool_calls`): one that max_tokens
        or a stop string cut short is left out, never passed on half-formed."""
        whole = self.finished().tool_calls
        return [self.calls[i] for i in sorted(self.calls) if i < whole]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def finished(self) -> inference_pb2.Final:
        """The final part; `truncated` when the stream ended without one."""
        if self.final is None:
            raise truncated()
        return self.final
