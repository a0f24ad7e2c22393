"""The decode loop in-process, with the bundled model: what its waiting line does."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.engine import jobs, loop, sampling
from tests import launches
from tests.integration.engine_harness import poll

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def running(model_path: Path, *, slots: int) -> Iterator[loop.DecodeLoop]:
    loaded = threading.Event()
    decode = loop.DecodeLoop(
        launches.engine(launches.spec(model_path, slots=slots, context_per_slot=512)),
        on_loaded=lambda _error: loaded.set(),
    )
    decode.start()
    try:
        assert loaded.wait(120), "the model did not load"
        yield decode
    finally:
        decode.stop()
        decode.join(60)


@pytest.fixture
def one_slot(model_path: Path) -> Iterator[loop.DecodeLoop]:
    with running(model_path, slots=1) as decode:
        yield decode


def job(
    decode: loop.DecodeLoop,
    name: str,
    *,
    arrived: float,
    log: list[str],
    bias: dict[int, float] | None = None,
) -> jobs.Job:
    def deliver(event: jobs.Event) -> None:
        log.append(f"{name}:{type(event).__name__}")

    params = sampling.resolve(
        inference_pb2.Sampling(temperature=0.0, logit_bias=bias), vocab=decode.vocab
    )
    return jobs.Job(
        request_id=name,
        prompt=decode.vocab.tokenize(f"A story about {name}:"),
        params=params,
        max_tokens=256 if name == "busy" else 4,
        deliver=deliver,
        arrived=arrived,
    )


def test_waiting_jobs_start_in_order_of_arrival_not_of_submission(
    one_slot: loop.DecodeLoop, no_eog: dict[int, float]
) -> None:
    """Jobs are submitted once prepared, and preparing runs in a thread pool, so a job
    that arrived first can be submitted second; it must still start first. The busy
    job cannot stop by itself (end-of-generation banned): it holds the only slot until
    it is cancelled, with both others waiting."""
    log: list[str] = []
    busy = job(one_slot, "busy", arrived=0.0, log=log, bias=no_eog)
    one_slot.submit(busy)
    poll(lambda: "busy:TextDelta" in log, what="the only slot to be busy")
    one_slot.submit(job(one_slot, "second", arrived=2.0, log=log))
    one_slot.submit(job(one_slot, "first", arrived=1.0, log=log))
    busy.cancel()
    poll(lambda: "second:Finished" in log, deadline_s=60, what="both waiting jobs to finish")
    starts = [entry.split(":")[0] for entry in log if not entry.startswith("busy")]
    assert starts.index("first") < starts.index("second")
    assert starts[0] == "first"


@pytest.fixture
def two_slots(model_path: Path) -> Iterator[loop.DecodeLoop]:
    with running(model_path, slots=2) as decode:
        yield decode


def test_a_slot_counts_as_used_until_its_generation_ends(
    two_slots: loop.DecodeLoop, no_eog: dict[int, float]
) -> None:
    """The slot that finished last is kept; an unrelated prompt takes the other one."""
    finished: dict[str, jobs.Finished] = {}

    def start(name: str, prompt: str, max_tokens: int) -> None:
        def deliver(event: jobs.Event) -> None:
            if isinstance(event, jobs.Finished):
                finished[name] = event

        # No end-of-generation: each job runs to its max_tokens, so "long" ends last.
        params = sampling.resolve(
            inference_pb2.Sampling(temperature=0.0, logit_bias=no_eog), vocab=two_slots.vocab
        )
        two_slots.submit(
            jobs.Job(
                request_id=name,
                prompt=two_slots.vocab.tokenize(prompt),
                params=params,
                max_tokens=max_tokens,
                deliver=deliver,
            )
        )

    start("long", "Once upon a time, in a village by the sea,", 48)  # starts first, ends last
    start("short", "The recipe for a good loaf of bread", 2)
    poll(lambda: {"long", "short"} <= finished.keys(), deadline_s=60, what="both to finish")
    assert finished["long"].completion_tokens == 48
    start("next", "Quantum physics explains how", 2)
    poll(lambda: "next" in finished, deadline_s=60, what="the third request")
    assert finished["next"].slot == finished["short"].slot != finished["long"].slot
