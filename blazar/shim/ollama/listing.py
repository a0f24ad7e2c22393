"""What ListModels lists, in Ollama's shapes: `/api/tags`, `/api/show` and `/api/ps`,
and the refusal of Ollama's model management routes.

Pure: the time `ps` counts from comes in as an argument.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import inference, validation
from blazar.shim.ollama import protocol, render

# What Ollama's ps shows for a model kept forever: now plus Go's longest duration.
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)
_MANAGED = (
    "Models are managed with `blazar apply` (a Model and a Lane manifest), not through "
    "the Ollama API; `blazar get lanes` lists what is served."
)


def model_info(response: inference_pb2.ListModelsResponse, name: str) -> inference_pb2.ModelInfo:
    """The listed model called `name` (a Lane name or an alias, `modelnames.lookups`);
    ModelNotFound if none."""
    return inference.listed_model(response, name)


def show_name(body: protocol.ShowRequest) -> str:
    """The model `/api/show` is asked about. Ollama's `system`, `template` and
    `options` there show the model as if its Modelfile had them; Blazar's Modelfile is
    a Lane, so they are refused when set (Go's client sends them empty). `verbose`
    asks for the tensors and the tokenizer's arrays, which Blazar does not read from the
    file: refused when true, where Ollama's CLI sends it (`ollama show --verbose`)."""
    if body.verbose:
        raise validation.invalid(
            "'verbose' is not supported on /api/show: Blazar does not show a model's "
            "tensors or tokenizer arrays, only what the answer without it has. Leave it "
            "out or send false.",
            param="verbose",
        )
    for field in ("system", "template", "options"):
        if getattr(body, field):
            raise validation.invalid(
                f"'{field}' is not supported on /api/show: Blazar shows the Lane as it is "
                "served and cannot show it with another system prompt, template or "
                "options. Leave it out.",
                param=field,
            )
    name = body.model or body.name
    if not name:
        raise validation.invalid("Missing required parameter: 'model'.", param="model")
    return name


def management_refused(route: str) -> errors.InvalidRequest:
    """What /api/pull, push, create, copy and delete answer."""
    return errors.InvalidRequest(f"{route} is not supported. {_MANAGED}")


def _from_unix(seconds: int) -> str:
    return render.timestamp(datetime.fromtimestamp(seconds, UTC))


def _details(info: inference_pb2.ModelInfo) -> protocol.ModelDetails:
    family = info.file.architecture
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family] if family else [],
        "parameter_size": info.file.parameter_size,
        "quantization_level": info.file.quantization,
    }


def _modified_at(info: inference_pb2.ModelInfo) -> str:
    return _from_unix(info.file.modified or info.created)


def tags(response: inference_pb2.ListModelsResponse) -> protocol.ListResponse:
    """Every name a client may ask for: each Lane's name and aliases."""
    return {
        "models": [
            {
                "name": info.id,
                "model": info.id,
                "modified_at": _modified_at(info),
                "size": info.file.size_bytes,
                "digest": info.file.sha256,
                "details": _details(info),
            }
            for info in response.models
        ]
    }


def show(info: inference_pb2.ModelInfo) -> protocol.ShowResponse:
    """`model_info` gives the Lane's context per slot as the architecture's context
    length, since that is what a client can use; the trained one is under `blazar.`."""
    arch = info.file.architecture or "unknown"
    model_info: dict[str, Any] = {"general.architecture": arch}
    if info.file.name:
        model_info["general.name"] = info.file.name
    if info.file.parameter_size:
        model_info["general.size_label"] = info.file.parameter_size
    model_info[f"{arch}.context_length"] = info.context_length
    for key, value in (
        ("embedding_length", info.file.embedding_length),
        ("block_count", info.file.block_count),
        ("attention.head_count", info.file.head_count),
        ("attention.head_count_kv", info.file.head_count_kv),
    ):
        if value:
            model_info[f"{arch}.{key}"] = value
    model_info["blazar.lane"] = info.lane
    model_info["blazar.model"] = info.model
    model_info["blazar.slots"] = info.slots
    if info.file.trained_context_length:
        model_info["blazar.trained_context_length"] = info.file.trained_context_length
    modelfile = (
        f"# Served by Blazar: Lane '{info.lane}', Model '{info.model}'.\n"
        f"# {_MANAGED}\n"
        f"FROM {info.model}\n"
    )
    return {
        "modelfile": modelfile,
        "details": _details(info),
        "model_info": model_info,
        # Every Lane calls tools: by its template, or by Blazar's own tool prompt.
        "capabilities": ["completion", "tools"],
        "modified_at": _modified_at(info),
    }


def ps(response: inference_pb2.ListModelsResponse, *, now: datetime) -> protocol.ProcessResponse:
    """One entry per Lane with a serving replica, under the Lane's name. Replicas share
    the file's pages, so `size` is the file's size once (KV caches not counted); Blazar
    does not report GPU offload here, so `size_vram` is 0. A Lane expires when it will
    fall asleep if no request comes (idle.sleepAfter, keep_alive), else when Ollama's
    kept-forever models do."""

    def expires_at(info: inference_pb2.ModelInfo) -> str:
        if not info.HasField("sleeps_in_s"):
            return render.timestamp(now + _FOREVER)
        # A keep_alive of 1e300 seconds is taken; the date stops at Ollama's forever.
        seconds = min(info.sleeps_in_s, _FOREVER.total_seconds())
        return render.timestamp(now + timedelta(seconds=seconds))

    return {
        "models": [
            {
                "name": info.id,
                "model": info.id,
                "size": info.file.size_bytes,
                "digest": info.file.sha256,
                "details": _details(info),
                "expires_at": expires_at(info),
                "size_vram": 0,
                "context_length": info.context_length,
            }
            for info in response.models
            if info.id == info.lane and info.ready_replicas > 0
        ]
    }
