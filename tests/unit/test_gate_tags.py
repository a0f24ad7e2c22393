"""Gate watchers' tags: how they read, what a Lane's admission notes of them, and what
a watcher hears back (`blazar.api.gate_tags`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, gate_tags
from blazar.dataplane import admission, dispatcher
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.rpc import status
from tests.dispatching import one_slot_route
from tests.unit.test_dataplane_admission import outcome, plane, policy
from tests.unit.test_dispatcher_parking import SlowParker

BATCH = admission.Policy(name="batch", max_queue_depth=8)
NO_QUEUE = admission.Policy(name="no-queue", max_queue_depth=0)


@pytest.mark.parametrize(
    ("value", "tag"),
    [
        ("w1:7", gate_tags.Tag("w1", 7)),
        (b"w1:7", gate_tags.Tag("w1", 7)),
        ("a-B_9:0", gate_tags.Tag("a-B_9", 0)),
        (f"{'w' * 64}:1", gate_tags.Tag("w" * 64, 1)),
        (f"w:{2**64 - 1}", gate_tags.Tag("w", 2**64 - 1)),
        # Malformed: no tag.
        ("w1", None),
        ("w1:", None),
        (":7", None),
        ("w1:-7", None),
        ("w1:+7", None),
        ("w1:7.0", None),
        ("w1: 7", None),
        ("w1:\u00b2", None),  # a digit to str.isdigit, not a number
        ("w:1:2", None),  # a colon in the id
        ("w 1:2", None),
        (f"{'w' * 65}:1", None),
        (f"w:{2**64}", None),
        ("w:" + "9" * 400, None),
        (b"w\xff:1", None),
    ],
)
def test_a_tag_reads_as_watcher_colon_n_or_not_at_all(
    value: str | bytes, tag: gate_tags.Tag | None
) -> None:
    assert gate_tags.parse(value) == tag


def test_the_tag_is_read_from_its_metadata_key_only() -> None:
    assert gate_tags.of_metadata([("x-request-id", "w:1"), ("x-blazar-gate-seq", "w:2")]) == (
        gate_tags.Tag("w", 2)
    )
    assert gate_tags.of_metadata([("x-request-id", "w:1")]) is None


def ticket(id: str, policy: admission.Policy = BATCH) -> admission.Ticket:
    return admission.Ticket(id, policy, time.monotonic(), prompt_tokens=10, max_tokens=100)


def tag(watcher: str, n: int) -> gate_tags.Tag:
    return gate_tags.Tag(watcher, n)


def test_a_lane_notes_the_highest_tag_of_each_watcher_whatever_became_of_it() -> None:
    async def run() -> list[dict[str, int]]:
        lane = LaneDispatcher(one_slot_route(), parker=SlowParker())
        seen = []
        try:
            await lane.admit(ticket("a"), request_id="a", prompt_chars=40, tag=tag("w1", 3))
            seen.append(lane.seen())
            # The slot is taken: refused at once, noted all the same.
            with pytest.raises(errors.QueueFull):
                await lane.admit(
                    ticket("b", NO_QUEUE), request_id="b", prompt_chars=40, tag=tag("w1", 5)
                )
            seen.append(lane.seen())
            # Queued (it waits for the slot); a lower n arriving late leaves the highest.
            waiting = asyncio.create_task(
                lane.admit(ticket("c"), request_id="c", prompt_chars=40, tag=tag("w1", 4))
            )
            await asyncio.sleep(0.05)
            seen.append(lane.seen())
            # Untagged, and another watcher's.
            untagged = asyncio.create_task(lane.admit(ticket("d"), request_id="d", prompt_chars=40))
            other = asyncio.create_task(
                lane.admit(ticket("e"), request_id="e", prompt_chars=40, tag=tag("w2", 1))
            )
            await asyncio.sleep(0.05)
            seen.append(lane.seen())
            for task in (waiting, untagged, other):
                task.cancel()
        finally:
            await lane.close()
        return seen

    assert asyncio.run(run()) == [
        {"w1": 3},
        {"w1": 5},
        {"w1": 5},
        {"w1": 5, "w2": 1},
    ]


def test_a_lane_remembers_the_watchers_heard_from_last() -> None:
    async def run() -> tuple[dict[str, int], dict[str, int]]:
        lane = LaneDispatcher(one_slot_route(), parker=SlowParker())
        try:
            refused = NO_QUEUE
            # The first takes the slot; the others are refused at once.
            await lane.admit(ticket("t0"), request_id="t0", prompt_chars=4, tag=tag("w0", 1))
            for k in range(1, dispatcher.MAX_WATCHERS):
                with pytest.raises(errors.QueueFull):
                    await lane.admit(
                        ticket(f"t{k}", refused),
                        request_id=f"t{k}",
                        prompt_chars=4,
                        tag=tag(f"w{k}", 1),
                    )
            # w0 is heard from again: it is now the latest, and w1 the oldest.
            with pytest.raises(errors.QueueFull):
                await lane.admit(
                    ticket("again", refused), request_id="again", prompt_chars=4, tag=tag("w0", 2)
                )
            full = lane.seen()
            with pytest.raises(errors.QueueFull):
                await lane.admit(
                    ticket("new", refused), request_id="new", prompt_chars=4, tag=tag("new", 1)
                )
            return full, lane.seen()
        finally:
            await lane.close()

    full, after = asyncio.run(run())
    assert len(full) == dispatcher.MAX_WATCHERS and full["w0"] == 2
    assert len(after) == dispatcher.MAX_WATCHERS
    assert "w1" not in after and after["new"] == 1 and after["w0"] == 2


def test_a_watcher_hears_which_of_its_requests_the_gates_include() -> None:
    """Through the data plane: the tag travels as metadata, a malformed one is ignored
    (its request is served), and the stream names the highest tag each Lane took in."""

    async def run() -> tuple[Any, ...]:
        async with plane(policy("zero", max_queue_depth=0), lane_policy="zero") as p:
            malformed = (("x-blazar-gate-seq", "w1:not-a-number"),)
            held = p.stub.Complete(
                inference_pb2.CompleteRequest(model="l", prompt="hold"), metadata=malformed
            )
            assert (await held.read()).delta.text == "x"
            # The slot is taken and nothing may queue: refused, and noted.
            refused = await outcome(
                p.stub.Complete(
                    inference_pb2.CompleteRequest(model="l", prompt="refused"),
                    metadata=(("x-blazar-gate-seq", "w1:7"),),
                )
            )
            watched = p.stub.WatchAdmission(inference_pb2.WatchAdmissionRequest(watcher="w1"))
            mine = await watched.read()
            watched.cancel()
            anonymous = p.stub.WatchAdmission(inference_pb2.WatchAdmissionRequest())
            theirs = await anonymous.read()
            anonymous.cancel()
            bad = p.stub.WatchAdmission(inference_pb2.WatchAdmissionRequest(watcher="a:b"))
            try:
                await bad.read()
                invalid: errors.BlazarError | None = None
            except grpc.aio.AioRpcError as exc:
                invalid = status.from_rpc_error(exc)
            p.engine.gate("hold").set()
            return refused, mine, theirs, invalid, await outcome(held)

    refused, mine, theirs, invalid, held = asyncio.run(run())
    assert isinstance(refused, errors.QueueFull)
    assert [(g.lane, g.reason) for g in mine.closed] == [("l", "QUEUE_FULL")]
    assert dict(mine.seen) == {"l": 7}
    assert list(theirs.closed) == list(mine.closed) and dict(theirs.seen) == {}
    assert isinstance(invalid, errors.InvalidRequest) and invalid.metadata["field"] == "watcher"
    assert held is None
