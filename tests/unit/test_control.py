"""blazar.v1.Control over a real gRPC server on port 0, backed by a MemoryStore."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from blazar.api import manifests
from blazar.dataplane import server
from blazar.rpc import status
from blazar.store.memory import MemoryStore

MODEL = {
    "apiVersion": "blazar.dev/v1alpha1",
    "kind": "Model",
    "metadata": {"name": "m", "labels": {"tier": "small"}},
    "spec": {"source": {"path": "/m.gguf"}},
}
LANE = {
    "apiVersion": "blazar.dev/v1alpha1",
    "kind": "Lane",
    "metadata": {"name": "l"},
    "spec": {"model": "m"},
}

Body = Callable[[control_pb2_grpc.ControlStub, MemoryStore], Coroutine[Any, Any, None]]


def run(body: Body) -> None:
    async def main() -> None:
        store = MemoryStore()
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                await body(control_pb2_grpc.ControlStub(channel), store)
        finally:
            await plane.stop(grace=0)

    asyncio.run(main())


def apply_request(*objs: dict[str, Any], dry_run: bool = False) -> control_pb2.ApplyRequest:
    return control_pb2.ApplyRequest(objects_json=[json.dumps(o) for o in objs], dry_run=dry_run)


def test_apply_create_configure_unchanged_and_get_list_delete() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        first = await stub.Apply(apply_request(MODEL, LANE))
        assert [(r.kind, r.name, r.action) for r in first.results] == [
            ("Model", "m", "created"),
            ("Lane", "l", "created"),
        ]
        again = await stub.Apply(
            apply_request(MODEL, {**LANE, "spec": {"model": "m", "replicas": 2}})
        )
        assert [r.action for r in again.results] == ["unchanged", "configured"]
        lane = json.loads(
            (await stub.Get(control_pb2.GetRequest(kind="lanes", name="l"))).object_json
        )
        assert lane["metadata"]["generation"] == 2 and lane["spec"]["replicas"] == 2
        listed = await stub.List(control_pb2.ListRequest(kind="model", label_selector="tier=small"))
        assert [json.loads(o)["metadata"]["name"] for o in listed.objects_json] == ["m"]
        none = await stub.List(control_pb2.ListRequest(kind="model", label_selector="tier=big"))
        assert list(none.objects_json) == []
        await stub.Delete(control_pb2.DeleteRequest(kind="lane", name="l"))
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Get(control_pb2.GetRequest(kind="lane", name="l"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    run(body)


def test_rejected_batch_changes_nothing_and_is_an_event() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        bad_lane = {**LANE, "spec": {"model": "missing", "replicas": "x", "colour": "blue"}}
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await stub.Apply(apply_request(MODEL, bad_lane))
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = rejected.value.details() or ""
        for path in ("Lane/l: spec.replicas", "Lane/l: spec.colour", "Lane/l: spec.model"):
            assert path in details
        assert store.list() == []
        assert [e.reason for e in store.events()] == ["ManifestRejected"]

    run(body)


def test_a_stale_resource_version_is_aborted_as_a_conflict_and_writes_nothing() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        await stub.Apply(apply_request(MODEL, LANE))
        got = json.loads(
            (await stub.Get(control_pb2.GetRequest(kind="lane", name="l"))).object_json
        )
        read_at = got["metadata"]["resourceVersion"]
        # Someone else changes the Lane after it was read.
        await stub.Apply(apply_request({**LANE, "spec": {"model": "m", "replicas": 3}}))
        now = read_at + 1
        got["spec"]["replicas"] = 2
        new_model = {**MODEL, "metadata": {"name": "m2"}}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Apply(apply_request(new_model, got))
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert refused.value.details() == (
            f"Lane/l has been modified since resourceVersion {read_at} (now {now}); get it "
            "again, apply your change to it, and apply that."
        )
        raw = dict(refused.value.trailing_metadata() or ())[status.DETAILS_KEY]
        (detail,) = status_pb2.Status.FromString(raw).details
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info)
        assert (info.reason, info.domain) == ("CONFLICT", "blazar.dev")
        assert dict(info.metadata)["current_resource_version"] == str(now)
        # All or nothing: the new Model in the same batch was not created either.
        assert [o.metadata.name for o in store.list()] == ["l", "m"]
        assert store.resource_version == now
        # Read again, changed again, applied: accepted.
        got = json.loads(
            (await stub.Get(control_pb2.GetRequest(kind="lane", name="l"))).object_json
        )
        got["spec"]["replicas"] = 2
        (result,) = (await stub.Apply(apply_request(got))).results
        assert result.action == "configured"
        # A version on an object that does not exist: nothing to be at that version.
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Apply(
                apply_request({**got, "metadata": {"name": "x", "resourceVersion": 3}})
            )
        assert missing.value.code() == grpc.StatusCode.ABORTED
        assert "remove metadata.resourceVersion to create it" in (missing.value.details() or "")

    run(body)


def test_a_batch_with_bad_json_is_rejected_and_recorded() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        request = control_pb2.ApplyRequest(
            objects_json=[json.dumps(MODEL), "{not json"], field_manager="tool"
        )
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await stub.Apply(request)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "object#2: not valid JSON" in (rejected.value.details() or "")
        assert store.list() == []
        assert [(e.name, e.reason) for e in store.events()] == [("tool", "ManifestRejected")]

    run(body)


@pytest.mark.parametrize(
    ("sources", "where"),
    [
        (["fleet/models.yaml#1", "fleet/lanes.yaml#2"], "Lane/l (fleet/lanes.yaml#2)"),
        # Not one per object, or not fit to quote: each by its place in the batch.
        (["fleet/models.yaml#1"], "Lane/l (object#2)"),
        (["fleet/models.yaml#1", "a\nb"], "Lane/l (object#2)"),
        (["fleet/models.yaml#1", "x" * 1025], "Lane/l (object#2)"),
    ],
)
def test_a_rejected_batch_names_the_files_the_client_read(sources: list[str], where: str) -> None:
    """`blazar apply -f fleet/` was refused naming `fleet/lanes.yaml#2`, but the
    ManifestRejected event that `blazar events` shows later said `object#2`."""
    bad_lane = {**LANE, "spec": {"model": "m", "replicas": -1}}

    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        request = control_pb2.ApplyRequest(
            objects_json=[json.dumps(MODEL), json.dumps(bad_lane)],
            field_manager="blazar-cli",
            sources=sources,
        )
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await stub.Apply(request)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (event,) = store.events()
        assert (event.name, event.reason) == ("blazar-cli", "ManifestRejected")
        assert f"{where}: spec.replicas" in event.message

    run(body)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1]", "object#2: expected a JSON object, got an array"),
        ("5", "object#2: expected a JSON object, got a number"),
        ("null", "object#2: expected a JSON object, got null"),
        ('"Model"', "object#2: expected a JSON object, got a string"),
        ("[" * 100_000, "object#2: not valid JSON: its arrays and objects are nested too deeply"),
        # Found by tests/integration/fuzz/test_manifests.py: a ValueError, not a decode error.
        ('{"a": 1' + "0" * 5000 + "}", "object#2: not valid JSON: Exceeds the limit"),
        ('{"apiVersion": "\\ud800"}', "object#2: apiVersion: holds an unpaired surrogate"),
        ('{"spec": {"x\\udfff": [1]}}', "object#2: spec.x\\udfff: holds an unpaired surrogate"),
        # As YAML's loader refuses it: the last value is not silently kept.
        (
            '{"kind": "Lane", "spec": {"slots": 1, "slots": 3}}',
            'object#2: not valid JSON: the key "slots" is given twice in one object',
        ),
    ],
)
def test_a_document_that_is_no_json_object_is_invalid_not_a_crash(text: str, problem: str) -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        request = control_pb2.ApplyRequest(objects_json=[json.dumps(MODEL), text])
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await stub.Apply(request)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert problem in (rejected.value.details() or "")
        assert store.list() == []

    run(body)


def test_dry_run_writes_nothing() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        result = await stub.Apply(apply_request(MODEL, dry_run=True))
        assert [r.action for r in result.results] == ["created"]
        assert store.list() == []

    run(body)


def test_unknown_kind_is_invalid_argument() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.List(control_pb2.ListRequest(kind="pods"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(body)


def test_watch_sends_existing_then_changes() -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        await stub.Apply(apply_request(MODEL))
        call = stub.Watch(control_pb2.WatchRequest(kind="Model"))
        events: AsyncIterator[control_pb2.WatchEvent] = call.__aiter__()
        first = await asyncio.wait_for(events.__anext__(), timeout=5)
        assert (first.type, json.loads(first.object_json)["metadata"]["name"]) == ("ADDED", "m")
        await stub.Apply(apply_request(LANE))  # another kind: filtered out
        await stub.Delete(control_pb2.DeleteRequest(kind="model", name="m"))
        second = await asyncio.wait_for(events.__anext__(), timeout=5)
        assert second.type == "DELETED"
        call.cancel()

    run(body)


def test_a_change_while_a_watch_lists_is_sent_once() -> None:
    """A write that lands as a watch starts is either in the list or sent after it,
    never both: the list and the subscription are one instant of the store."""

    class RacingStore(MemoryStore):
        """Another writer gets in on the first list: between a subscription and a
        list taken one after the other, that is where its change would fall."""

        armed = False

        def list(self, kind: Any = None) -> Any:
            if self.armed:
                self.armed = False
                self.apply_all([manifests.from_dict({**MODEL, "metadata": {"name": "racer"}})])
            return super().list(kind)

    async def main() -> None:
        store = RacingStore()
        store.apply_all([manifests.from_dict(MODEL)])
        plane = await server.start(store=store, address="127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
                stub = control_pb2_grpc.ControlStub(channel)
                store.armed = True
                call = stub.Watch(control_pb2.WatchRequest(kind="Model"))
                events: AsyncIterator[control_pb2.WatchEvent] = call.__aiter__()
                seen = []
                for i in range(3):
                    if i == 2:  # what was listed is read: now a change of ours
                        await stub.Delete(control_pb2.DeleteRequest(kind="model", name="m"))
                    event = await asyncio.wait_for(events.__anext__(), timeout=5)
                    name = json.loads(event.object_json)["metadata"]["name"]
                    seen.append((event.type, name, event.resource_version))
                call.cancel()
        finally:
            await plane.stop(grace=0)
        assert [(t, n) for t, n, _ in seen] == [
            ("ADDED", "m"),
            ("ADDED", "racer"),
            ("DELETED", "m"),
        ], seen
        assert seen[0][2] == seen[1][2] < seen[2][2]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("", ["m", "other"]),
        ("tier=small", ["m"]),
        ("tier!=small", ["other"]),  # no tier label: "not small" holds, as in Kubernetes
        ("tier!=big", ["m", "other"]),
        ("tier", ["m"]),
        ("!tier", ["other"]),
        ("tier=small,!tier", []),
    ],
)
def test_list_by_label_selector(selector: str, names: list[str]) -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        other = {**MODEL, "metadata": {"name": "other"}}
        await stub.Apply(apply_request(MODEL, other))
        listed = await stub.List(control_pb2.ListRequest(kind="model", label_selector=selector))
        assert [json.loads(o)["metadata"]["name"] for o in listed.objects_json] == names

    run(body)


@pytest.mark.parametrize("selector", ["tier in (small)", "tier!", "tier=a=b"])
def test_list_refuses_a_selector_it_cannot_read(selector: str) -> None:
    async def body(stub: control_pb2_grpc.ControlStub, store: MemoryStore) -> None:
        await stub.Apply(apply_request(MODEL))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.List(control_pb2.ListRequest(kind="model", label_selector=selector))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"Bad label selector '{selector}'" in (refused.value.details() or "")

    run(body)
