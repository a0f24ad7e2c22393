"""Speculative decoding in a real worker: n-gram lookup and a draft model, against the
same requests on a worker without speculation.

What the model writes is forced by grammars (digit strings, see DIGITS), so what the
drafters propose, and what the target accepts, is the same on every CPU."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from tests import launches
from tests.integration import pinning
from tests.integration.engine_harness import Spawner, Worker, greedy, make_draft_tool

pytestmark = pytest.mark.slow

# One thread: on this shared 2-core machine two llama.cpp threads spin on each other's
# barriers whenever another process holds a core. Nothing here measures speed.
SETTINGS = {"slots": 2, "context_per_slot": 1024, "threads": 1}

# Pinned texts: digits. The bundled vocabulary writes each digit with one token of its
# own (and a byte token, which `sole_spelling_bias` bans), so a grammar that forces
# a digit string forces every token, on every CPU. No three digits of DIGITS recur,
# so prompt lookup finds one earlier occurrence of what is being written, and drafts
# exactly what follows it there: where the forced text copies the prompt, every
# draft is right; where it departs from it, the draft is wrong.
DIGITS = pinning.digit_string(160, seed=15)
COPY = f"Digits: {DIGITS}\nThe same digits again: "
# Copies, but jumps elsewhere in the prompt's digits: after 24 (to a digit other than
# DIGITS[24]), and for the draft model after 20 and 40. The target leads by nats while
# it copies, so its logprobs vary little with rounding there.
JUMPED = DIGITS[:24] + DIGITS[100:140]
JUMPS = DIGITS[:20] + DIGITS[100:120] + DIGITS[40:60]
# Segments of one 8-digit stem (no 3 of its digits recur) and endings that share no
# digit: lookup matches the stem each time and drafts the previous segment's ending,
# always wrong, and nowhere else finds 8 tokens it has seen.
STEM = "90817263"
SEGMENTS = "".join(STEM + str(i) * 4 for i in range(10))
PROSE = (
    "Write a long story about a young girl who finds a map in her grandmother's attic.\n\n"
    "Story:\nThe attic smelled of dust and old paper. Mara pushed open the heavy trunk and"
)
# A worker with speculation rounds logits otherwise than one without (batches of other
# shapes run other CPU kernels): the forced tokens' logprobs agree within this on
# average (measured on the texts here: 0.0006-0.023, single tokens up to 0.38).
LOGPROB_TOLERANCE = 0.1


@dataclass
class Run:
    ids: list[int]
    logprobs: list[float]
    text: str
    final: inference_pb2.Final


def run(w: Worker, prompt: str, sampling: inference_pb2.Sampling, **kw: Any) -> Run:
    deltas, final = w.generate(prompt=prompt, sampling=sampling, **kw)
    scores = [lp for d in deltas for lp in d.logprobs]
    return Run(
        [s.id for s in scores], [s.logprob for s in scores], "".join(d.text for d in deltas), final
    )


def forced(text: str) -> inference_pb2.Constraint:
    return inference_pb2.Constraint(grammar=pinning.exactly(text))


def assert_same_stream(plain: Run, spec: Run) -> None:
    """The same tokens (forced) with the same logprobs, up to rounding."""
    assert spec.ids == plain.ids
    diffs = [abs(a - b) for a, b in zip(plain.logprobs, spec.logprobs, strict=True)]
    assert sum(diffs) / len(diffs) <= LOGPROB_TOLERANCE, max(diffs)


def cached(w: Worker, final: inference_pb2.Final) -> int:
    """How many tokens the slot that served `final` holds now."""
    h = w.health()
    assert h is not None
    return int(h.slots[final.routing.slot].cached_tokens)


def assert_cache_holds_the_stream(w: Worker, final: inference_pb2.Final) -> None:
    """The slot holds the prompt and every emitted token but the last, which no step
    fed back (a draft is never budgeted for it), and no rejected draft."""
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert cached(w, final) == final.usage.prompt_tokens + final.usage.completion_tokens - 1


@pytest.fixture(scope="module")
def digits(model_path: Path) -> dict[int, float]:
    """The logit bias under which a digit string has one tokenization only."""
    assert pinning.digits_have_one_token_each(model_path)
    return pinning.sole_spelling_bias(model_path, "0123456789")


@pytest.fixture(scope="module")
def draft_path(model_path: Path) -> Path:
    """The q4_0 draft, made once next to the bundled model (the tool skips it if there)."""
    tool = make_draft_tool()
    made: Path = tool.make_draft(
        model_path.with_name(f"{model_path.stem}.draft-q4_0.gguf"), source=model_path
    )
    return made


@pytest.fixture(scope="module")
def workers(model_path: Path, draft_path: Path) -> Iterator[dict[str, Worker]]:
    spawner = Spawner(model_path)
    ws = {
        "plain": spawner(**SETTINGS),
        "ngram": spawner(**SETTINGS, speculation=launches.ngram()),
        "model": spawner(
            **SETTINGS,
            speculation=launches.ngram(
                kind="model", ngram_size=None, draft_model_path=str(draft_path), max_draft_tokens=3
            ),
        ),
    }
    for w in ws.values():
        w.wait_ready()
    yield ws
    spawner.close()


def with_logprobs(max_tokens: int, bias: dict[int, float], **kw: Any) -> inference_pb2.Sampling:
    return greedy(max_tokens, logprobs=True, top_logprobs=2, logit_bias=bias, **kw)


def test_copying_accepts_every_draft_and_keeps_the_stream(
    workers: dict[str, Worker], digits: dict[int, float]
) -> None:
    sampling = with_logprobs(48, digits)
    plain = run(workers["plain"], COPY, sampling, constraint=forced(DIGITS))
    spec = run(workers["ngram"], COPY, sampling, constraint=forced(DIGITS))
    assert spec.text == plain.text == DIGITS[:48]
    routing = spec.final.routing
    assert routing.speculation == "ngram"
    # Lookup needs 8 matching tokens: from the 9th digit on, every draft is the copy.
    assert routing.accepted_tokens == routing.drafted_tokens >= 48 - 8 - 8
    assert spec.final.usage.completion_tokens == 48
    assert len(spec.ids) == 48  # one logprob per emitted token, drafted or not
    assert_same_stream(plain, spec)
    assert_cache_holds_the_stream(workers["ngram"], spec.final)
    assert plain.final.routing.speculation == ""
    assert plain.final.routing.drafted_tokens == 0


def test_stop_string_inside_an_accepted_draft(
    workers: dict[str, Worker], digits: dict[int, float]
) -> None:
    stop = DIGITS[30:34]  # no 4 digits of DIGITS recur
    sampling = greedy(64, stop=[stop], logit_bias=digits)
    plain = workers["plain"].generate(prompt=COPY, sampling=sampling, constraint=forced(DIGITS))
    spec = workers["ngram"].generate(prompt=COPY, sampling=sampling, constraint=forced(DIGITS))
    texts = ["".join(d.text for d in deltas) for deltas, _ in (plain, spec)]
    assert texts == [DIGITS[:30], DIGITS[:30]]
    assert spec[1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert spec[1].routing.accepted_tokens > 0
    # The slot's cache holds the stream up to the stop (its last token too, when a
    # draft brought it), not the drafts after it; the same prompt again reuses it.
    usage = spec[1].usage
    assert cached(workers["ngram"], spec[1]) - usage.prompt_tokens in (
        usage.completion_tokens - 1,
        usage.completion_tokens,
    )
    again = workers["ngram"].generate(prompt=COPY, sampling=sampling, constraint=forced(DIGITS))
    assert "".join(d.text for d in again[0]) == texts[1]
    assert again[1].usage.cached_tokens > 0


def test_rejected_drafts_are_rolled_back_under_a_grammar(
    workers: dict[str, Worker], digits: dict[int, float]
) -> None:
    """The forced text jumps after 24 digits: the draft there is rejected, and the
    slot must lose it (the KV cache and the token list: a stale entry shows in the
    cache's size and the logprobs of later tokens), the grammar must never see it (it
    could not write the forced text)."""
    assert DIGITS[24] != JUMPED[24]
    sampling = with_logprobs(40, digits)
    plain = run(workers["plain"], COPY, sampling, constraint=forced(JUMPED))
    spec = run(workers["ngram"], COPY, sampling, constraint=forced(JUMPED))
    assert spec.text == JUMPED[:40]
    routing = spec.final.routing
    assert 0 < routing.accepted_tokens < routing.drafted_tokens, routing
    assert_same_stream(plain, spec)
    assert_cache_holds_the_stream(workers["ngram"], spec.final)


def test_drafts_that_miss_switch_speculation_off(
    workers: dict[str, Worker], digits: dict[int, float]
) -> None:
    """Sampled (temperature 0.8) through a forced text on which every draft misses."""
    w = workers["ngram"]
    before = w.health()
    assert before is not None
    sampling = inference_pb2.Sampling(temperature=0.8, seed=7, max_tokens=96, logit_bias=digits)
    deltas, final = w.generate(prompt=PROSE, sampling=sampling, constraint=forced(SEGMENTS))
    assert "".join(d.text for d in deltas) == SEGMENTS[:96]
    assert final.usage.completion_tokens == 96
    assert final.routing.accepted_tokens == 0
    # After its first occurrence a stem ends 7 times in 96 tokens: 45 drafted tokens
    # without the policy, which pauses once 16 drafted tokens have missed, then probes
    # with 3 at most every 32 steps.
    assert 0 < final.routing.drafted_tokens <= 96 // 4, final.routing
    after = w.health()
    assert after is not None
    assert after.speculation.disabled_requests == before.speculation.disabled_requests + 1


def test_health_counters_add_up(workers: dict[str, Worker], digits: dict[int, float]) -> None:
    w = workers["ngram"]

    def stats() -> engine_pb2.SpeculationStats:
        h = w.health()
        assert h is not None
        return h.speculation

    before = stats()
    # One forced copy (whose drafts are accepted), and two requests the model writes as
    # it likes: the counters add up whatever was drafted.
    finals = [
        w.generate(prompt=COPY, sampling=greedy(32, logit_bias=digits), constraint=forced(DIGITS))[
            1
        ]
    ]
    finals += [w.generate(prompt=p, sampling=greedy(32))[1] for p in (PROSE, COPY[40:])]
    after = stats()
    assert after.kind == "ngram"
    assert after.drafted_tokens - before.drafted_tokens == sum(
        f.routing.drafted_tokens for f in finals
    )
    assert after.accepted_tokens - before.accepted_tokens == sum(
        f.routing.accepted_tokens for f in finals
    )
    assert finals[0].routing.accepted_tokens > 0
    assert 0 < after.accepted_tokens <= after.drafted_tokens
    assert 0 <= after.disabled_requests - before.disabled_requests <= len(finals)
    plain = workers["plain"].health()
    assert plain is not None
    assert plain.speculation == engine_pb2.SpeculationStats()


def test_draft_model_speculates(workers: dict[str, Worker], digits: dict[int, float]) -> None:
    """The draft model proposes its own greedy tokens (no grammar): that it copies the
    digits from the prompt well enough for some to be accepted is the one thing here
    the model decides (it leads by several nats when copying); the rest is pinned."""
    sampling = with_logprobs(32, digits)
    plain = run(workers["plain"], COPY, sampling, constraint=forced(DIGITS))
    spec = run(workers["model"], COPY, sampling, constraint=forced(DIGITS))
    routing = spec.final.routing
    assert routing.speculation == "model"
    assert 0 < routing.accepted_tokens <= routing.drafted_tokens
    assert spec.final.usage.completion_tokens == 32
    assert_same_stream(plain, spec)
    h = workers["model"].health()
    assert h is not None
    assert h.speculation.kind == "model"
    assert h.speculation.drafted_tokens >= routing.drafted_tokens


def test_draft_model_rejections_are_rolled_back(
    workers: dict[str, Worker], digits: dict[int, float]
) -> None:
    """The forced copy jumps twice, where the draft model (if it copies) goes on with
    the digits it was copying, or (if not) guesses among ten. The target's cache must
    lose every rejected token, or the next decode fails or reads a stale draft. That a
    guess at a jump is wrong is the model's doing, by at least nine chances to one."""
    sampling = with_logprobs(40, digits)
    plain = run(workers["plain"], COPY, sampling, constraint=forced(JUMPS))
    spec = run(workers["model"], COPY, sampling, constraint=forced(JUMPS))
    routing = spec.final.routing
    assert routing.drafted_tokens > 0
    assert routing.accepted_tokens < routing.drafted_tokens, routing
    assert_same_stream(plain, spec)
    assert_cache_holds_the_stream(workers["model"], spec.final)


def test_generation_runs_to_the_end_of_the_context(
    model_path: Path, digits: dict[int, float]
) -> None:
    """Drafts near the context's end: the request ends exactly when plain decoding does."""
    spawner = Spawner(model_path)
    try:
        w = spawner(slots=1, context_per_slot=256, threads=1, speculation=launches.ngram())
        w.wait_ready()
        # No max_tokens: generate until the slot's context is full.
        deltas, final = w.generate(
            prompt=COPY,
            sampling=inference_pb2.Sampling(temperature=0.0, logit_bias=digits),
            constraint=forced(DIGITS * 2),
        )
    finally:
        spawner.close()
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens + final.usage.completion_tokens == 256
    assert final.routing.accepted_tokens > 0
    assert sum(d.tokens for d in deltas) == final.usage.completion_tokens
