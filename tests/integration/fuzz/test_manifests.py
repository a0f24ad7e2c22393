"""Fuzzing the apply path: hypothesis sends at least 2,000 manifests of every kind to
the real daemon's Control API over its Unix socket (counted where the daemon's Apply
reads them: not the examples hypothesis abandons while drawing, the YAML the CLI's
parse refuses, nor a request gRPC refuses for its size), and each is either stored or
refused with INVALID_ARGUMENT naming where it is wrong; none crashes the daemon or
changes what was stored before; the served Lane keeps its engine and answers.

Manifests start valid (`manifests`: Model, Lane, SLOPolicy and SpecPair with their
fields) and are mutated a few fields at a time (`mutation.mutated`): wrong types, huge
and negative numbers, NaN, deep nesting, huge strings, lone surrogates, unknown fields.
Each is sent one of two ways:

- as JSON, the way any Control client sends objects (`objects_json`), raw parts and
  all (`mutation.dump`), sometimes cut short;
- as YAML, the way `blazar apply -f` sends a file: the text is parsed as the CLI
  parses it (`manifests.parse_documents`, where broken YAML is refused, by document)
  and the documents go out as the CLI encodes them. YAML is written only for
  manifests up to `YAML_MAX_BYTES` (PyYAML in pure Python takes seconds on the large
  values, which the JSON way covers).

The Control API, not the CLI's process: a process per manifest would be most of the
run's time and reach no more of the daemon. Some manifests come with a second one (a
Lane with the Model it names, say), so batches, references inside a batch and "a batch
is refused whole" are fuzzed too. No accepted Lane starts an engine
(`manifests` says how), so the run costs the daemon only its validation and store.
"""

from __future__ import annotations

import collections
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from blazar._proto.v1 import control_pb2
from blazar.api import errors, manifests
from blazar.cli.client import ControlClient
from blazar.rpc import limits
from tests.integration.fuzz import manifests as fuzzed
from tests.integration.fuzz import serving
from tests.integration.fuzz.mutation import Raw, dump, mutated
from tests.integration.harness import Daemon

pytestmark = pytest.mark.slow

