"""Fuzzing what reaches the engine: hypothesis sends at least 1,000 requests through
the public Inference API (`Chat` and `Complete`) of the real daemon, and each ends in
a whole stream (a final chunk) or a clean refusal; the engine's process is the same
at the end.

Through the daemon's public API rather than the engine's own gRPC: that is the only
way untrusted input reaches an engine, and it passes the data plane's checks and
conversion on the way, so a value either is refused there or reaches the engine as
the data plane hands it over, which is what the engine must survive. The requests
(`requests`) cover grammars, JSON schemas, tools, stop strings, logit biases,
Unicode and sampling parameters at and past their bounds. They go one at a time: with
the same 400 draws on the quiet 2-core dev box, 1, 2, 4 and 8 in flight took 19.9,
18.4, 19.6 and 21.3 s (grammars and sampling run on the engine's one decode thread);
the body fuzz run, whose requests mostly stop in the shim, gains from sending several
at once.

A clean refusal is INVALID_ARGUMENT or OUT_OF_RANGE (or NOT_FOUND for a model name
that is not served); INTERNAL, UNKNOWN, UNAVAILABLE or a stream cut without its final
chunk is a bug, and so is an engine restart.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.fuzz import requests, serving
from tests.integration.harness import Daemon

pytestmark = pytest.mark.slow

# At least this many; raise it (BLAZAR_FUZZ_REQUESTS) for a longer hunt.
REQUESTS = int(os.environ.get("BLAZAR_FUZZ_REQUESTS", "1000"))
CLEAN = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Iterator[inference_pb2_grpc.InferenceStub]:
    # The shim's own limits: a 4 MiB request is refused, not the sender's problem.
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(daemon.grpc, options=options) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def outcome(stub: inference_pb2_grpc.InferenceStub, request: Any) -> tuple[str, str]:
    """("ok", "") for a whole stream, else the status code's name and its message."""
    call = stub.Chat if isinstance(request, inference_pb2.ChatRequest) else stub.Complete
    try:
        chunks = list(call(request, timeout=120))
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    if not chunks or not chunks[-1].HasField("final"):
        return "cut", f"{len(chunks)} chunks, none final"
    return "ok", ""


def test_no_engine_bound_request_crashes_or_fails_the_engine(
    daemon: Daemon,
    stub: inference_pb2_grpc.InferenceStub,
    record_property: Callable[..., None],
) -> None:
    started = time.monotonic()
    (pid,) = daemon.pids(serving.LANE)
    restarts = serving.restarts(daemon)
    # Once UNKNOWN: a string field that is not UTF-8, which no protobuf library in
    # Python sends but a C++ or hand-made client can (so it is sent as bytes here).
    good = inference_pb2.CompleteRequest(
        model=serving.LANE, prompt="AB", sampling=inference_pb2.Sampling(max_tokens=1)
    ).SerializeToString()
    with (
        grpc.insecure_channel(daemon.grpc) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        raw = channel.unary_stream("/blazar.v1.Inference/Complete")
        list(raw(good.replace(b"AB", b"\xff\xfe"), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    answers: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=REQUESTS,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(request=st.one_of(requests.chat_request(), requests.complete_request()))
    def run(request: Any) -> None:
        code, message = outcome(stub, request)
        answers[code] += 1
        if code != "ok":
            refusals[message[:60]] += 1
        clean = (
            code == "ok"
            or code in {c.name for c in CLEAN}
            or (code == "NOT_FOUND" and request.model != serving.LANE)
        )
        assert clean, (
            f"{requests.describe(request)}\n-> {code}: {message[:2000]}\n"
            f"{daemon.replica_story(serving.LANE)}"
        )

    run()
    seconds = time.monotonic() - started
    record_property("seconds", round(seconds, 1))
    print(f"engine-bound requests: {dict(answers)} in {seconds:.0f} s")
    print("most frequent refusals:", *refusals.most_common(12), sep="\n  ")
    assert sum(answers.values()) >= REQUESTS
    assert answers["ok"] >= REQUESTS // 5, answers  # most reach the engine, not only refusals

    assert daemon.pids(serving.LANE) == [pid]
    (replica,) = daemon.get("lane", serving.LANE)["status"]["replicaStatuses"]
    assert replica.get("restarts", 0) == restarts, daemon.replica_story(serving.LANE)
    plain = inference_pb2.CompleteRequest(
        model=serving.LANE, prompt="Hi", sampling=inference_pb2.Sampling(max_tokens=1)
    )
    assert outcome(stub, plain) == ("ok", "")
    logged = daemon.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in logged if line.startswith("{")]
    failures = [r for r in records if r.get("level") in ("error", "critical")]
    assert not failures, failures[:5]
