"""Preemption (Park / Resume) on a real worker with the bundled model.

One slot, so that a second request can run only in the slot the parked one left. Each
stream is compared with the same request run without a pause: the same tokens up to a
near-tie (llama.cpp is not batch-invariant, and a re-prefilled cache is computed in
other batches than the one decoded token by token), the same logprobs up to rounding,
exactly as many tokens, and the parked memory back to 0 afterwards. Both ways back are
run: the cache restored from host memory, and (bound 0) its tokens prefilled again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from tests.integration import pinning
from tests.integration.engine_harness import Spawner, Worker, greedy, poll, rpc_error

pytestmark = pytest.mark.slow

# One thread: on the shared 2-core machine two llama.cpp threads spin on each other.
SETTINGS = {"slots": 1, "context_per_slot": 1024, "threads": 1}
# Far from any tie for its first 24 tokens (test_engine_batching measured it).
COUNTING = "1, 2, 3, 4, 5, 6, 7,"
URGENT = "Monday, Tuesday, Wednesday,"
TOKENS = 32
# Park once this many tokens have arrived.
PARK_AFTER = 8
# Mean absolute logprob difference allowed (test_engine_speculation's tolerance).
LOGPROB_TOLERANCE = 0.1
DIGITS = pinning.digit_string(40, seed=17)


@pytest.fixture(scope="module", params=[1024, 0], ids=["kv-restored", "prefilled-again"])
def worker(model_path: Path, request: pytest.FixtureRequest) -> Iterator[Worker]:
    spawner = Spawner(model_path)
    w = spawner(**SETTINGS, max_parked_mib=request.param)
    w.wait_ready()
    yield w
    spawner.close()


@dataclass
class Stream:
    """One Generate call read on its own thread."""

    call: Any
    deltas: list[inference_pb2.Delta] = field(default_factory=list)
    final: inference_pb2.Final | None = None
    error: grpc.RpcError | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._consume)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for chunk in self.call:
                if chunk.HasField("delta"):
                    self.deltas.append(chunk.delta)
                else:
                    self.final = chunk.final
        except grpc.RpcError as exc:
            self.error = exc

    @property
    def tokens(self) -> int:
        return sum(d.tokens for d in self.deltas)

    @property
    def scores(self) -> list[Any]:
        return [lp for d in list(self.deltas) for lp in d.logprobs]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    def end(self) -> inference_pb2.Final:
        self.thread.join(120)
        assert self.error is None and self.final is not None, self.error
        return self.final


def start(
    w: Worker, request_id: str, prompt: str, sampling: inference_pb2.Sampling, **kw: Any
) -> Stream:
    request = engine_pb2.GenerateRequest(
        prompt=prompt, sampling=sampling, request_id=request_id, **kw
    )
    return Stream(w.stub.Generate(request, timeout=120))


def park_mid_stream(w: Worker, stream: Stream, request_id: str) -> engine_pb2.ParkResponse:
    """Park once PARK_AFTER tokens have arrived; wait for those already sent."""
    poll(lambda: stream.tokens >= PARK_AFTER, deadline_s=60, what=f"{PARK_AFTER} tokens")
    parked: engine_pb2.ParkResponse = w.stub.Park(
        engine_pb2.ParkRequest(request_id=request_id), timeout=30
    )
    return parked


def run_in_freed_slot(w: Worker, stream: Stream, at_park: int) -> None:
    """Another request runs to its end in the only slot while the stream stays put."""
    _, final = w.generate(prompt=URGENT, sampling=greedy(8), request_id="urgent")
    assert final.usage.completion_tokens >= 1 and final.routing.slot == 0
    assert stream.final is None and stream.tokens == at_park, "a parked stream must pause"


def assert_parked(w: Worker, parked: engine_pb2.ParkResponse, *, bound_mib: int) -> None:
    h = w.health()
    assert h is not None
    assert (h.parked, h.parked_bytes, h.parked_bytes_max) == (
        1,
        parked.parked_bytes,
        bound_mib << 20,
    )
    assert not h.slots[0].busy
    if bound_mib:
        assert parked.parked_bytes > 0
    else:
        assert parked.parked_bytes == 0


def assert_nothing_parked(w: Worker) -> None:
    h = w.health()
    assert h is not None and (h.parked, h.parked_bytes) == (0, 0)


def bound_of(w: Worker) -> int:
    h = w.health()
    assert h is not None
    return h.parked_bytes_max >> 20


def test_a_parked_stream_goes_on_where_it_stopped(
    worker: Worker, no_eog: dict[int, float], model_path: Path
) -> None:
    sampling = greedy(TOKENS, logit_bias=no_eog, logprobs=True, top_logprobs=5)
    reference = start(worker, "reference", COUNTING, sampling)
    reference.end()
    stream = start(worker, "parked", COUNTING, sampling)
    parked = park_mid_stream(worker, stream, "parked")
    prompt_tokens = reference.final.usage.prompt_tokens if reference.final else 0
    # The cache holds the prompt and every token sent but the last (sampled, pending).
    at_park = parked.tokens - prompt_tokens + 1
    assert PARK_AFTER <= at_park < TOKENS
    poll(lambda: stream.tokens == at_park, what="the tokens sent before the park")
    assert_parked(worker, parked, bound_mib=bound_of(worker))
    run_in_freed_slot(worker, stream, at_park)

    resumed: engine_pb2.ResumeResponse = worker.stub.Resume(
        engine_pb2.ResumeRequest(request_id="parked"), timeout=60
    )
    assert resumed.slot == 0 and resumed.parked_ms > 0
    if parked.parked_bytes:
        assert (resumed.restored_bytes, resumed.refill_tokens) == (parked.parked_bytes, 0)
    else:
        assert resumed.restored_bytes == 0 and 0 < resumed.refill_tokens <= parked.tokens
    final = stream.end()
    assert_nothing_parked(worker)

    assert final.usage.completion_tokens == TOKENS == stream.tokens
    assert final.timings.parked_ms >= resumed.parked_ms
    ids = [lp.id for lp in stream.scores]
    assert len(ids) == TOKENS
    parted = pinning.common_greedy_prefix(
        reference.scores, ids, banned=pinning.end_of_generation(model_path)
    )
    # Not lost, not repeated: the tokens on both sides of the pause are the reference's.
    assert parted > at_park, f"the resumed stream parts from the reference at {parted}"
    diffs = [
        abs(a.logprob - b.logprob)
        for a, b in zip(reference.scores[:parted], stream.scores[:parted], strict=True)
    ]
    assert sum(diffs) / len(diffs) <= LOGPROB_TOLERANCE, max(diffs)


def test_a_parked_grammar_goes_on_from_its_state(
    worker: Worker, no_eog: dict[int, float], model_path: Path
) -> None:
    """The sampler is kept whole: a grammar that allows one digit string is half-way
    through it when parked, and the resumed stream writes the rest, not the start."""
    assert pinning.digits_have_one_token_each(model_path)
    sampling = greedy(
        len(DIGITS) + 1,
        logit_bias=pinning.sole_spelling_bias(model_path, "0123456789"),
        logprobs=True,
    )
    forced = inference_pb2.Constraint(grammar=pinning.exactly(DIGITS))
    reference = start(
        worker, "reference", f"Digits: {DIGITS}\nAgain: ", sampling, constraint=forced
    )
    reference.end()
    stream = start(worker, "parked", f"Digits: {DIGITS}\nAgain: ", sampling, constraint=forced)
    parked = park_mid_stream(worker, stream, "parked")
    assert_parked(worker, parked, bound_mib=bound_of(worker))
    worker.stub.Resume(engine_pb2.ResumeRequest(request_id="parked"), timeout=60)
    final = stream.end()
    assert_nothing_parked(worker)
    assert stream.text == reference.text == DIGITS
    assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == len(DIGITS) + 1
    ours, theirs = [s.logprob for s in stream.scores], [s.logprob for s in reference.scores]
    assert len(ours) == len(theirs) == len(DIGITS)
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    assert sum(diffs) / len(diffs) <= LOGPROB_TOLERANCE, max(diffs)


def test_orders_and_cancel_of_a_parked_stream(worker: Worker, no_eog: dict[int, float]) -> None:
    """Unknown requests are NOT_FOUND, a second park FAILED_PRECONDITION; a caller that
    leaves while parked frees the memory."""
    assert (
        rpc_error(
            lambda: worker.stub.Park(engine_pb2.ParkRequest(request_id="nobody"), timeout=10)
        ).code()
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        rpc_error(
            lambda: worker.stub.Resume(engine_pb2.ResumeRequest(request_id="nobody"), timeout=10)
        ).code()
        == grpc.StatusCode.NOT_FOUND
    )
    stream = start(worker, "leaving", COUNTING, greedy(200, logit_bias=no_eog))
    parked = park_mid_stream(worker, stream, "leaving")
    assert_parked(worker, parked, bound_mib=bound_of(worker))
    again = rpc_error(
        lambda: worker.stub.Park(engine_pb2.ParkRequest(request_id="leaving"), timeout=10)
    )
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
    stream.call.cancel()
    stream.thread.join(30)

    def freed() -> bool:
        h = worker.health()
        return h is not None and h.parked == 0 and h.parked_bytes == 0

    poll(freed, what="the parked memory to be freed")
