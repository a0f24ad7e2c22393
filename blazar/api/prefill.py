"""The order an engine prefills the prompts waiting in it, which admission's forecast
models (`blazar.engine.loop`, `blazar.dataplane.admission.forecast`).

A prompt of at most `SHORT_PROMPT_TOKENS` goes before longer ones, oldest first within
each kind: its first token is a step or a few away, where behind a long prompt it would
wait for every chunk of that one (seconds on a CPU), and the long prompt comes later by
those few steps. 64 tokens: `SHORT_PROMPT_STEPS` steps at the smallest chunk a paced
step takes (`MIN_CHUNK`, `engine.pacing`), a chat turn or a short instruction, not a
document. The engine's drafts give way to such a prompt for as many steps
(`engine.assembly.drafts_yield`).
"""

from __future__ import annotations

# Prompt tokens a step paced to a time-per-output-token target takes at least beside
# decoding streams (`engine.pacing`).
MIN_CHUNK = 16
SHORT_PROMPT_STEPS = 4
SHORT_PROMPT_TOKENS = SHORT_PROMPT_STEPS * MIN_CHUNK


def short(prompt_tokens: int) -> bool:
    """Whether a prompt (its tokens still to prefill) goes before longer ones."""
    return 0 < prompt_tokens <= SHORT_PROMPT_TOKENS
