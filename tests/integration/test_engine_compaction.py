"""A generation moved to gather the busy slots, on a real worker with the bundled model.

Three slots, three streams on slots 0, 1 and 2; the one on slot 1 ends after a few
tokens, which would leave the other two decoding in two forward passes a step. One of
them moves, cache and all, into slot 1 (`batching.compaction`), and both go on exactly
as they ran alone on another worker: the same tokens up to a near-tie, the same
logprobs up to rounding (`test_engine_parking`'s comparison), as many tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import pinning
from tests.integration.engine_harness import Spawner, Worker, greedy, poll
from tests.integration.test_engine_parking import LOGPROB_TOLERANCE, Stream, start

pytestmark = pytest.mark.slow

SETTINGS = {"slots": 3, "context_per_slot": 512, "threads": 1}
FIRST = "1, 2, 3, 4, 5, 6, 7,"
SHORT = "Monday, Tuesday, Wednesday,"
LAST = "a, b, c, d, e, f, g,"
TOKENS = 40


@pytest.fixture(scope="module")
def workers(model_path: Path) -> Iterator[tuple[Worker, Worker]]:
    spawner = Spawner(model_path)
    alone, shared = spawner(**SETTINGS), spawner(**SETTINGS)
    alone.wait_ready()
    shared.wait_ready()
    yield alone, shared
    spawner.close()


def test_a_stream_moved_to_gather_the_slots_goes_on_as_it_was(
    workers: tuple[Worker, Worker], no_eog: dict[int, float], model_path: Path
) -> None:
    alone, shared = workers
    sampling = greedy(TOKENS, logit_bias=no_eog, logprobs=True, top_logprobs=5)
    references = {}
    for name, prompt in (("first", FIRST), ("last", LAST)):
        reference = start(alone, name, prompt, sampling)
        reference.end()
        references[name] = reference

    first = start(shared, "first", FIRST, sampling)
    poll(lambda: first.tokens >= 1, deadline_s=60, what="the first stream's first token")
    short = start(shared, "short", SHORT, greedy(3, logit_bias=no_eog))
    poll(lambda: short.tokens >= 1, deadline_s=60, what="the short stream's first token")
    last = start(shared, "last", LAST, sampling)
    assert short.end().routing.slot == 1
    finals = {"first": first.end(), "last": last.end()}

    # One of the two now decodes in slot 1, beside the other: one run of slots.
    assert {f.routing.slot for f in finals.values()} in ({0, 1}, {1, 2})
    banned = pinning.end_of_generation(model_path)
    for name, stream in (("first", first), ("last", last)):
        reference: Stream = references[name]
        assert finals[name].usage.completion_tokens == TOKENS == stream.tokens
        ids = [lp.id for lp in stream.scores]
        parted = pinning.common_greedy_prefix(reference.scores, ids, banned=banned)
        assert parted >= TOKENS // 2, f"{name} parts from its reference at {parted}"
        diffs = [
            abs(a.logprob - b.logprob)
            for a, b in zip(reference.scores[:parted], stream.scores[:parted], strict=True)
        ]
        assert sum(diffs) / len(diffs) <= LOGPROB_TOLERANCE, max(diffs)
