"""The order an engine prefills the prompts waiting in it, which admission's forecast
models (`blazar.engine.loop`, `blazar.dataplane.admission.forecast`).

A prompt of at most `SHORT_PROMPT_TOKENS` goes before longer ones, oldest first within
each kind: its first token is a step or a few away, where behind a long prompt it would
wait for every chunk of that one (seconds on a CPU), and the long prompt comes later by
those few steps. 64 tokens: 4 steps at the pacer's smallest chunk (16, `engine.pacing`),
a chat turn or a short instruction, not a document.
"""

from __future__ import annotations

SHORT_PROMPT_TOKENS = 64


def short(prompt_tokens: int) -> bool:
    """Whether a prompt (its tokens still to prefill) goes before longer ones."""
    return 0 < prompt_tokens <= SHORT_PROMPT_TOKENS