MANIFESTS = 2000
# Examples to draw first. An example holds 1.25 manifests on average, and about one
# in ten is abandoned while drawn or refused by the CLI's parse (a run of 1,600
# examples drew 2,168 manifests, of which 1,949 reached Apply); short runs then make up
# what is missing, so the count is met without drawing far past it.
EXAMPLES = MANIFESTS * 4 // 5
TOP_UPS = 3
YAML_MAX_BYTES = 32_000
# "Lane/x: spec.replicas: ..." or, before a kind and name are known (or for a
# document that did not parse), "object#2: ..." / "<stdin>#1: kind: ..." (a character
# YAML refuses, found before any document is read, by line: "<stdin>: invalid YAML at
# line 3, ...").
# A field's name is whatever the manifest wrote (an unknown one too).
LOCATED = re.compile(
    r"^(?:(?:Model|Lane|SLOPolicy|SpecPair)/[^\n]+?: [^\n]+?|object#\d+|<stdin>(?:#\d+)?): \S",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Example:
    documents: list[Any]
    how: str  # "json" or "yaml"
    description: str


@st.composite
def examples(draw: st.DrawFn, home: str) -> Example:
    count = draw(st.sampled_from([1, 1, 1, 2]))
    docs: list[Any] = []
    done: list[str] = []
    for _ in range(count):
        doc, mutations = draw(mutated(draw(fuzzed.documents(home))))
        fuzzed.hold(doc)
        docs.append(doc)
        done.append(f"{mutations}")
    how = draw(st.sampled_from(["json", "json", "yaml"]))
    return Example(docs, how, f"{how} mutations={done}")


def yaml_text(draw: st.DrawFn, docs: list[Any]) -> str | None:
    """The documents as one YAML stream, maybe broken; None when YAML cannot say them
    (see `fuzzed.raw_value`) or they are too large for the YAML way."""
    plain: list[Any] = []

    def resolve(node: Any) -> Any:
        if isinstance(node, Raw):
            ok, value = fuzzed.raw_value(node)
            if not ok:
                raise ValueError(node.text[:20])
            return value
        if isinstance(node, dict):
            return {resolve(k): resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    try:
        plain = [resolve(d) for d in docs]
        if len(dump(docs)) > YAML_MAX_BYTES:
            return None
        text: str = yaml.safe_dump_all(plain, sort_keys=False)
    except (ValueError, RecursionError):  # PyYAML's writer recurses once per level
        return None
    damage = draw(st.sampled_from(["none"] * 4 + ["append", "replace", "truncate"]))
    if damage == "append":
        text += draw(fuzzed.BROKEN_YAML) + "\n"
    elif damage == "replace":
        lines = text.splitlines()
        at = draw(st.integers(0, max(0, len(lines) - 1)))
        lines[at : at + 1] = [draw(fuzzed.BROKEN_YAML)]
        text = "\n".join(lines)
    elif damage == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    return text


def check_refusal(message: str, what: str) -> None:
    assert re.match(r"\d+ error\(s\) in manifest:", message), (what, message[:2000])
    assert LOCATED.search(message), (what, message[:2000])


@pytest.fixture(scope="module")
def control(daemon: Daemon) -> Iterator[ControlClient]:
    with ControlClient(daemon.control) as c:
        yield c


def _objects(control: ControlClient) -> dict[tuple[str, str], dict[str, Any]]:
    listed = control.list(control_pb2.ListRequest())
    found = [json.loads(o) for o in listed.objects_json]
    return {(o["kind"], o["metadata"]["name"]): o for o in found}


def _kept(obj: dict[str, Any]) -> tuple[Any, ...]:
    """What a run must not change in an object it was not given: its identity, its
    spec and generation (its status is the controller's)."""
    meta = obj["metadata"]
    return meta["uid"], meta.get("generation"), obj["spec"], meta.get("labels")


def test_no_manifest_crashes_the_daemon_or_changes_what_was_stored(
    daemon: Daemon, control: ControlClient, record_property: Callable[..., None]
) -> None:
    started = time.monotonic()
    control.apply(
        control_pb2.ApplyRequest(
            objects_json=[
                json.dumps(
                    {"apiVersion": fuzzed.API, "kind": "SLOPolicy",
                     "metadata": {"name": fuzzed.KEPT_POLICY}, "spec": {"priority": 1}}
                ),
                json.dumps(
                    {"apiVersion": fuzzed.API, "kind": "SpecPair",
                     "metadata": {"name": fuzzed.KEPT_PAIR},
                     "spec": {"target": serving.MODEL, "draft": {"kind": "ngram"}}}
                ),
            ]
        )
    )  # fmt: skip
    before = {key: _kept(obj) for key, obj in _objects(control).items()}
    assert ("Lane", serving.LANE) in before and ("SpecPair", fuzzed.KEPT_PAIR) in before
    (pid,) = daemon.pids(serving.LANE)
    home = str(daemon.home)
    sent: collections.Counter[str] = collections.Counter()
    stored: set[tuple[str, str]] = set()

    def run(count: int) -> None:
        @settings(
            max_examples=count,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(example=examples(home), data=st.data())
        def examples_sent(example: Example, data: st.DataObject) -> None:
            send(example, data)

        examples_sent()

    def reached() -> int:
        """Manifests Apply read: stored, or refused naming where (not those refused
        for their size, which gRPC refuses before Apply sees them)."""
        return sent["stored"] + sent["refused"]

    def send(example: Example, data: st.DataObject) -> None:
        n = len(example.documents)
        sent["drawn"] += n
        what = example.description
        if example.how == "yaml" and (text := yaml_text(data.draw, example.documents)):
            what += f"\nyaml: {text[:2000]!r}"
            try:
                docs = manifests.parse_documents(text, source="<stdin>")
            except errors.ManifestInvalid as err:
                check_refusal(err.message, what)
                sent["refused by the CLI's parse"] += n
                return
            # As `blazar apply` encodes them (cli.main.cmd_apply).
            objects = [json.dumps(doc) for _, doc in docs]
        else:
            objects = [dump(doc) for doc in example.documents]
            if data.draw(st.integers(0, 15)) == 0:
                objects[0] = objects[0][: data.draw(st.integers(0, len(objects[0])))]
            what += f"\njson: {[o[:1000] for o in objects]!r}"
        request = control_pb2.ApplyRequest(objects_json=objects, field_manager="fuzz")
        try:
            response = control.apply(request)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                what, exc.code(), (exc.details() or "")[:2000]
            )  # fmt: skip
            if request.ByteSize() > limits.MAX_REQUEST_BYTES:
                # Refused whole before any manifest is read, as any request that size.
                assert (exc.details() or "").startswith(
                    f"The request is larger than the server accepts: {request.ByteSize()} bytes"
                ), (what, exc.details())
                sent["refused for its size"] += n
                return
            check_refusal(exc.details() or "", what)
            sent["refused"] += n
            return
        for result in response.results:
            assert result.action in ("created", "configured", "unchanged"), (what, result)
            assert result.name not in fuzzed.PROTECTED, (what, result)
            stored_object = json.loads(result.object_json)
            got = json.loads(
                control.get(control_pb2.GetRequest(kind=result.kind, name=result.name)).object_json
            )
            assert _kept(got) == _kept(stored_object), what
            stored.add((result.kind, result.name))
        sent["stored"] += n

    run(EXAMPLES)
    for _ in range(TOP_UPS):
        if reached() >= MANIFESTS:
            break
        sent["top-up runs"] += 1
        run(MANIFESTS - reached())
    seconds = time.monotonic() - started
    record_property("seconds", round(seconds, 1))
    print(f"manifests: {dict(sent)} in {seconds:.0f} s")
    assert reached() >= MANIFESTS, dict(sent)
    assert sent["stored"] and sent["refused"] and sent["refused by the CLI's parse"]

    after = {key: _kept(obj) for key, obj in _objects(control).items()}
    for key, kept in before.items():
        assert after.get(key) == kept, key
    # Every stored object reads back (a corrupt row would fail the whole List above),
    # and none is there that the run was not told was stored (a mutated name that is
    # still valid, "a" say, is stored under it).
    assert set(after) - set(before) <= stored, set(after) - set(before) - stored
    assert daemon.pids(serving.LANE) == [pid]
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"model": serving.LANE, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 1},
        )  # fmt: skip
    assert answer.status_code == 200, answer.text
    logged = daemon.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in logged if line.startswith("{")]
    failures = [r for r in records if r.get("level") in ("error", "critical")]
    assert not failures, failures[:5]
