"""A fleet's manifests as Kubernetes objects (`blazar export kubernetes`).

Pure: validated resources and what the caller read of each Model's GGUF in, objects
and the list of what does not translate out; no IO, no clock, no logging.

What each resource becomes:

- The fleet: a **ConfigMap** `<fleet>-manifests` holding every object as its
  manifest (one key per object, `lane-chat.yaml`), so that a Blazar in the cluster
  (`blazar serve --watch` on the mounted ConfigMap) or a later export reads the same
  fleet; and a **PersistentVolumeClaim** `<fleet>-models` that the pods mount read-only
  at `/models`, where each Model's GGUF is expected as `<model name>.gguf`. Blazar
  cannot put the files there: the user fills the volume (the output's header lists
  each file with its source and checksum).
- A Lane (engine `llama-cpp`): a **Deployment** and a **Service** named after it,
  running llama.cpp's own server (`llama-server`, the image
  `ghcr.io/ggml-org/llama.cpp:server` unless overridden) with the Lane's settings as
  its flags: `--parallel` = slots, `--ctx-size` = slots x contextPerSlot (llama-server
  splits the context between its slots, as Blazar's engine does), `--cache-type-k/-v`,
  `--threads` (and as many CPUs requested), `--n-gpu-layers`, `--flash-attn`,
  `--alias` (the Lane's name and aliases), the
  Model's chat template by name or as Jinja source (`gemma` and `llama3` with
  `--no-jinja`: llama-server's Jinja mode would take the name for the template; and
  when the Model names none and its GGUF ships none, the format Blazar's engine falls
  back to by architecture, as llama-server's own fallback is ChatML), and the
  SpecPair's drafting:
  `--spec-type draft-simple` with `--spec-draft-model` and `--spec-draft-n-max` for a
  draft Model, `--spec-type ngram-simple` with `--spec-ngram-simple-size-n` (ngramSize) and
  `--spec-ngram-simple-size-m`/`--spec-draft-n-max` (maxDraftTokens) for prompt
  lookup. These are the names of llama.cpp's 2026 builds, which the `:server` tag
  runs (older builds spelled them `--model-draft`, `--draft-max`,
  `--spec-ngram-size-n/-m`); a pinned older `--image` may need them. Blazar sets no
  minimum draft, which is llama-server's default (`--spec-draft-n-min` 0). Probes read
  llama-server's `/health`
  (503 while the model loads); updates surge one pod and take none away first, as
  Blazar's rolling update starts the new replica before it drains the old one. The
  memory request is Blazar's own fit estimate of one replica (`controller.fit`) when
  the caller could read the Model's GGUF header; otherwise it is left out and said so.
  `--cache-ram 0` turns off llama-server's host-memory prompt cache (8 GiB by
  default), which that estimate does not count and Blazar's engine does not keep.
- Routing and SLOs: an **InferencePool** (`inference.networking.k8s.io/v1`, the Gateway
  API Inference Extension) per Lane, selecting its pods, with an endpoint picker
  reference `<lane>-epp` the user deploys; and per Lane and SLOPolicy an
  **InferenceObjective** (`llm-d.ai/v1alpha2`, where the API moved from the extension
  in 2026) `<lane>-<policy>` carrying the policy's `priority`, the one SLO field with an
  equivalent. A request picks it with the header `x-llm-d-inference-objective`, as it
  picks a policy with `x-blazar-slo` here.

Everything else (time-to-first-token and per-token targets, queue bounds, early
reject, preemption, scale to zero, slot persistence, aliases, ...) is listed in
`Export.untranslated`, located as `Kind/name: field` like a manifest error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from blazar.api import errors, meta
from blazar.api.kinds import (
    CHAT_TEMPLATE_NAMES,
    Lane,
    Model,
    ModelDraft,
    NgramDraft,
    Resource,
    SLOPolicy,
    SpecPair,
    fallback_template,
)
from blazar.api.replicas import LaunchSpec, SpeculationLaunch
from blazar.controller import fit

IMAGE = "ghcr.io/ggml-org/llama.cpp:server"
# llama-server's own default port; the Service and the pool target it.
PORT = 8080
PORT_NAME = "http"
MODELS_DIR = "/models"
MODELS_VOLUME = "models"
DEFAULT_FLEET = "blazar"
# The endpoint picker's ext-proc gRPC port (the extension's reference EPP listens here).
EPP_PORT = 9002
POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
OBJECTIVE_API_VERSION = "llm-d.ai/v1alpha2"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
MANAGED_BY = "blazar"
# InferenceObjective.spec.priority is an int32.
_INT32 = range(-(2**31), 2**31)
GIB = 1024**3

_LABEL_NAME = "app.kubernetes.io/name"
_LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
_LABEL_PART_OF = "app.kubernetes.io/part-of"

Object = dict[str, Any]


@dataclass(frozen=True)
class ModelFile:
    """What the caller could read of a Model's GGUF on this host: its figures for the
    memory estimate and its size, or why not (`missing`, a sentence)."""

    shape: fit.ModelShape | None = None
    size_bytes: int | None = None
    missing: str | None = None
    # From its header: `general.architecture`, and whether it ships a chat template
    # (None: not read).
    architecture: str | None = None
    has_chat_template: bool | None = None


@dataclass(frozen=True)
class Export:
    """The objects in the order they are written, what the user must provide, and
    what does not translate (`Kind/name: field: why`)."""

    objects: list[Object]
    provide: list[str] = field(default_factory=list)
    untranslated: list[str] = field(default_factory=list)


class ExportError(errors.InvalidRequest):
    """The fleet cannot be written as Kubernetes objects (a name Kubernetes refuses)."""


def export(
    resources: Sequence[Resource],
    *,
    files: Mapping[str, ModelFile],
    fleet: str = DEFAULT_FLEET,
    image: str = IMAGE,
) -> Export:
    """The Kubernetes objects of a validated fleet (module docstring); `files` by
    Model name, a Model absent from it counting as unread."""
    if not meta.is_name(fleet) or len(fleet) > 63 - len("-manifests"):
        raise ExportError(
            f'--fleet "{fleet}" cannot prefix Kubernetes names: use at most 53 lowercase '
            "letters, digits and '-', starting and ending with a letter or digit"
        )
    if not image or any(c.isspace() or not c.isprintable() for c in image):
        # Kubernetes refuses a container without an image (or with a blank in it) only
        # at `kubectl apply`, after the file was written.
        raise ExportError(f"--image {image!r} is not an image reference: give one such as {IMAGE}")
    models = {r.metadata.name: r for r in resources if isinstance(r, Model)}
    pairs = {r.metadata.name: r for r in resources if isinstance(r, SpecPair)}
    policies = sorted(
        (r for r in resources if isinstance(r, SLOPolicy)), key=lambda p: p.metadata.name
    )
    lanes = sorted(
        (r for r in resources if isinstance(r, Lane) and r.spec.engine == "llama-cpp"),
        key=lambda lane: lane.metadata.name,
    )
    _check_service_names(lanes)
    _check_derived_names(lanes, policies)

    untranslated: list[str] = []
    served = _served_models(lanes, pairs)
    objects: list[Object] = [
        _config_map(resources, fleet=fleet),
        _claim(served, models, files, fleet=fleet, untranslated=untranslated),
    ]
    for lane in lanes:
        model = models[lane.spec.model]
        pair = pairs.get(lane.spec.speculation) if lane.spec.speculation else None
        objects.append(
            _deployment(
                lane, model, pair, files, fleet=fleet, image=image, untranslated=untranslated
            )
        )
        objects.append(_service(lane, fleet=fleet))
        objects.append(_pool(lane, fleet=fleet))
        for policy in policies:
            objects.append(_objective(lane, policy, fleet=fleet, untranslated=untranslated))
        untranslated += _lane_gaps(lane)
    used_pairs = sorted({lane.spec.speculation for lane in lanes if lane.spec.speculation})
    for name in used_pairs:
        untranslated += _pair_gaps(pairs[name])
    for policy in policies:
        untranslated += _policy_gaps(policy)
    untranslated += [
        _upstream_gap(r) for r in resources if isinstance(r, Lane) and r.spec.engine == "upstream"
    ]
    return Export(
        objects=objects,
        provide=_provide(served, models, lanes, fleet=fleet),
        untranslated=sorted(set(untranslated)) + list(FLEET_GAPS),
    )


# What no object of the fleet says but Blazar does, and the cluster will not.
FLEET_GAPS = (
    "Blazar admission: the queue per Lane and policy, earliest deadline first within a "
    "priority, routing by cached prefix between replicas and preemption (slot banking) are "
    "the endpoint picker's to do in the cluster, by its own rules",
    "Tenants and API keys (the auth file) are not manifests: authentication is the gateway's",
    "Dialects: llama-server speaks the OpenAI API (and Anthropic's messages in recent builds), "
    "not Ollama's; a local Blazar fronting the cluster through upstream Lanes would "
    "keep every dialect",
    f"Sessions and the x-blazar-slo header: clients send {OBJECTIVE_HEADER}: <lane>-<policy>",
)


def render(result: Export) -> str:
    """YAML, one document per object, after a comment header with what to provide and
    what did not translate (what `kubectl apply -f` takes)."""
    header = [
        "# Generated by `blazar export kubernetes`. Apply with `kubectl apply -f`.",
        "#",
        "# What you provide:",
        *_bullets(result.provide),
        "#",
        "# Not translated (Blazar does it, these objects do not):",
        *_bullets(result.untranslated),
    ]
    documents = [_yaml(obj) for obj in result.objects]
    return "\n".join(header) + "\n---\n" + "---\n".join(documents)


def _bullets(lines: Sequence[str]) -> list[str]:
    # A line that begins with spaces continues the item above it.
    return [f"#     {line.lstrip()}" if line.startswith(" ") else f"#   - {line}" for line in lines]


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people and kubectl: no anchors for repeated values, multi-line
    strings (the ConfigMap's manifests) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _yaml(obj: Object) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


# --- names and labels -------------------------------------------------------------


def _check_service_names(lanes: Sequence[Lane]) -> None:
    # A Lane name is a DNS-1123 label; a Service name must also begin with a letter.
    bad = [lane.metadata.name for lane in lanes if not lane.metadata.name[0].isalpha()]
    if bad:
        raise ExportError(
            f"Lane {', '.join(bad)}: a Kubernetes Service name must begin with a letter; "
            "rename the Lane to export it"
        )


def _check_derived_names(lanes: Sequence[Lane], policies: Sequence[SLOPolicy]) -> None:
    """The names made of two (`<lane>-<policy>`, `<lane>-epp`) must be distinct and fit:
    kubectl applies a second object of a name over the first, and a Service name is at
    most 63 characters."""
    by_name: dict[str, list[str]] = {}
    for lane in lanes:
        for policy in policies:
            name = f"{lane.metadata.name}-{policy.metadata.name}"
            by_name.setdefault(name, []).append(f"{lane.metadata.name} x {policy.metadata.name}")
    clashes = [f"{name} ({', '.join(pairs)})" for name, pairs in by_name.items() if len(pairs) > 1]
    if clashes:
        raise ExportError(
            f"InferenceObjective {'; '.join(clashes)}: Lane and SLOPolicy pairs would share "
            "an object's name; rename a Lane or an SLOPolicy to export them"
        )
    services = {lane.metadata.name for lane in lanes}
    bad = [
        lane.metadata.name
        for lane in lanes
        if f"{lane.metadata.name}-epp" in services or len(lane.metadata.name) > 63 - len("-epp")
    ]
    if bad:
        raise ExportError(
            f"Lane {', '.join(bad)}: its endpoint picker Service <lane>-epp would be another "
            "Lane's Service or longer than 63 characters; rename the Lane to export it"
        )


def _upstream_gap(lane: Lane) -> str:
    upstream = lane.spec.upstream
    where = upstream.url if upstream is not None else "its upstream"
    return (
        f"Lane/{lane.metadata.name}: spec.engine: upstream Lanes get no Deployment, Service or "
        f"InferencePool: nothing in the cluster sends {', '.join(_names(lane))} to {where} "
        "(a Blazar serving the ConfigMap does)"
    )


def _labels(name: str, *, fleet: str) -> dict[str, str]:
    return {_LABEL_NAME: name, _LABEL_PART_OF: fleet, _LABEL_MANAGED_BY: MANAGED_BY}


def _selector(name: str, *, fleet: str) -> dict[str, str]:
    return {_LABEL_NAME: name, _LABEL_PART_OF: fleet}


def _model_file(name: str) -> str:
    return f"{MODELS_DIR}/{name}.gguf"


# --- the fleet ----------------------------------------------------------------------


def manifest(resource: Resource) -> dict[str, Any]:
    """A resource as a user would write it: name, labels, annotations and the spec
    fields that differ from their defaults. Parsing it gives the same resource."""
    metadata = resource.metadata.model_dump(
        mode="json", by_alias=True, include={"name", "labels", "annotations"}, exclude_defaults=True
    )
    spec = resource.spec.model_dump(
        mode="json", by_alias=True, exclude_none=True, exclude_defaults=True
    )
    return {
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": metadata,
        "spec": spec,
    }


def _config_map(resources: Sequence[Resource], *, fleet: str) -> Object:
    data = {
        f"{r.kind.lower()}-{r.metadata.name}.yaml": yaml.safe_dump(manifest(r), sort_keys=False)
        for r in resources
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{fleet}-manifests", "labels": _labels(fleet, fleet=fleet)},
        "data": dict(sorted(data.items())),
    }


def _served_models(lanes: Sequence[Lane], pairs: Mapping[str, SpecPair]) -> list[str]:
    """The Models the exported Lanes load (their own and their SpecPairs' drafts)."""
    names = {lane.spec.model for lane in lanes}
    for lane in lanes:
        pair = pairs.get(lane.spec.speculation) if lane.spec.speculation else None
        if pair is not None and isinstance(pair.spec.draft, ModelDraft):
            names.add(pair.spec.draft.model)
    return sorted(names)


def _claim(
    served: Sequence[str],
    models: Mapping[str, Model],
    files: Mapping[str, ModelFile],
    *,
    fleet: str,
    untranslated: list[str],
) -> Object:
    """The volume of GGUF files, sized for the files read here (whole GiB)."""
    known = [files[n].size_bytes for n in served if n in files and files[n].size_bytes]
    total = sum(s for s in known if s is not None)
    gib = max(1, -(-total // GIB))
    unsized = [n for n in served if not (n in files and files[n].size_bytes)]
    if unsized:
        untranslated.append(
            f"PersistentVolumeClaim/{fleet}-models: spec.resources.requests.storage: "
            f"counts no file of Model {', '.join(unsized)} (not read on this host); "
            "raise it to hold them"
        )
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{fleet}-models", "labels": _labels(fleet, fleet=fleet)},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "resources": {"requests": {"storage": f"{gib}Gi"}},
        },
    }


def _provide(
    served: Sequence[str], models: Mapping[str, Model], lanes: Sequence[Lane], *, fleet: str
) -> list[str]:
    lines = [
        f"The PersistentVolumeClaim {fleet}-models filled with each Model's GGUF "
        f"(mounted read-only at {MODELS_DIR}; e.g. bind it to a PersistentVolume that "
        "holds them):"
    ]
    for name in served:
        source = models[name].spec.source
        where = f"path {source.path}" if source.path is not None else f"package {source.package}"
        digest = models[name].spec.sha256
        check = f", sha256 {digest}" if digest else ""
        lines.append(f"  {name}.gguf: Model {name} ({where}{check})")
    if lanes:
        pools = ", ".join(lane.metadata.name for lane in lanes)
        lines.append(
            f"The InferencePool and InferenceObjective CRDs ({POOL_API_VERSION}, "
            f"{OBJECTIVE_API_VERSION}), an endpoint picker Service <lane>-epp on port "
            f"{EPP_PORT} for each InferencePool ({pools}), e.g. llm-d-router's, and a Gateway "
            "with an HTTPRoute to each pool"
        )
    return lines


# --- a Lane -------------------------------------------------------------------------


def server_args(
    lane: Lane, model: Model, pair: SpecPair | None, *, fallback_template: str | None = None
) -> list[str]:
    """llama-server's command line for one replica of `lane`; `fallback_template` is the
    named turn format Blazar's engine renders with when the Model sets none and its GGUF
    ships none (`chat_template_fallback`)."""
    spec = lane.spec
    args = [
        "--model", _model_file(model.metadata.name),
        "--alias", ",".join(_names(lane)),
        "--host", "0.0.0.0",
        "--port", str(PORT),
        "--parallel", str(spec.slots),
        "--ctx-size", str(spec.slots * spec.context_per_slot),
        "--cache-type-k", spec.kv_cache.type_k,
        "--cache-type-v", spec.kv_cache.type_v,
        "--n-gpu-layers", str(spec.gpu_layers),
        "--flash-attn", spec.flash_attention,
        # llama-server keeps up to 8 GiB of prompts in host memory by default, which the
        # pod's memory request (Blazar's fit estimate) does not count and Blazar's
        # engine does not do: its slots' caches are its only prompt cache.
        "--cache-ram", "0",
    ]  # fmt: skip
    if spec.threads is not None:
        args += ["--threads", str(spec.threads)]
    template = model.spec.chat_template or fallback_template
    if template in _LEGACY_TEMPLATES:
        # llama-server's Jinja mode (its default) takes any other name as the template's
        # source, so every conversation would render as the bare word "gemma"; its
        # built-in formats of these names are Blazar's (checked on the vendored build).
        args += ["--no-jinja", "--chat-template", template]
    elif template is not None:
        # "chatml", which Jinja mode also knows by name, or Jinja source.
        args += ["--chat-template", template]
    if pair is not None:
        draft = pair.spec.draft
        if isinstance(draft, NgramDraft):
            args += [
                "--spec-type", "ngram-simple",
                "--spec-ngram-simple-size-n", str(draft.ngram_size),
                "--spec-ngram-simple-size-m", str(draft.max_draft_tokens),
                "--spec-draft-n-max", str(draft.max_draft_tokens),
            ]  # fmt: skip
        else:
            # Without --spec-type, llama-server loads the draft model and never drafts
            # (its default type is none; checked on the vendored build).
            args += [
                "--spec-type", "draft-simple",
                "--spec-draft-model", _model_file(draft.model),
                "--spec-draft-n-max", str(draft.max_draft_tokens),
            ]  # fmt: skip
    return args


# Blazar's named turn formats that llama-server knows only with --no-jinja.
_LEGACY_TEMPLATES = tuple(n for n in CHAT_TEMPLATE_NAMES if n != "chatml")


def chat_template_fallback(model: Model, file: ModelFile | None) -> tuple[str | None, str | None]:
    """The named template llama-server must be given for `model` to render as Blazar's
    engine does when neither the Model nor its GGUF has one (llama-server falls back to
    ChatML, Blazar by architecture), or None; and, when that cannot be told because the
    GGUF was not read, the gap to report."""
    if model.spec.chat_template is not None:
        return None, None
    if file is None or file.has_chat_template is None or file.architecture is None:
        return None, (
            f"Model/{model.metadata.name}: spec.chatTemplate: unset, and its GGUF was not read "
            "here: if the file ships no chat template, llama-server renders ChatML where "
            "Blazar picks the format by architecture (Gemma's turns for gemma); set "
            "chatTemplate to export the same prompts"
        )
    if file.has_chat_template:
        return None, None
    return fallback_template(file.architecture), None


def _names(lane: Lane) -> list[str]:
    """The names llama-server lists the model under (its `--alias` takes a comma-separated
    list): the Lane's and those of its aliases that hold no comma."""
    return [lane.metadata.name, *(a for a in lane.spec.aliases if "," not in a)]


def memory_estimate(
    lane: Lane, model: Model, pair: SpecPair | None, files: Mapping[str, ModelFile]
) -> tuple[int | None, str | None]:
    """Bytes one replica needs by Blazar's fit ledger, or None and why not."""
    target = files.get(model.metadata.name)
    if target is None or target.shape is None:
        why = target.missing if target is not None and target.missing else "not read"
        return None, f"Model {model.metadata.name}'s GGUF: {why}"
    speculation = None
    draft_shape = None
    if pair is not None:
        draft_path = None
        if isinstance(pair.spec.draft, ModelDraft):
            draft_path = _model_file(pair.spec.draft.model)
            draft = files.get(pair.spec.draft.model)
            if draft is None or draft.shape is None:
                why = draft.missing if draft is not None and draft.missing else "not read"
                return None, f"draft Model {pair.spec.draft.model}'s GGUF: {why}"
            draft_shape = draft.shape
        speculation = SpeculationLaunch.of_pair(pair.spec, draft_model_path=draft_path)
    launch = LaunchSpec.of_lane(
        lane.spec,
        model_path=_model_file(model.metadata.name),
        default_threads=lane.spec.threads or 1,
        chat_template=model.spec.chat_template,
        speculation=speculation,
    )
    return fit.estimate(launch, target.shape, draft=draft_shape).total, None


def _deployment(
    lane: Lane,
    model: Model,
    pair: SpecPair | None,
    files: Mapping[str, ModelFile],
    *,
    fleet: str,
    image: str,
    untranslated: list[str],
) -> Object:
    name = lane.metadata.name
    requests: dict[str, str] = {}
    if lane.spec.threads is not None:
        requests["cpu"] = str(lane.spec.threads)
    need, why = memory_estimate(lane, model, pair, files)
    if need is not None:
        requests["memory"] = f"{-(-need // fit.MIB)}Mi"
    else:
        untranslated.append(
            f"Deployment/{name}: resources.requests.memory: left out, Blazar's estimate needs {why}"
        )
    fallback, gap = chat_template_fallback(model, files.get(model.metadata.name))
    if gap is not None:
        untranslated.append(gap)
    if model.spec.chat_template in _LEGACY_TEMPLATES or fallback in _LEGACY_TEMPLATES:
        untranslated.append(
            f"Model/{model.metadata.name}: spec.chatTemplate: llama-server knows the "
            f"{model.spec.chat_template or fallback} format only without Jinja (--no-jinja), "
            "where it refuses requests that carry tools"
        )
    container: Object = {
        "name": "llama-server",
        "image": image,
        "args": server_args(lane, model, pair, fallback_template=fallback),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        **_probes(lane),
        "volumeMounts": [{"name": MODELS_VOLUME, "mountPath": MODELS_DIR, "readOnly": True}],
    }
    if requests:
        container["resources"] = {"requests": requests}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": _labels(name, fleet=fleet)},
        "spec": {
            "replicas": lane.spec.replicas,
            "selector": {"matchLabels": _selector(name, fleet=fleet)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": _labels(name, fleet=fleet)},
                "spec": {
                    "containers": [container],
                    "volumes": [
                        {
                            "name": MODELS_VOLUME,
                            "persistentVolumeClaim": {
                                "claimName": f"{fleet}-models",
                                "readOnly": True,
                            },
                        }
                    ],
                },
            },
        },
    }


