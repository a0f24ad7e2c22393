"""The engine's launch document: what the supervisor writes is what the worker reads."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pydantic
import pytest

from blazar.api.kinds import DEFAULT_MAX_PARKED_MIB, LaneSpec
from blazar.api.replicas import EngineLaunch, LaunchSpec
from blazar.engine import __main__ as engine_main
from tests import launches

SPEC = launches.spec(
    "/models/m.gguf",
    slots=4,
    context_per_slot=4096,
    chat_template="{{ messages[0].content }} \u00e9\u4e2d\U0001f600",
    type_k="q8_0",
    kv_persist=True,
    speculation=launches.ngram(ngram_size=4, min_acceptance_rate=0.25),
)
LAUNCH = EngineLaunch(
    spec=SPEC,
    socket="/run/blazar/l-0.sock",
    drain_grace_seconds=10.0,
    kv_dir="/home/u/.local/share/blazar/kv/l/0",
    parent_pid=4242,
    log_json=True,
)


def test_round_trip() -> None:
    assert EngineLaunch.from_json(LAUNCH.to_json()) == LAUNCH
    plain = EngineLaunch(spec=launches.spec(), socket="/s", drain_grace_seconds=1.0)
    assert EngineLaunch.from_json(plain.to_json()) == plain


def test_the_worker_reads_the_file(tmp_path: Any) -> None:
    path = tmp_path / "launch.json"
    path.write_bytes(LAUNCH.to_json())
    assert engine_main.parse_args(["--launch", str(path)]) == LAUNCH


def edited(edit: Any) -> bytes:
    document = json.loads(LAUNCH.to_json())
    edit(document)
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("edit", "location"),
    [
        # A setting this version does not know is refused, never ignored.
        (lambda d: d["spec"].update(flash_attention=True), "spec.flash_attention"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["spec"]["speculation"].update(draft="x"), "spec.speculation.draft"),
        # No second set of defaults: every spec setting is written by the supervisor.
        (lambda d: d["spec"].pop("threads"), "spec.threads"),
        (lambda d: d["spec"].pop("type_v"), "spec.type_v"),
        (lambda d: d["spec"].pop("max_parked_mib"), "spec.max_parked_mib"),
        # Strict types: no "4" for 4, no 1 for true.
        (lambda d: d["spec"].update(slots="4"), "spec.slots"),
        (lambda d: d["spec"].update(kv_persist=1), "spec.kv_persist"),
        (lambda d: d["spec"]["speculation"].update(kind="magic"), "spec.speculation.kind"),
    ],
)
def test_an_invalid_document_is_refused_naming_the_field(edit: Any, location: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        EngineLaunch.from_json(edited(edit))
    assert location in {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}


def test_the_worker_refuses_an_invalid_document_in_one_line(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "launch.json"
    path.write_bytes(edited(lambda d: d["spec"].pop("slots")))
    with pytest.raises(SystemExit) as info:
        engine_main.parse_args(["--launch", str(path)])
    assert info.value.code == 2
    assert "not a valid launch document" in capsys.readouterr().err


def test_revision_follows_every_spec_setting() -> None:
    """Replicas are replaced when any setting changes, and only then."""
    assert SPEC.revision == replace(SPEC).revision
    changes: list[LaunchSpec] = [
        replace(SPEC, slots=5),
        replace(SPEC, threads=1),
        replace(SPEC, type_v="q8_0"),
        replace(SPEC, kv_persist=False),
        replace(SPEC, max_parked_mib=0),
        replace(SPEC, chat_template=None),
        replace(SPEC, speculation=None),
        replace(SPEC, speculation=launches.ngram(ngram_size=3, min_acceptance_rate=0.25)),
    ]
    revisions = {SPEC.revision, *(c.revision for c in changes)}
    assert len(revisions) == len(changes) + 1


def test_the_parking_bound_comes_from_the_lane() -> None:
    """kvCache.maxParkedMiB as written, or the API's default; nothing else sets it."""
    written = LaneSpec.model_validate({"model": "m", "kvCache": {"maxParkedMiB": 0}})
    default = LaneSpec(model="m")
    of = [LaunchSpec.of_lane(s, model_path="m", default_threads=2) for s in (written, default)]
    assert [s.max_parked_mib for s in of] == [0, DEFAULT_MAX_PARKED_MIB]
