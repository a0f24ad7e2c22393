"""Pure renderers for the CLI: kubectl-style tables, describe pages, YAML and JSON.

They read objects as the daemon sends them (JSON, camelCase), not as `blazar.api`
models: a CLI older than its daemon still prints what it knows of newer kinds and
fields. Every field but the kind and the name may be missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NotRequired, Required, TypedDict

import yaml
from pydantic.alias_generators import to_camel


class MetadataJson(TypedDict, total=False):
    name: Required[str]
    labels: dict[str, str]
    annotations: dict[str, str]
    uid: str
    generation: int
    resourceVersion: int
    creationTimestamp: str


class ObjectJson(TypedDict, total=False):
    """One object from the Control API; `spec` and `status` vary by kind."""

    apiVersion: str
    kind: Required[str]
    metadata: Required[MetadataJson]
    spec: dict[str, Any]
    status: dict[str, Any]


class EventJson(TypedDict):
    """One event (`blazar events -o json` prints a list of them)."""

    time: str
    type: str
    reason: str
    kind: str
    name: str
    message: str
    # The uid of the object it is about; empty or absent when the recorder did not
    # know it (and from a daemon older than the field).
    uid: NotRequired[str]


# A condition, a replica status: entries of an object's status.
Entry = dict[str, Any]


def age(timestamp: str | None, now: datetime) -> str:
    """kubectl's compact age: 42s, 5m, 3h, 2d."""
    if not timestamp:
        return "<unknown>"
    seconds = max(0, int((now - _time(timestamp)).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def condition(obj: ObjectJson, type_: str) -> Entry | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == type_:
            return dict(cond)
    return None


def status_word(obj: ObjectJson) -> str:
    """One word for the STATUS column: Ready, or the reason it is not."""
    ready = (
        condition(obj, "Ready") or condition(obj, "ModelReady") or condition(obj, "ResolvedRefs")
    )
    degraded = condition(obj, "Degraded")
    if degraded and degraded.get("status") == "True":
        return str(degraded.get("reason", "Degraded"))
    if ready is None:
        return "Pending"
    if ready.get("status") == "True":
        # A sleeping Lane is Ready (its next request wakes it) with no process running.
        return "Sleeping" if ready.get("reason") == "Sleeping" else "Ready"
    return str(ready.get("reason", "NotReady"))


def _size(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(n)


Column = tuple[str, Callable[[ObjectJson], Any]]


def admission(obj: ObjectJson) -> dict[str, Any]:
    """The daemon's live admission figures in an object's status (empty from a daemon
    without them)."""
    return dict(obj.get("status", {}).get("admission", {}))


def _share(ratio: float | None) -> str:
    """SLO attainment as a percentage; <none> before any first token under a target."""
    return "<none>" if ratio is None else f"{ratio * 100:.1f}%"


def _millis(ms: int | None) -> str:
    if ms is None:
        return ""
    return f"{ms}ms" if ms < 1000 else f"{ms / 1000:.1f}s"


def memory(obj: ObjectJson) -> dict[str, Any]:
    """A Lane's fit ledger figures (empty before the ledger has looked at it)."""
    return dict(obj.get("status", {}).get("memory") or {})


def spec(obj: ObjectJson) -> dict[str, Any]:
    return dict(obj.get("spec", {}))


def st(obj: ObjectJson) -> dict[str, Any]:
    return dict(obj.get("status", {}))


def _upstream(obj: ObjectJson) -> dict[str, Any]:
    """An upstream Lane's spec.upstream; empty for a Lane of local engines."""
    return dict(spec(obj).get("upstream") or {})


def _columns(kind: str, wide: bool, now: datetime) -> list[Column]:
    name: Column = ("NAME", lambda o: o["metadata"]["name"])
    age_col: Column = ("AGE", lambda o: age(o["metadata"].get("creationTimestamp"), now))
    cols: list[Column]
    if kind == "Lane":
        cols = [
            name,
            ("READY", lambda o: f"{st(o).get('readyReplicas', 0)}/{spec(o).get('replicas', 1)}"),
            ("STATUS", status_word),
            ("MODEL", lambda o: spec(o).get("model", "")),
            (
                "RESTARTS",
                lambda o: sum(r.get("restarts", 0) for r in st(o).get("replicaStatuses", [])),
            ),
            age_col,
        ]
        if wide:
            cols += [
                ("ALIASES", lambda o: ",".join(spec(o).get("aliases", [])) or "<none>"),
                # The Lane its requests spill over to when admission would refuse them.
                ("SPILLOVER", lambda o: spec(o).get("spillover") or "<none>"),
                # An upstream Lane's slots are its upstream's parallel requests; its
                # context is the upstream's, unknown here.
                ("SLOTS", lambda o: _upstream(o).get("maxConcurrency") or spec(o).get("slots", "")),
                ("CONTEXT", lambda o: "" if _upstream(o) else spec(o).get("contextPerSlot", "")),
                (
                    "PIDS",
                    lambda o: ",".join(
                        str(r["pid"])
                        for r in st(o).get("replicaStatuses", [])
                        if r.get("pid") is not None
                    ),
                ),
                # The fit ledger's: what one replica needs, and what was free for more.
                ("MEMORY", lambda o: _size(memory(o).get("estimateBytes")) or "<none>"),
                ("FREE", lambda o: _size(memory(o).get("freeBytes")) or "<none>"),
            ]
    elif kind == "Model":
        cols = [
            name,
            ("STATUS", status_word),
            ("ARCH", lambda o: st(o).get("architecture", "")),
            ("SIZE", lambda o: _size(st(o).get("sizeBytes"))),
            age_col,
        ]
        if wide:
            cols += [("PATH", lambda o: st(o).get("path", ""))]
    elif kind == "SLOPolicy":
        cols = [
            name,
            ("PRIORITY", lambda o: spec(o).get("priority", 0)),
            (
                "TTFT-TARGET",
                lambda o: (
                    f"{spec(o)['ttftTargetMs']}ms" if spec(o).get("ttftTargetMs") else "<none>"
                ),
            ),
            ("MAX-QUEUE", lambda o: spec(o).get("maxQueueDepth", "")),
            # The most slots of a replica its requests hold at once (maxSlotsPerReplica).
            ("MAX-SLOTS", lambda o: spec(o).get("maxSlotsPerReplica") or "<none>"),
            # What a request predicted to miss its target gets; without a target every
            # request queues.
            (
                "ON-OVERLOAD",
                lambda o: (
                    spec(o).get("onOverload") or "reject"
                    if spec(o).get("ttftTargetMs")
                    else "queue"
                ),
            ),
            ("QUEUED", lambda o: admission(o).get("queued", 0)),
            ("ATTAINMENT", lambda o: _share(admission(o).get("attainment"))),
            age_col,
        ]
    elif kind == "SpecPair":
        cols = [
            name,
            ("TARGET", lambda o: spec(o).get("target", "")),
            ("DRAFT", lambda o: spec(o).get("draft", {}).get("kind", "")),
            ("STATUS", status_word),
            age_col,
        ]
    else:
        cols = [name, ("KIND", lambda o: o.get("kind", "")), age_col]
    return cols


def table(kind: str, objs: Sequence[ObjectJson], *, wide: bool = False, now: datetime) -> str:
    cols = _columns(kind, wide, now)
    rows = [[h for h, _ in cols]] + [[str(f(o)) for _, f in cols] for o in objs]
    return "\n".join(_grid(rows))


class WatchTable:
    """The lines of `get -w`, as kubectl's with `--output-watch-events`: a header with
    an EVENT column first, then a row per change (ADDED, MODIFIED, DELETED; the objects
    listed at the start are ADDED). Every row is aligned with the header and the rows
    before it: the columns are as wide as the widest value yet, and a column grows,
    for the rows after, only when a value is wider."""

    def __init__(self, kind: str, *, wide: bool = False) -> None:
        self.kind = kind
        self.wide = wide
        self.widths: list[int] | None = None

    def lines(self, changes: Sequence[tuple[str, ObjectJson]], *, now: datetime) -> list[str]:
        """The rows of `changes`, after the header when none was printed yet."""
        cols = _columns(self.kind, self.wide, now)
        rows = [[change] + [str(f(obj)) for _, f in cols] for change, obj in changes]
        if self.widths is None:
            header = ["EVENT"] + [h for h, _ in cols]
            # The event column holds MODIFIED at most: it never moves the others.
            self.widths = [len("MODIFIED")] + [len(h) for h in header[1:]]
            rows = [header, *rows]
        self.widths = [max([w] + [len(r[i]) for r in rows]) for i, w in enumerate(self.widths)]
        return [_line(r, self.widths) for r in rows]


def as_yaml(objs: Sequence[ObjectJson], *, named: bool = False) -> str:
    """As `as_json`, in YAML: what `apply -f` takes back (a List as well)."""
    return yaml.safe_dump(_listed(objs, named=named), sort_keys=False).rstrip()


def as_json(objs: Sequence[ObjectJson], *, named: bool = False) -> str:
    return json.dumps(_listed(objs, named=named), indent=2)


def _listed(objs: Sequence[ObjectJson], *, named: bool) -> ObjectJson | dict[str, Any]:
    """The object alone when one was asked for by name; a List otherwise, as kubectl
    prints one, also when the listing holds a single object (or none)."""
    if named and len(objs) == 1:
        return objs[0]
    return {"apiVersion": "v1", "kind": "List", "items": list(objs)}


def _replica_message(replica: dict[str, Any], now: datetime) -> str:
    """What its state says; else why its last run exited (a crash, restarted since).
    A failed replica waiting out its crash back-off says when it restarts; a Ready one
    that misses its health checks, how many in a row (it takes no requests meanwhile)."""
    missed = int(replica.get("missedProbes") or 0)
    if missed and replica.get("state") == "Ready":
        checks = "health check" if missed == 1 else "health checks"
        return f"missed {missed} {checks} in a row: no requests go to it until it answers"
    reason = str(replica.get("lastExitReason", ""))
    message = str(replica.get("message", "")) or (f"last exit: {reason}" if reason else "")
    due = replica.get("restartAt")
    if due and (wait := (_time(str(due)) - now).total_seconds()) > 0:
        back_off = f"back-off: restarts in {math.ceil(wait)}s"
        return f"{message} ({back_off})" if message else back_off
    return message


def _pid(replica: dict[str, Any]) -> str:
    """A replica's process id; `-` when it has none (stopped, or an upstream's)."""
    pid = replica.get("pid")
    return "-" if pid is None else str(pid)


def _time(timestamp: str) -> datetime:
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return then if then.tzinfo is not None else then.replace(tzinfo=UTC)


def _own_event(event: EventJson, *, uid: str | None, created_at: str | None) -> bool:
    if uid and (recorded_for := event.get("uid")):
        return recorded_for == uid
    return not created_at or _time(event["time"]) >= _time(created_at)


def describe(obj: ObjectJson, events: Sequence[EventJson], *, now: datetime) -> str:
    """`obj`'s page, with those of `events` (its kind's and name's) that are its own.

    Those of an earlier object of the same name (deleted, then created again) come
    too, and are left out as kubectl leaves them out, by uid: an event that carries one
    is shown when it is this object's. One without (its recorder did not know the
    object, or an older daemon stored it) is shown when it was recorded since this
    object's creation.
    """
    meta = obj["metadata"]
    uid, created_at = meta.get("uid"), meta.get("creationTimestamp")
    events = [e for e in events if _own_event(e, uid=uid, created_at=created_at)]
    labels = ", ".join(f"{k}={v}" for k, v in meta.get("labels", {}).items()) or "<none>"
    created = meta.get("creationTimestamp")
    observed = obj.get("status", {}).get("observedGeneration")
    lines = [
        f"Name:         {meta['name']}",
        f"Kind:         {obj['kind']}",
        f"Labels:       {labels}",
        f"Created:      {created or ''} ({age(created, now)} ago)",
        f"Generation:   {meta.get('generation')}   Observed: {observed}",
        "Spec:",
    ]
    spec_yaml = yaml.safe_dump(obj.get("spec", {}), sort_keys=False).rstrip()
    lines += ["  " + line for line in spec_yaml.splitlines()]
    status = {
        k: v
        for k, v in obj.get("status", {}).items()
        if k not in ("conditions", "replicaStatuses", "observedGeneration", "admission", "memory")
    }
    if status:
        lines.append("Status:")
        lines += [
            "  " + line for line in yaml.safe_dump(status, sort_keys=False).rstrip().splitlines()
        ]
    replicas = obj.get("status", {}).get("replicaStatuses", [])
    if replicas:
        lines.append("Replicas:")
        head = ["INDEX", "STATE", "PID", "RESTARTS", "LAST-EXIT", "MESSAGE"]
        rows = [head] + [
            [str(r.get("index")), str(r.get("state")), _pid(r), str(r.get("restarts", 0)),
             str(r.get("lastExitCode", "")), _replica_message(r, now)]
            for r in replicas
        ]  # fmt: skip
        lines += ["  " + _grid(rows)[i] for i in range(len(rows))]
    lines += _memory_lines(obj)
    lines += _admission_lines(obj)
    conds = obj.get("status", {}).get("conditions", [])
    lines.append("Conditions:")
    if conds:
        rows = [["TYPE", "STATUS", "REASON", "MESSAGE"]] + [
            [c["type"], c["status"], c.get("reason", ""), c.get("message", "")] for c in conds
        ]
        lines += ["  " + line for line in _grid(rows)]
    else:
        lines.append("  <none>")
    lines.append("Events:")
    if events:
        rows = [["AGE", "TYPE", "REASON", "MESSAGE"]] + [
            [age(e.get("time"), now), e["type"], e["reason"], e["message"]] for e in events
        ]
        lines += ["  " + line for line in _grid(rows)]
    else:
        lines.append("  <none>")
    return "\n".join(lines)


def _memory_lines(obj: ObjectJson) -> list[str]:
    """A Lane's fit ledger figures: one replica's estimate by part, and what was free."""
    m = memory(obj)
    if not m:
        return []
    parts = ", ".join(
        f"{label} {_size(m.get(key, 0))}"
        for label, key in (
            ("weights", "weightsBytes"),
            ("KV cache", "kvBytes"),
            ("compute", "computeBytes"),
            ("draft", "draftBytes"),
            ("runtime", "runtimeBytes"),
        )
    )
    lines = [
        "Memory:",
        f"  Per replica:  {_size(m.get('estimateBytes'))} ({parts})",
        f"  Free:         {_size(m.get('freeBytes'))} "
        f"(host available {_size(m.get('availableBytes'))}, less what replicas hold beyond it)",
    ]
    if m.get("budgetBytes") is not None:
        lines.append(f"  Budget:       {_size(m.get('budgetBytes'))} (serve --memory-budget)")
    return lines


def _admission_lines(obj: ObjectJson) -> list[str]:
    """A Lane's queue by policy, or an SLOPolicy's figures over every Lane."""
    live = admission(obj)
    if not live:
        return []
    if obj["kind"] == "Lane":
        queue = live.get("queue", [])
        waiting = sum(int(q.get("waiting", 0)) for q in queue)
        lines = [f"Queue:        {waiting} waiting, {live.get('running', 0)} running"]
        if live.get("parked"):
            lines[0] += f", {live['parked']} parked ({_size(live.get('parkedBytes'))})"
        if queue:
            rows = [["POLICY", "WAITING", "OLDEST-WAIT"]] + [
                [str(q.get("policy")), str(q.get("waiting", 0)), _millis(q.get("oldestWaitMs"))]
                for q in queue
            ]
            lines += ["  " + line for line in _grid(rows)]
        return lines
    refused = live.get("refused", {})
    return [
        "Admission:",
        f"  Queued:       {live.get('queued', 0)}",
        f"  First tokens: {live.get('firstTokens', 0)}",
        f"  Attainment:   {_share(live.get('attainment'))}",
        "  Refused:      "
        + (", ".join(f"{reason} {n}" for reason, n in refused.items()) or "<none>"),
    ]


@dataclass(frozen=True)
class LaneLoad:
    """One row of `blazar top` (Control's `LaneTop`)."""

    lane: str
    replicas_reporting: int
    slots_busy: int
    slots_total: int
    queued: int
    running: int
    tokens_per_second: float
    memory_bytes: int


def top_json(rows: Sequence[LaneLoad]) -> str:
    """`blazar top -o json`: the rows with camelCase keys, as every other JSON output
    (`get`, `events`) writes them."""
    return json.dumps(
        [{to_camel(k): v for k, v in dataclasses.asdict(r).items()} for r in rows], indent=2
    )


def top_table(rows: Sequence[LaneLoad]) -> str:
    """`blazar top`: each Lane's slots, queue, throughput and engines' memory. A Lane
    whose engines have not reported (none ready yet) shows `-` for what they report; an
    upstream Lane its upstream as its one replica and `maxConcurrency` as its slots."""
    if not rows:
        return "No Lane resources found."
    lines = [["LANE", "REPLICAS", "SLOTS", "QUEUE", "RUNNING", "TOKENS/S", "MEMORY"]]
    for r in rows:
        reported = r.replicas_reporting > 0
        lines.append(
            [
                r.lane,
                str(r.replicas_reporting),
                f"{r.slots_busy}/{r.slots_total}" if reported else "-",
                str(r.queued),
                str(r.running),
                f"{r.tokens_per_second:.1f}",
                # An upstream Lane's memory is its server's: none reported here.
                _size(r.memory_bytes) if reported and r.memory_bytes else "-",
            ]
        )
    return "\n".join(_grid(lines))


def events_table(events: Sequence[EventJson], *, now: datetime) -> str:
    if not events:
        return "No events."
    rows = [["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]] + [
        [age(e.get("time"), now), e["type"], e["reason"], f"{e['kind']}/{e['name']}", e["message"]]
        for e in events
    ]
    return "\n".join(_grid(rows))


def _grid(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [_line(r, widths) for r in rows]


def _line(row: Sequence[str], widths: Sequence[int]) -> str:
    return "   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