def _service(lane: Lane, *, fleet: str) -> Object:
    name = lane.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": _labels(name, fleet=fleet)},
        "spec": {
            "selector": _selector(name, fleet=fleet),
            "ports": [
                {"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def _pool(lane: Lane, *, fleet: str) -> Object:
    name = lane.metadata.name
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name, "labels": _labels(name, fleet=fleet)},
        "spec": {
            "selector": {"matchLabels": _selector(name, fleet=fleet)},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": EPP_PORT}},
        },
    }


def _objective(lane: Lane, policy: SLOPolicy, *, fleet: str, untranslated: list[str]) -> Object:
    name = f"{lane.metadata.name}-{policy.metadata.name}"
    spec: Object = {
        "poolRef": {"group": POOL_GROUP, "kind": "InferencePool", "name": lane.metadata.name}
    }
    if policy.spec.priority in _INT32:
        spec["priority"] = policy.spec.priority
    else:
        untranslated.append(
            f"SLOPolicy/{policy.metadata.name}: spec.priority: {policy.spec.priority} is "
            "outside an InferenceObjective's int32 priority; its objectives have none"
        )
    return {
        "apiVersion": OBJECTIVE_API_VERSION,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "labels": _labels(lane.metadata.name, fleet=fleet)},
        "spec": spec,
    }


