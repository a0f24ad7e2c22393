"""The CLI's renderers (`blazar.cli.printers`): pure, on objects as the daemon sends them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from blazar.api import manifests
from blazar.api.kinds import Kind
from blazar.cli import printers
from blazar.store.memory import MemoryStore
from tests.unit.helpers import T0, Clock

CREATED = "2026-01-01T00:00:00Z"


def model(name: str = "m", **status: object) -> printers.ObjectJson:
    return {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name, "creationTimestamp": CREATED},
        "spec": {"source": {"path": "/m.gguf"}},
        "status": dict(status),
    }


@pytest.mark.parametrize(
    ("timestamp", "later", "shown"),
    [
        (None, 0, "<unknown>"),
        (CREATED, 0, "0s"),
        (CREATED, 59, "59s"),
        (CREATED, 60, "1m"),
        (CREATED, 3 * 3600 + 5, "3h"),
        (CREATED, 2 * 86400, "2d"),
        ("2026-01-01T00:00:00", 42, "42s"),  # no zone: UTC
        (CREATED, -5, "0s"),  # a clock behind the daemon's
    ],
)
def test_age(timestamp: str | None, later: float, shown: str) -> None:
    assert printers.age(timestamp, T0 + timedelta(seconds=later)) == shown


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (None, ""),
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (253 * 2**20 + 2**19, "253.5MiB"),
        (3 * 2**30, "3.0GiB"),
        (2048 * 2**30, "2048.0GiB"),  # GiB is the largest unit
    ],
)
def test_model_size_column(size: int | None, shown: str) -> None:
    obj = model() if size is None else model(sizeBytes=size)
    header, row = printers.table("Model", [obj], now=T0).splitlines()
    assert header.split() == ["NAME", "STATUS", "ARCH", "SIZE", "AGE"]
    # ARCH is empty, as is SIZE when the status has no size yet.
    assert row.split() == ["m", "Pending", *([shown] if shown else []), "0s"]


@pytest.mark.parametrize(
    ("conditions", "word"),
    [
        ([], "Pending"),
        ([{"type": "ModelReady", "status": "True", "reason": "Resolved"}], "Ready"),
        ([{"type": "ModelReady", "status": "False", "reason": "FileMissing"}], "FileMissing"),
        ([{"type": "ModelReady", "status": "False"}], "NotReady"),
        (
            [
                {"type": "Ready", "status": "True", "reason": "Serving"},
                {"type": "Degraded", "status": "True", "reason": "CrashLoopBackOff"},
            ],
            "CrashLoopBackOff",
        ),
        # Asleep (idle.sleepAfter, keep_alive 0, the memory budget): Ready, as it serves
        # its next request, but no process runs; `get` says which.
        (
            [
                {"type": "Available", "status": "False", "reason": "Sleeping"},
                {"type": "Ready", "status": "True", "reason": "Sleeping"},
            ],
            "Sleeping",
        ),
    ],
)
def test_status_word(conditions: list[dict[str, str]], word: str) -> None:
    assert printers.status_word(model(conditions=conditions)) == word


def test_as_json_is_the_object_alone_or_a_list() -> None:
    assert json.loads(printers.as_json([model()], named=True))["kind"] == "Model"
    listed = json.loads(printers.as_json([model("a"), model("b")]))
    assert listed["kind"] == "List"
    assert [o["metadata"]["name"] for o in listed["items"]] == ["a", "b"]


def test_a_listing_of_one_object_is_still_a_list() -> None:
    """`get models -o json` is a List however many it holds (kubectl's), so a script
    reads `.items` whether one Model or several exist; `get model m` is the object."""
    for objs in ([], [model("a")]):
        listed = json.loads(printers.as_json(objs))
        assert listed["kind"] == "List"
        assert [o["metadata"]["name"] for o in listed["items"]] == [
            o["metadata"]["name"] for o in objs
        ]


def test_a_json_listing_applies_back() -> None:
    """`get -o json > f.json; apply -f f.json` round-trips, as with kubectl: the List
    says its apiVersion and `apply` reads its items."""
    listed = printers.as_json([model("a"), model("b")])
    assert json.loads(listed)["apiVersion"] == "v1"
    docs = manifests.parse_documents(listed, source="f.json")
    assert [doc["metadata"]["name"] for _, doc in docs] == ["a", "b"]


def test_events_table() -> None:
    event: printers.EventJson = {
        "time": "2026-01-01T00:00:00+00:00",
        "type": "Warning",
        "reason": "ManifestRejected",
        "kind": "Manifest",
        "name": "apply",
        "message": "Lane/l: spec.model: not found",
    }
    assert printers.events_table([], now=T0) == "No events."
    header, row = printers.events_table([event], now=T0 + timedelta(minutes=5)).splitlines()
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert row.split()[:4] == ["5m", "Warning", "ManifestRejected", "Manifest/apply"]


def test_describe_shows_status_conditions_and_events() -> None:
    obj = model(
        observedGeneration=1,
        sizeBytes=10,
        conditions=[{"type": "ModelReady", "status": "True", "reason": "Resolved"}],
    )
    obj["metadata"]["generation"] = 1
    page = printers.describe(obj, [], now=T0 + timedelta(seconds=3)).splitlines()
    assert page[:5] == [
        "Name:         m",
        "Kind:         Model",
        "Labels:       <none>",
        f"Created:      {CREATED} (3s ago)",
        "Generation:   1   Observed: 1",
    ]
    assert "Status:" in page and "  sizeBytes: 10" in page
    assert page[page.index("Conditions:") + 2].split() == ["ModelReady", "True", "Resolved"]
    assert page[-2:] == ["Events:", "  <none>"]


def slo(name: str, *, cap: int | None = None, **admission: object) -> printers.ObjectJson:
    status: dict[str, object] = {"admission": dict(admission)} if admission else {}
    spec: dict[str, object] = {"priority": 100, "ttftTargetMs": 2000, "maxQueueDepth": 32}
    if cap is not None:
        spec["maxSlotsPerReplica"] = cap
    return {
        "kind": "SLOPolicy",
        "metadata": {"name": name, "creationTimestamp": CREATED},
        "spec": spec,
        "status": status,
    }


def test_get_slopolicies_shows_the_live_queue_and_attainment() -> None:
    objs = [
        slo("interactive", queued=3, firstTokens=40, attainment=0.975),
        slo("fresh", queued=0, firstTokens=0),
        slo("old-daemon"),
    ]
    lines = printers.table("SLOPolicy", objs, now=T0).splitlines()
    header = lines[0].split()
    assert header[-3:] == ["QUEUED", "ATTAINMENT", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["interactive"][-3:-1] == ["3", "97.5%"]
    assert rows["fresh"][-3:-1] == ["0", "<none>"]
    assert rows["old-daemon"][-3:-1] == ["0", "<none>"]


def test_get_slopolicies_shows_each_policys_slot_cap() -> None:
    lines = printers.table("SLOPolicy", [slo("batch", cap=4), slo("interactive")], now=T0)
    header, *rows = (line.split() for line in lines.splitlines())
    at = header.index("MAX-SLOTS")
    assert header[at - 1] == "MAX-QUEUE"
    assert {row[0]: row[at] for row in rows} == {"batch": "4", "interactive": "<none>"}
    page = printers.describe(slo("batch", cap=4), [], now=T0).splitlines()
    assert "  maxSlotsPerReplica: 4" in page[page.index("Spec:") :]


def test_describe_lane_shows_its_queue_by_policy() -> None:
    lane: printers.ObjectJson = {
        "kind": "Lane",
        "metadata": {"name": "l", "creationTimestamp": CREATED},
        "spec": {"model": "m"},
        "status": {
            "admission": {
                "running": 4,
                "queue": [
                    {"policy": "batch", "waiting": 9, "oldestWaitMs": 12500},
                    {"policy": "interactive", "waiting": 2, "oldestWaitMs": 340},
                ],
            }
        },
    }
    page = printers.describe(lane, [], now=T0).splitlines()
    at = page.index("Queue:        11 waiting, 4 running")
    assert [line.split() for line in page[at + 1 : at + 4]] == [
        ["POLICY", "WAITING", "OLDEST-WAIT"],
        ["batch", "9", "12.5s"],
        ["interactive", "2", "340ms"],
    ]
    assert "Status:" not in page  # the live figures are not repeated as raw status
    # Generations parked for more urgent ones are told with the memory they hold.
    lane["status"]["admission"].update(parked=2, parkedBytes=3 * 1024 * 1024)
    page = printers.describe(lane, [], now=T0).splitlines()
    assert "Queue:        11 waiting, 4 running, 2 parked (3.0MiB)" in page


def test_describe_slopolicy_shows_its_figures() -> None:
    obj = slo("interactive", queued=1, firstTokens=8, attainment=0.5, refused={"QUEUE_FULL": 2})
    page = printers.describe(obj, [], now=T0).splitlines()
    at = page.index("Admission:")
    assert page[at + 1 : at + 5] == [
        "  Queued:       1",
        "  First tokens: 8",
        "  Attainment:   50.0%",
        "  Refused:      QUEUE_FULL 2",
    ]


MEMORY = {
    "estimateBytes": 508 * 2**20 + 2**19,
    "weightsBytes": 246_587_904,
    "kvBytes": 18 * 2**20,
    "computeBytes": 135 * 2**20,
    "draftBytes": 0,
    "runtimeBytes": 140 * 2**20,
    "freeBytes": -20 * 2**20,
    "availableBytes": 3 * 2**30,
}


def lane_with(**status: object) -> printers.ObjectJson:
    return {
        "kind": "Lane",
        "metadata": {"name": "l", "creationTimestamp": CREATED},
        "spec": {"model": "m", "slots": 2, "contextPerSlot": 1024},
        "status": dict(status),
    }


def test_get_lanes_wide_shows_the_estimate_and_what_was_free() -> None:
    objs = [lane_with(memory=MEMORY), lane_with()]
    lines = printers.table("Lane", objs, wide=True, now=T0).splitlines()
    assert lines[0].split()[-2:] == ["MEMORY", "FREE"]
    assert lines[1].split()[-2:] == ["508.5MiB", "-20.0MiB"]
    assert lines[2].split()[-2:] == ["<none>", "<none>"]  # not looked at yet
    assert "MEMORY" not in printers.table("Lane", objs, now=T0)


def test_get_lanes_wide_shows_the_spillover_lane() -> None:
    spilling = lane_with()
    spilling["spec"] = {**spilling["spec"], "spillover": "big"}
    [header, spills, stays] = printers.table(
        "Lane", [spilling, lane_with()], wide=True, now=T0
    ).splitlines()
    at = header.index("SPILLOVER")
    assert spills[at:].split()[0] == "big"
    assert stays[at:].split()[0] == "<none>"
    assert "SPILLOVER" not in printers.table("Lane", [spilling], now=T0)


def test_describe_lane_shows_the_estimate_by_part() -> None:
    page = printers.describe(lane_with(memory=MEMORY), [], now=T0).splitlines()
    at = page.index("Memory:")
    assert page[at + 1 : at + 3] == [
        "  Per replica:  508.5MiB (weights 235.2MiB, KV cache 18.0MiB, compute 135.0MiB, "
        "draft 0B, runtime 140.0MiB)",
        "  Free:         -20.0MiB (host available 3.0GiB, less what replicas hold beyond it)",
    ]
    assert "Status:" not in page  # not repeated as raw bytes
    assert "Memory:" not in printers.describe(lane_with(), [], now=T0)


def test_describe_lane_shows_the_memory_budget_and_preload() -> None:
    lane = lane_with(memory={**MEMORY, "budgetBytes": 3 * 2**30})
    lane["spec"] = {**lane["spec"], "preload": True}
    page = printers.describe(lane, [], now=T0).splitlines()
    assert "  Budget:       3.0GiB (serve --memory-budget)" in page
    assert "  preload: true" in page
    assert not any(
        "Budget:" in line
        for line in printers.describe(lane_with(memory=MEMORY), [], now=T0).splitlines()
    )


def test_get_lanes_wide_shows_an_upstreams_concurrency_as_slots() -> None:
    upstream = {
        "kind": "Lane",
        "metadata": {"name": "u", "creationTimestamp": CREATED},
        "spec": {
            "model": "g",
            "engine": "upstream",
            "slots": 4,
            "contextPerSlot": 2048,
            "upstream": {"url": "http://u/v1", "model": "g", "maxConcurrency": 16},
        },
        "status": {
            "readyReplicas": 1,
            "replicaStatuses": [{"index": 0, "state": "Ready", "socket": "http://u/v1"}],
        },
    }
    [header, local, remote] = printers.table(
        "Lane", [lane_with(), upstream], wide=True, now=T0
    ).splitlines()
    at = header.index("SLOTS")
    assert local[at:].split()[:2] == ["2", "1024"]
    assert remote[at:].split()[0] == "16"
    assert "2048" not in remote  # the upstream's context is not known here
    # It runs no process: no pid is printed, not "None".
    assert "None" not in remote
    page = printers.describe(upstream, [], now=T0).splitlines()
    row = page[page.index("Replicas:") + 2]
    assert row.split()[:3] == ["0", "Ready", "-"]


def test_describe_shows_only_the_events_of_the_object_not_of_one_deleted_before() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    lane = manifests.parse_objects(
        [("l#1", {"apiVersion": "blazar.dev/v1alpha1", "kind": "Lane",
                  "metadata": {"name": "l"}, "spec": {"model": "m"}})]
    )  # fmt: skip
    store.apply_all(lane)
    clock.tick(0.5)
    store.record_event(kind="Lane", name="l", type="Warning", reason="Old", message="first")
    clock.tick(0.5)
    store.delete(Kind.LANE, "l")
    store.record_event(kind="Lane", name="l", type="Normal", reason="Gone", message="after")
    clock.tick(0.5)
    store.apply_all(lane)
    clock.tick(0.5)
    store.record_event(kind="Lane", name="l", type="Normal", reason="New", message="second")
    current = store.get(Kind.LANE, "l")
    assert current is not None
    # As the Control service sends them, and the CLI reads them.
    obj: printers.ObjectJson = json.loads(json.dumps(manifests.to_dict(current)))
    events: list[printers.EventJson] = [
        {"time": e.time.isoformat(), "type": e.type, "reason": e.reason, "kind": e.kind,
         "name": e.name, "message": e.message}
        for e in store.events(kind="Lane", name="l")
    ]  # fmt: skip
    page = printers.describe(obj, events, now=clock.now).splitlines()
    assert [line.split()[2] for line in page[page.index("Events:") + 2 :]] == ["New"]
    # An object without a creation time (an old daemon's) still shows every event.
    del obj["metadata"]["creationTimestamp"]
    page = printers.describe(obj, events, now=clock.now).splitlines()
    assert len(page[page.index("Events:") + 2 :]) == 3


def test_get_watch_rows_line_up_with_the_header() -> None:
    """`get -w`: an EVENT column in the header (kubectl's --output-watch-events), and
    each change's row starts its columns where the header's start, also when a value
    is wider than the header's: the columns after it move for good, not for one row."""
    listed = lane_with()
    longer = lane_with(
        conditions=[{"type": "Ready", "status": "False", "reason": "ReplicasNotReady"}]
    )
    longer["metadata"] = {**longer["metadata"], "name": "a-lane-with-a-long-name"}
    rows = printers.WatchTable("Lane")
    first = rows.lines([("ADDED", listed)], now=T0)
    later = rows.lines([("MODIFIED", longer)], now=T0) + rows.lines([("DELETED", listed)], now=T0)
    [header, added] = first
    assert header.split()[:3] == ["EVENT", "NAME", "READY"]
    assert added.split()[:2] == ["ADDED", "l"]
    for line in (added, later[0]):
        assert line.index(line.split()[1]) == header.index("NAME")
    # The long name moved READY right: the rows after it keep the new place.
    at = later[0].index("0/")
    assert later[1].index("0/") == at
    assert later[1].split()[:2] == ["DELETED", "l"]


def test_describe_shows_why_a_restarted_replica_last_exited() -> None:
    """Its own message first; without one, the last run's exit reason."""
    lane = {
        "kind": "Lane",
        "metadata": {"name": "l"},
        "status": {
            "replicaStatuses": [
                {"index": 0, "state": "Starting", "restarts": 1, "lastExitCode": -11,
                 "lastExitReason": "killed by SIGSEGV"},
                {"index": 1, "state": "Failed", "restarts": 2, "lastExitCode": 1,
                 "lastExitReason": "old", "message": "ValueError: bad",
                 "restartAt": (T0 + timedelta(seconds=3.5)).isoformat()},
                {"index": 2, "state": "Failed", "restarts": 1, "message": "exit 1",
                 "restartAt": (T0 - timedelta(seconds=1)).isoformat()},
            ]
        },
    }  # fmt: skip
    shown = printers.describe(lane, [], now=T0)
    assert "last exit: killed by SIGSEGV" in shown
    assert "ValueError: bad (back-off: restarts in 4s)" in shown
    assert "last exit: old" not in shown
    assert "exit 1 (" not in shown  # its restart is due: no back-off left to show


def test_describe_shows_a_ready_replica_that_misses_its_health_checks() -> None:
    lane = {
        "kind": "Lane",
        "metadata": {"name": "l"},
        "status": {
            "replicaStatuses": [
                {"index": 0, "state": "Ready", "missedProbes": 2},
                {"index": 1, "state": "Ready", "missedProbes": 0},
            ]
        },
    }  # fmt: skip
    shown = printers.describe(lane, [], now=T0)
    assert "missed 2 health checks in a row: no requests go to it until it answers" in shown
    assert shown.count("missed") == 1


def test_get_slopolicies_shows_what_an_overloaded_request_gets() -> None:
    """reject unless said otherwise when there is a target; without one, a wait."""
    policies = [slo("default"), slo("patient"), slo("untargeted")]
    policies[1]["spec"]["onOverload"] = "queue"
    del policies[2]["spec"]["ttftTargetMs"]
    lines = printers.table("SLOPolicy", policies, now=T0)
    header, *rows = (line.split() for line in lines.splitlines())
    at = header.index("ON-OVERLOAD")
    assert {row[0]: row[at] for row in rows} == {
        "default": "reject",
        "patient": "queue",
        "untargeted": "queue",
    }
