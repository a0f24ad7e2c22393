"""Token log-probabilities in OpenAI's two shapes: chat's list of entries with their
alternatives, and the legacy completions API's parallel lists.

Pure: no IO, no clock, no logging.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from blazar._proto.v1 import inference_pb2
from blazar.shim.openai import protocol


def chat_logprobs(entries: Sequence[inference_pb2.TokenLogprob]) -> protocol.ChatLogprobs:
    """Chat's `choices[].logprobs`: one entry per token, alternatives best first."""
    return {"content": [token_logprob(e) for e in entries], "refusal": None}


def token_logprob(entry: inference_pb2.TokenLogprob) -> protocol.TokenLogprob:
    """One token and its alternatives, as chat's `logprobs.content` and the Responses
    API's `output_text.logprobs` both list them."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top
        ],
    }


class LegacyLogprobs:
    """The completions API's parallel lists; `text_offset` continues across calls.

    A token's offset counts the characters of the text before it. A token holding part
    of a multi-byte character (a byte-fallback token) adds nothing until the token
    that completes the character, so offsets never run past the text.
    """

    def __init__(self) -> None:
        self._offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, entries: Sequence[inference_pb2.TokenLogprob]) -> protocol.CompletionLogprobs:
        out: protocol.CompletionLogprobs = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in entries:
            token = _legacy_token(entry.bytes)
            out["tokens"].append(token)
            out["token_logprobs"].append(entry.logprob)
            # OpenAI always lists the sampled token too: up to `logprobs` + 1 entries.
            alternatives = {_legacy_token(t.bytes): t.logprob for t in entry.top}
            alternatives.setdefault(token, entry.logprob)
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(entry.bytes))
        return out

    def skip(self, text: str) -> None:
        """Advance past text that has no log-probabilities (an echoed prompt)."""
        self._offset += len(text)


def _legacy_token(data: bytes) -> str:
    """A token as the completions API names it: its text, or OpenAI's `bytes:\\xNN`
    form when its bytes are not whole UTF-8 characters (so that alternatives made of
    different bytes stay different keys)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