def _probes(lane: Lane) -> Object:
    """The container's probes of llama-server's /health: the Lane's `health` where it
    sets one (a replica Ready within startupSeconds, checked every periodSeconds), else
    a kubelet's usual shape, patient with a large model's load (10 minutes)."""
    probe = {"httpGet": {"path": "/health", "port": PORT_NAME}}
    if "health" not in lane.spec.model_fields_set:
        # llama-server answers 503 until the model is loaded: a large one takes minutes.
        return {
            "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        }
    health = lane.spec.health
    period = health.period_seconds
    return {
        # Whole periods, at least startupSeconds: a kubelet counts failed probes.
        "startupProbe": {
            **probe,
            "periodSeconds": period,
            "timeoutSeconds": health.timeout_seconds,
            "failureThreshold": -(-health.startup_seconds // period),
        },
        "readinessProbe": {**probe, "periodSeconds": period},
        "livenessProbe": {
            **probe,
            "periodSeconds": period,
            "timeoutSeconds": health.timeout_seconds,
            "failureThreshold": health.failure_threshold,
        },
    }


def _lane_gaps(lane: Lane) -> list[str]:
    spec, where = lane.spec, f"Lane/{lane.metadata.name}"
    gaps = []
    if spec.slo_policy is not None:
        gaps.append(
            f"{where}: spec.sloPolicy: a request without {OBJECTIVE_HEADER} gets priority 0, "
            f"not {spec.slo_policy}'s; clients name {lane.metadata.name}-{spec.slo_policy}"
        )
    if spec.spillover is not None:
        gaps.append(
            f"{where}: spec.spillover: the gateway does not send a request predicted to miss "
            f"its target to another pool; route overflow to the {spec.spillover} pool yourself"
        )
    if spec.aliases:
        gaps.append(
            f"{where}: spec.aliases: llama-server lists them, but the gateway picks a pool by "
            "route, not by a body's model name: route "
            f"{', '.join(spec.aliases)} to the {lane.metadata.name} pool"
        )
    if any("," in alias for alias in spec.aliases):
        gaps.append(
            f"{where}: spec.aliases: llama-server's --alias is comma-separated, so an alias "
            "holding a comma is left out of it"
        )
    if spec.idle is not None and spec.idle.sleep_after is not None:
        gaps.append(
            f"{where}: spec.idle.sleepAfter: a Deployment does not scale to zero and wake on a "
            "request by itself (an autoscaler such as KEDA's HTTP add-on does)"
        )
    if spec.kv_cache.persist:
        gaps.append(
            f"{where}: spec.kvCache.persist: llama-server saves a slot's cache only when asked "
            "(--slot-save-path and POST /slots), not on stop"
        )
    if "max_parked_mib" in spec.kv_cache.model_fields_set:
        gaps.append(f"{where}: spec.kvCache.maxParkedMiB: llama-server does not preempt")
    if spec.gpu_layers > 0:
        gaps.append(
            f"{where}: spec.gpuLayers: --n-gpu-layers is set, but no GPU is requested; add "
            "your device plugin's resource (nvidia.com/gpu, ...) to the Deployment"
        )
    return gaps


def _pair_gaps(pair: SpecPair) -> list[str]:
    where = f"SpecPair/{pair.metadata.name}"
    return [
        f"{where}: spec.disableAboveBatch: llama-server drafts at every batch size",
        f"{where}: spec.minAcceptanceRate: llama-server keeps drafting whatever is accepted",
    ]


# An SLOPolicy's fields beyond priority, and why each has no equivalent.
_POLICY_GAPS = {
    "ttft_target_ms": (
        "ttftTargetMs",
        "no time-to-first-token target on an InferenceObjective; no early reject",
    ),
    "tpot_target_ms": ("tpotTargetMs", "no per-token target on an InferenceObjective"),
    "max_queue_depth": ("maxQueueDepth", "the endpoint picker's flow control bounds its queues"),
    "max_queue_wait_ms": (
        "maxQueueWaitMs",
        "the endpoint picker's flow control sets how long a request waits",
    ),
    "on_overload": ("onOverload", "what an overloaded pool sheds is the endpoint picker's rule"),
    "max_slots_per_replica": (
        "maxSlotsPerReplica",
        "no per-replica concurrency cap by objective; the endpoint picker places requests",
    ),
    "tenants": ("tenants", "no fair sharing between tenants on an InferenceObjective"),
    "rate_limit": ("rateLimit", "rate limits are the gateway's"),
}


def _policy_gaps(policy: SLOPolicy) -> list[str]:
    where = f"SLOPolicy/{policy.metadata.name}"
    return [
        f"{where}: spec.{name}: {why}"
        for attr, (name, why) in _POLICY_GAPS.items()
        # Set, and to something: `tenants: []` (stored as None) or a null sets nothing.
        if attr in policy.spec.model_fields_set and getattr(policy.spec, attr) is not None
    ]
