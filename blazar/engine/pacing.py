"""How many prompt tokens a step may take beside streams that decode.

A step that prefills a chunk of a new prompt also advances every decoding stream by
one token (plus what speculation accepts), so the chunk sets those streams' time per
output token. When a decoding request carries a time-per-output-token target (its
SLOPolicy's `tpotTargetMs`; the tightest one counts), the chunk is sized from what
this engine has measured: how long a step of `rows` decoding rows takes, and how long
each prompt token adds to a step. Without a target the loop's fixed cap applies
(`loop.PREFILL_BESIDE_DECODE`), and so it does until both figures are measured: the
pacer never sizes a chunk on a guess.

A stream's time per output token is a whole pass of the loop, not only its decode:
reading each row back (sampling, stops, the stream's send), drafting and assembling the
next batch happen between two decodes (2.5-6 ms a pass with three streams drafting, on
Machine C). The pacer measures that too (`between`: from one decode's end to the next
one's start, while streams decode all along) and leaves it out of the room.

Steps vary, so the chunk aims below the target by `SPREAD` times the pacer's own
typical error (the moving average of |measured - predicted| over steps that carried a
chunk): the target is a bound on each step, not on their mean.

A target that even a decode-only step misses still lets the prompt move on, by
`MIN_CHUNK` tokens a step; a target with room to spare lets the chunk grow up to the
batch, so that the long prompt is not slowed for nothing. Speculative drafts come
first: a step whose drafts leave no room for `MIN_CHUNK` takes no prompt at all (a step
whose drafts are all rejected emits one token a stream, so the chunk would be what
breaks the target). The prompt moves on in the steps whose drafts leave room (the
speculation policy pauses drafts that keep being rejected, and switches them off above
its batch limit) or once the streams end: while drafts pay, the streams finish sooner.

Pure: the loop reports each decoded step (`observe`) and the pass before it
(`between`), and asks before planning the next (`budget`); no clock, no llama.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blazar.api.prefill import MIN_CHUNK

# Weight of the newest measurement in the moving averages.
ALPHA = 0.2
# How many typical prediction errors a chunk keeps clear of the target.
SPREAD = 2.0


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass
class PrefillPacer:
    # The cap without a target (None: none, a step may prefill up to the batch).
    default: int | None
    # The batch: no chunk is larger.
    max_tokens: int
    # Seconds of a step that only decodes, by its decoding rows.
    _decode_s: dict[int, float] = field(default_factory=dict)
    # Seconds one prompt token adds to a step.
    _per_token_s: float | None = None
    # Typical |measured - predicted| seconds of a step that carried a chunk.
    _error_s: float = 0.0
    # Seconds from a decode's end to the next one's start while streams decode.
    _between_s: float = 0.0

    def observe(self, *, rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step decoded `rows` rows of decoding streams and `prompt_tokens` prompt
        tokens in `seconds`."""
        if prompt_tokens <= 0:
            if rows > 0:
                self._decode_s[rows] = _average(self._decode_s.get(rows), seconds)
            return
        base = 0.0 if rows == 0 else self.decode_s(rows)
        if base is None:
            return
        if self._per_token_s is not None and rows > 0:
            predicted = base + self._per_token_s * prompt_tokens
            self._error_s = _average(self._error_s, abs(seconds - predicted))
        added = (seconds - base) / prompt_tokens
        if added > 0:
            self._per_token_s = _average(self._per_token_s, added)

    def between(self, seconds: float) -> None:
        """A decode began `seconds` after the last one ended, with streams decoding in
        both (the loop did not wait for work meanwhile)."""
        self._between_s = _average(self._between_s or None, seconds)

    def decode_s(self, rows: int) -> float | None:
        """The measured decode-only step of `rows` rows, or of the nearest row count
        measured, scaled linearly (rows cost about the same each: the output head)."""
        if rows in self._decode_s:
            return self._decode_s[rows]
        if not self._decode_s:
            return None
        near = min(self._decode_s, key=lambda r: (abs(r - rows), r))
        return self._decode_s[near] * rows / near

    def budget(self, *, rows: int, target_s: float | None, drafts: int = 0) -> int | None:
        """Prompt tokens the next step may take beside `rows` decoding rows whose
        tightest target is `target_s` (None: no decoding request has one), `drafts` of
        them speculative drafts."""
        if rows <= 0 or target_s is None:
            return self.default
        base, per_token = self.decode_s(rows), self._per_token_s
        if base is None or per_token is None:
            return self.default
        room = int((target_s - base - self._between_s - SPREAD * self._error_s) / per_token)
        if room < MIN_CHUNK and drafts > 0:
            return 0
        return max(MIN_CHUNK, min(room, self.max_tokens))
