"""Speculative decoding in a real worker: n-gram lookup and a draft model, against the
same requests on a worker without speculation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from tests import launches
from tests.integration.engine_harness import Spawner, Worker, greedy, make_draft_tool

pytestmark = pytest.mark.slow

# One thread: on this shared 2-core machine two llama.cpp threads spin on each other's
# barriers whenever another process holds a core. Nothing here measures speed.
SETTINGS = {"slots": 2, "context_per_slot": 1024, "threads": 1}

PASSAGE = (
    "The river rises in the hills above the town and runs for forty miles to the sea. "
    "In spring the water is high and brown, and the farmers along its banks watch the "
    "sky with care, because a week of rain can flood the lower fields in a single night. "
    "In summer the river is slow and clear, and children swim in the deep pools below "
    "the old stone bridge while their parents sit in the shade of the willows."
)
# A base model continues a passage it has seen twice by copying it a third time.
COPY = f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:80]}"
# Sampled story text: the bundled model's greedy prose falls into loops, which prompt
# lookup would (rightly) speed up; sampled text rarely repeats 8 tokens.
PROSE = (
    "Write a long story about a young girl who finds a map in her grandmother's attic.\n\n"
    "Story:\nThe attic smelled of dust and old paper. Mara pushed open the heavy trunk and"
)
# Batches of other shapes run other CPU kernels, so logits differ in the last bits;
# greedy streams may part only where the plain stream faced a near-tie.
NEAR_TIE = 0.1


@dataclass
class Run:
    ids: list[int]
    # Per position: the plain stream's best minus second-best logprob.
    gaps: list[float]
    text: str
    final: inference_pb2.Final


def run(w: Worker, prompt: str, sampling: inference_pb2.Sampling, **kw: Any) -> Run:
    deltas, final = w.generate(prompt=prompt, sampling=sampling, **kw)
    scores = [lp for d in deltas for lp in d.logprobs]
    gaps = [s.top[0].logprob - s.top[1].logprob if len(s.top) > 1 else 0.0 for s in scores]
    return Run([s.id for s in scores], gaps, "".join(d.text for d in deltas), final)


def assert_same_up_to_near_tie(plain: Run, spec: Run, *, min_common: int) -> None:
    n = min(len(plain.ids), len(spec.ids))
    parted = next((i for i in range(n) if plain.ids[i] != spec.ids[i]), n)
    assert parted == n or plain.gaps[parted] < NEAR_TIE, (parted, plain.gaps[parted])
    assert parted >= min_common, (parted, plain.text, spec.text)


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


def with_logprobs(max_tokens: int, **kw: Any) -> inference_pb2.Sampling:
    return greedy(max_tokens, logprobs=True, top_logprobs=2, **kw)


def test_copying_accepts_drafts_and_keeps_the_greedy_output(workers: dict[str, Worker]) -> None:
    plain = run(workers["plain"], COPY, with_logprobs(48))
    spec = run(workers["ngram"], COPY, with_logprobs(48))
    # The model does copy the passage, so there was something to look up.
    assert plain.text.strip().startswith(PASSAGE[80:120].strip()), plain.text
    routing = spec.final.routing
    assert routing.speculation == "ngram"
    assert routing.accepted_tokens > 24
    assert routing.accepted_tokens <= routing.drafted_tokens
    assert spec.final.usage.completion_tokens == 48
    assert len(spec.ids) == 48  # one logprob per emitted token, drafted or not
    assert_same_up_to_near_tie(plain, spec, min_common=40)
    assert plain.final.routing.speculation == ""
    assert plain.final.routing.drafted_tokens == 0


def test_stop_string_inside_an_accepted_draft(workers: dict[str, Worker]) -> None:
    stop = "deep pools"
    plain = workers["plain"].generate(prompt=COPY, sampling=greedy(64, stop=[stop]))
    spec = workers["ngram"].generate(prompt=COPY, sampling=greedy(64, stop=[stop]))
    texts = ["".join(d.text for d in deltas) for deltas, _ in (plain, spec)]
    assert texts[0] == texts[1]
    assert stop not in texts[1]
    assert spec[1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert spec[1].routing.accepted_tokens > 0
    # The slot's cache holds the stream up to the stop, not the rejected drafts: the
    # same prompt again reuses it and gives the same text.
    again = workers["ngram"].generate(prompt=COPY, sampling=greedy(64, stop=[stop]))
    assert "".join(d.text for d in again[0]) == texts[1]
    assert again[1].usage.cached_tokens > 0


def test_grammar_constrained_request_speculates_exactly(workers: dict[str, Worker]) -> None:
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }
    constraint = inference_pb2.Constraint(json_schema=json.dumps(schema))
    prompt = f'{PASSAGE}\n\nThe passage above as JSON: {{"text": "{PASSAGE[:60]}'
    outs = [
        run(workers[name], prompt, with_logprobs(40), constraint=constraint)
        for name in ("plain", "ngram")
    ]
    assert_same_up_to_near_tie(outs[0], outs[1], min_common=30)
    assert outs[1].text.replace(" ", "").startswith('{"text":"'), outs[1].text
    assert outs[1].final.routing.accepted_tokens > 0


def test_open_prose_switches_speculation_off(workers: dict[str, Worker]) -> None:
    sampling = inference_pb2.Sampling(temperature=0.8, seed=7, max_tokens=96)
    _, final = workers["ngram"].generate(prompt=PROSE, sampling=sampling)
    assert final.usage.completion_tokens == 96
    # Long-match lookup rarely fires on prose, and the policy pauses what misses.
    assert final.routing.drafted_tokens <= 96 // 4, final.routing


def test_health_counters_add_up(workers: dict[str, Worker]) -> None:
    w = workers["ngram"]

    def stats() -> engine_pb2.SpeculationStats:
        h = w.health()
        assert h is not None
        return h.speculation

    before = stats()
    finals = [
        w.generate(prompt=p, sampling=greedy(32))[1] for p in (COPY, PASSAGE[:200], COPY[40:])
    ]
    after = stats()
    assert after.kind == "ngram"
    assert after.drafted_tokens - before.drafted_tokens == sum(
        f.routing.drafted_tokens for f in finals
    )
    assert after.accepted_tokens - before.accepted_tokens == sum(
        f.routing.accepted_tokens for f in finals
    )
    assert 0 < after.accepted_tokens <= after.drafted_tokens
    assert 0 <= after.disabled_requests - before.disabled_requests <= len(finals)
    plain = workers["plain"].health()
    assert plain is not None
    assert plain.speculation == engine_pb2.SpeculationStats()


def test_draft_model_speculates(workers: dict[str, Worker]) -> None:
    plain = run(workers["plain"], COPY, with_logprobs(32))
    spec = run(workers["model"], COPY, with_logprobs(32))
    routing = spec.final.routing
    assert routing.speculation == "model"
    assert 0 < routing.accepted_tokens <= routing.drafted_tokens
    assert spec.final.usage.completion_tokens == 32
    assert_same_up_to_near_tie(plain, spec, min_common=24)
    h = workers["model"].health()
    assert h is not None
    assert h.speculation.kind == "model"
    assert h.speculation.drafted_tokens >= routing.drafted_tokens


def test_rejected_drafts_are_rolled_back(workers: dict[str, Worker]) -> None:
    # Greedy continuation with no near-tie (every top-2 gap > 0.2) in 40 tokens.
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    plain = run(workers["plain"], prompt, with_logprobs(40))
    spec = run(workers["model"], prompt, with_logprobs(40))
    routing = spec.final.routing
    # The draft model guesses wrong often on open text: the target's cache must lose
    # every rejected token, or the next decode fails or reads a stale draft.
    assert routing.accepted_tokens < routing.drafted_tokens, routing
    assert spec.ids == plain.ids


def test_generation_runs_to_the_end_of_the_context(model_path: Path) -> None:
    """Drafts near the context's end: the request ends exactly when plain decoding does."""
    spawner = Spawner(model_path)
    try:
        w = spawner(slots=1, context_per_slot=256, threads=1, speculation=launches.ngram())
        w.wait_ready()
        # No max_tokens: generate until the slot's context is full.
        deltas, final = w.generate(prompt=COPY, sampling=inference_pb2.Sampling(temperature=0.0))
    finally:
        spawner.close()
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens + final.usage.completion_tokens == 256
    assert final.routing.accepted_tokens > 0
    assert sum(d.tokens for d in deltas) == final.usage.completion_tokens
