"""`blazar.v1.Control`: desired state over gRPC, for the CLI and other clients.

Objects travel as JSON. `Apply` decodes them and hands the batch to
`blazar.store.apply`, the admission GitOps uses too; the other RPCs read, delete and
watch the store; `Logs` reads engine replicas' captured output (`logfiles`);
`Version` names the features this daemon acts on (`blazar.api.features`).
Get and List add the data plane's live figures to a Lane's and an
SLOPolicy's status (`status.admission`: queues, running requests, SLO attainment).
Watch and a followed Logs have no end of their own: `close` ends them when the daemon
stops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc

from blazar._proto.v1 import control_pb2, control_pb2_grpc
from blazar.api import errors, features, jsontext, kinds, manifests, meta, selectors
from blazar.api.errors import FieldError
from blazar.enginehost import logfiles, monitor
from blazar.rpc import status
from blazar.store import apply
from blazar.store.base import Event, Store, WatchEvent, WatchType

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

LOG_CHUNK_BYTES = 64 * 1024
# How often `Logs --follow` looks for more output.
LOG_FOLLOW_POLL_S = 0.2

# Figures the daemon holds in memory for an object (admission's queues, attainment),
# merged into its status by Get and List: live, never stored.
LiveStatus: TypeAlias = Callable[[kinds.Kind, str], dict[str, Any]]

# The engines' last Health round (`monitor.HealthMonitor.latest`), for `Top`.
EngineSamples: TypeAlias = Callable[[], Sequence[monitor.Sample]]

T = TypeVar("T")


def _found(kind: kinds.Kind, name: str, obj: kinds.Resource | None) -> kinds.Resource:
    if obj is None:
        raise errors.ObjectNotFound(f'{kind.value} "{name}" not found.')
    return obj


def _dump(obj: kinds.Resource, live: LiveStatus | None = None) -> str:
    data = manifests.to_dict(obj)
    if live is not None:
        extra = live(kinds.Kind(obj.kind), obj.metadata.name)
        if extra:
            data["status"] = {**data.get("status", {}), **extra}
    return json.dumps(data)


# A source longer than this, or not one line of printable text, is not used: it would
# be written into every error and event that names its object.
MAX_SOURCE_CHARS = 1024


def _sources(request: control_pb2.ApplyRequest) -> Sequence[str] | None:
    """Where the client read each object (`ApplyRequest.sources`), if it says so for
    every one of them in a form fit to quote; else None."""
    sources = request.sources
    if len(sources) != len(request.objects_json) or not all(
        0 < len(s) <= MAX_SOURCE_CHARS and s.isprintable() for s in sources
    ):
        return None
    return list(sources)


def _event(e: Event) -> control_pb2.Event:
    return control_pb2.Event(
        time=e.time.isoformat(), type=e.type, reason=e.reason, kind=e.kind, name=e.name,
        message=e.message, uid=e.uid,
    )  # fmt: skip


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(
        self,
        *,
        store: Store,
        live: LiveStatus | None = None,
        log_dir: Path | None = None,
        engines: EngineSamples | None = None,
    ) -> None:
        self._store = store
        self._live = live
        self._log_dir = log_dir
        self._engines = engines
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every Watch and followed Logs stream, and any opened after, with
        UNAVAILABLE saying that the daemon stops. They end only when their caller
        leaves, so the gRPC server's stop would otherwise wait its whole grace period
        for an open `blazar get -w` or `logs -f`, then cut it with gRPC's bare
        "Cancelling all calls"."""
        self._closing.set()

    async def _unless_closed(self, step: Awaitable[T]) -> T:
        """`step`'s result; Unavailable, `step` cancelled, once `close` is called."""
        task = asyncio.ensure_future(step)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((task, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise errors.Unavailable("The Blazar daemon is stopping; this stream ends with it.")
        return task.result()

    async def Apply(
        self, request: control_pb2.ApplyRequest, context: Context
    ) -> control_pb2.ApplyResponse:
        docs: list[tuple[str, dict[str, Any]]] = []
        bad: list[FieldError] = []
        sources = _sources(request)
        for i, text in enumerate(request.objects_json):
            location = sources[i] if sources else f"object#{i + 1}"
            try:
                doc = jsontext.loads(text, unique_keys=True)
            except jsontext.NotJSON as exc:
                bad.append(FieldError(location, f"not valid JSON: {exc}"))
                continue
            if not isinstance(doc, dict):
                bad.append(
                    FieldError(location, f"expected a JSON object, got {errors.json_type(doc)}")
                )
                continue
            docs.append((location, doc))
        try:
            outcomes = apply.apply_documents(
                self._store,
                docs,
                unreadable=bad,
                dry_run=request.dry_run,
                source=request.field_manager or "apply",
                resource_versions=apply.ResourceVersions.PRECONDITION,
            )
        except errors.BlazarError as err:
            await status.abort(context, err)
        return control_pb2.ApplyResponse(
            results=[
                control_pb2.ApplyResult(
                    kind=o.object.kind,
                    name=o.object.metadata.name,
                    action=o.action.value,
                    object_json=_dump(o.object),
                )
                for o in outcomes
            ]
        )

    async def Get(
        self, request: control_pb2.GetRequest, context: Context
    ) -> control_pb2.GetResponse:
        try:
            kind = kinds.resolve_kind(request.kind)
            obj = _found(kind, request.name, self._store.get(kind, request.name))
        except errors.BlazarError as err:
            await status.abort(context, err)
        return control_pb2.GetResponse(object_json=_dump(obj, self._live))

    async def List(
        self, request: control_pb2.ListRequest, context: Context
    ) -> control_pb2.ListResponse:
        try:
            kind = kinds.resolve_kind(request.kind) if request.kind else None
            selector = selectors.parse(request.label_selector)
        except errors.BlazarError as err:
            await status.abort(context, err)
        objs = [o for o in self._store.list(kind) if selector.matches(o.metadata.labels)]
        return control_pb2.ListResponse(
            objects_json=[_dump(o, self._live) for o in objs],
            resource_version=self._store.resource_version,
        )

    async def Delete(
        self, request: control_pb2.DeleteRequest, context: Context
    ) -> control_pb2.DeleteResponse:
        try:
            kind = kinds.resolve_kind(request.kind)
            obj = _found(kind, request.name, self._store.delete(kind, request.name))
        except errors.BlazarError as err:
            await status.abort(context, err)
        return control_pb2.DeleteResponse(object_json=_dump(obj))

    async def Watch(
        self, request: control_pb2.WatchRequest, context: Context
    ) -> AsyncIterator[control_pb2.WatchEvent]:
        try:
            kind = kinds.resolve_kind(request.kind) if request.kind else None
        except errors.BlazarError as err:
            await status.abort(context, err)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()

        def on_event(event: WatchEvent) -> None:
            if kind is None or event.object.kind == kind.value:
                loop.call_soon_threadsafe(queue.put_nowait, event)

        rv, listed, unsubscribe = self._store.list_and_subscribe(kind, on_event)
        try:
            for obj in listed:
                yield control_pb2.WatchEvent(
                    type=WatchType.ADDED.value, object_json=_dump(obj), resource_version=rv
                )
            while True:
                try:
                    event = await self._unless_closed(queue.get())
                except errors.BlazarError as err:
                    await status.abort(context, err)
                yield control_pb2.WatchEvent(
                    type=event.type.value,
                    object_json=_dump(event.object),
                    resource_version=event.resource_version,
                )
        finally:
            unsubscribe()

    async def Events(
        self, request: control_pb2.EventsRequest, context: Context
    ) -> control_pb2.EventsResponse:
        kind: str | None = None
        try:
            if request.kind:
                kind = kinds.resolve_kind(request.kind).value
        except errors.BlazarError:
            kind = request.kind  # events also exist for pseudo-kinds such as "Manifest"
        events = self._store.events(
            kind=kind, name=request.name or None, limit=request.limit or 200
        )
        return control_pb2.EventsResponse(events=[_event(e) for e in events])

    async def Logs(
        self, request: control_pb2.LogsRequest, context: Context
    ) -> AsyncIterator[control_pb2.LogChunk]:
        """The replica's current log file (its last `tail_lines` lines, if set), then
        (`follow`) what is appended to it until the Lane is deleted; when the file is
        rotated (cut to nothing) meanwhile, reading goes on from its start."""
        tail = request.tail_lines if request.HasField("tail_lines") else None
        try:
            if tail is not None and tail < 0:
                raise errors.InvalidRequest(
                    f"tail_lines must be 0 or more, not {tail} (unset: the whole log)",
                    metadata={errors.FIELD_KEY: "tail_lines"},
                )
            path = self._log_path(request.lane, request.replica)
        except errors.BlazarError as err:
            await status.abort(context, err)
        offset = 0
        while True:
            try:
                with path.open("rb") as f:
                    if tail is not None:
                        offset, tail = logfiles.tail_start(f, tail), None
                    elif f.seek(0, 2) < offset:
                        offset = 0  # rotated: what was before is in `.1`, already sent
                    f.seek(offset)
                    while data := f.read(LOG_CHUNK_BYTES):
                        offset += len(data)
                        yield control_pb2.LogChunk(data=data)
            except FileNotFoundError:
                tail = None  # none written yet: whatever comes is new
            if not request.follow or self._store.get(kinds.Kind.LANE, request.lane) is None:
                return  # a deleted Lane writes no more (its last output was sent)
            try:
                await self._unless_closed(asyncio.sleep(LOG_FOLLOW_POLL_S))
            except errors.BlazarError as err:
                await status.abort(context, err)

    def _log_path(self, lane: str, replica: int) -> Path:
        if self._log_dir is None:
            raise errors.Unavailable("this server keeps no engine logs")
        if replica < 0:
            raise errors.InvalidRequest(f"replica must be 0 or more, not {replica}")
        # A name, not a path or a pattern: `../x` or `*` must not reach the file system.
        known = logfiles.replicas(self._log_dir, lane) if meta.is_name(lane) else []
        stored = self._store.get(kinds.Kind.LANE, lane)
        if stored is None and not known:
            raise errors.ObjectNotFound(f'Lane "{lane}" not found.')
        if isinstance(stored, kinds.Lane) and stored.spec.engine == "upstream" and not known:
            # Not "none yet": no engine ever runs for it, so no log will come.
            raise errors.ObjectNotFound(
                f'Lane "{lane}" runs no engine (engine: upstream), so it has no engine log; '
                f"`blazar describe lane {lane}` shows its upstream's health."
            )
        if replica not in known:
            have = ", ".join(map(str, known)) or "none yet"
            raise errors.ObjectNotFound(
                f'Lane "{lane}" has no log of replica {replica} (replicas with logs: {have}).'
            )
        return logfiles.path(self._log_dir, lane, replica)

    async def Version(
        self, request: control_pb2.VersionRequest, context: Context
    ) -> control_pb2.VersionResponse:
        return control_pb2.VersionResponse(version=features.version(), features=features.SERVED)

    async def Top(
        self, request: control_pb2.TopRequest, context: Context
    ) -> control_pb2.TopResponse:
        samples = list(self._engines()) if self._engines is not None else []
        rows = []
        for lane in self._store.list(kinds.Kind.LANE):
            name = lane.metadata.name
            live = self._live(kinds.Kind.LANE, name) if self._live is not None else {}
            figures = live.get("admission", {})
            mine = [s for s in samples if s.lane == name]
            if isinstance(lane, kinds.Lane) and lane.spec.upstream is not None:
                # No engine reports: the upstream answering its probe is the Lane's
                # one replica, its parallel requests the slots, its memory not ours.
                slots, running = lane.spec.upstream.max_concurrency, figures.get("running", 0)
                rows.append(
                    control_pb2.LaneTop(
                        lane=name,
                        replicas_reporting=lane.status.ready_replicas,
                        slots_busy=min(running, slots),
                        slots_total=slots,
                        queued=sum(q["waiting"] for q in figures.get("queue", [])),
                        running=running,
                        tokens_per_second=figures.get("tokensPerSecond", 0.0),
                    )
                )
                continue
            rows.append(
                control_pb2.LaneTop(
                    lane=name,
                    replicas_reporting=len(mine),
                    slots_busy=sum(s.busy for s in mine),
                    slots_total=sum(s.busy + s.free for s in mine),
                    queued=sum(q["waiting"] for q in figures.get("queue", [])),
                    running=figures.get("running", 0),
                    tokens_per_second=figures.get("tokensPerSecond", 0.0),
                    memory_bytes=sum(s.memory_bytes for s in mine),
                )
            )
        return control_pb2.TopResponse(lanes=rows)
