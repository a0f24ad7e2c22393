"""Translate between Ollama's wire format and the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging (timestamps come in as arguments). Request side:
`chat_request` and `generate_request` build the canonical request, with `options`
read by `sampling`: every option either does what Ollama does with it or is refused
by name, and `check_num_ctx` refuses a context larger than the Lane serves. Response
side: `Lines` renders a chunk stream as Ollama's NDJSON objects, `answer` a collected
one; `tags`, `show` and `ps` describe what ListModels lists; `error_response`
renders any `BlazarError` as Ollama's `{"error": ...}` with the shared HTTP status.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import canonical, http_errors, validation
from blazar.shim.ollama import protocol, template

Kind = Literal["chat", "generate"]

# Ollama's num_predict: -1 generates until the model stops, -2 until the context is
# full; the runner reads 0 as "no limit" too. Blazar stops at both, so all mean unset.
_UNLIMITED_PREDICT = (-2, -1, 0)
# Ollama reads a negative keep_alive as "keep the model loaded forever": what Blazar
# does with every Lane's replicas until the Lane changes.
_GO_DURATION = re.compile(
    r"-?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))*"
)
# What Ollama's ps shows for a model kept forever: now plus Go's longest duration.
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)
_TOOLS_NOT_YET = "Tool calls are not supported yet in Blazar's Ollama dialect"
_MANAGED = (
    "Models are managed with `blazar apply` (a Model and a Lane manifest), not through "
    "the Ollama API; `blazar get lanes` lists what is served."
)

# Ollama options Blazar does not take, and why (the rest are unknown to Ollama too).
_SAMPLER_OPTIONS = frozenset(
    {
        "num_keep", "typical_p", "repeat_last_n", "tfs_z", "mirostat", "mirostat_tau",
        "mirostat_eta", "penalize_newline",
    }
)  # fmt: skip
_LANE_OPTIONS = {
    "num_thread": "threads",
    "num_gpu": "gpuLayers",
    "num_batch": None,
    "main_gpu": None,
    "use_mmap": None,
    "use_mlock": None,
    "low_vram": None,
    "f16_kv": "kvCache",
    "vocab_only": None,
    "numa": None,
    "logits_all": None,
}


def _invalid(message: str, *, param: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={validation.PARAM_KEY: param})


# ---------------------------------------------------------------- requests


def is_load(body: protocol.ChatRequest | protocol.GenerateRequest) -> bool:
    """Ollama's preload: a chat without messages or a generate without a prompt only
    loads the model. Blazar's Lanes are loaded already; the answer says the model exists."""
    if isinstance(body, protocol.ChatRequest):
        return not body.messages
    return not body.prompt


def chat_request(body: protocol.ChatRequest, *, session: str = "") -> inference_pb2.ChatRequest:
    """The canonical request for a chat with at least one message."""
    _check_generation(body)
    if body.tools:
        raise _invalid(f"{_TOOLS_NOT_YET}; send the request without 'tools'.", param="tools")
    messages = [
        _message(message, param=f"messages[{i}]") for i, message in enumerate(body.messages)
    ]
    return inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=_sampling_of(body),
        constraint=constraint(body.format),
        session=session,
    )


def generate_request(
    body: protocol.GenerateRequest, *, session: str = ""
) -> inference_pb2.ChatRequest | inference_pb2.CompleteRequest:
    """A prompt through the model's chat template (with `system` as the system turn);
    with `template`, through that one (see `template.render`) instead; with `raw`, the
    prompt as it is. The last two are continued with no chat template."""
    _check_generation(body)
    for name in ("images", "context"):
        if getattr(body, name):
            raise _invalid(_GENERATE_REFUSALS[name], param=name)
    if body.suffix:
        raise _invalid(
            "'suffix' is not supported: Blazar only continues a prompt, it does not fill "
            "in between a prompt and a suffix.",
            param="suffix",
        )
    sampling = _sampling_of(body)
    if body.raw:
        for name in ("system", "template"):
            if getattr(body, name):
                raise _invalid(
                    f"'{name}' cannot go with 'raw': true (raw mode applies no template).",
                    param=name,
                )
    if body.raw or body.template:
        prompt = body.prompt
        if body.template:
            prompt = template.render(body.template, system=body.system or "", prompt=prompt)
        return inference_pb2.CompleteRequest(
            model=body.model,
            prompt=prompt,
            sampling=sampling,
            constraint=constraint(body.format),
            session=session,
        )
    messages = [inference_pb2.Message(role="user", content=body.prompt)]
    if body.system:
        messages.insert(0, inference_pb2.Message(role="system", content=body.system))
    return inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        constraint=constraint(body.format),
        session=session,
    )


_GENERATE_REFUSALS = {
    "images": "'images' are not supported: Blazar serves text-only models.",
    "context": (
        "'context' (token ids from an earlier answer) is not supported; send the "
        "conversation as messages to /api/chat instead."
    ),
}


def _check_generation(body: protocol.ChatRequest | protocol.GenerateRequest) -> None:
    """The fields of chat and generate Blazar cannot honour, refused by name."""
    check_keep_alive(body.keep_alive)
    if body.think is not None and body.think is not False:
        raise _invalid(
            f"'{body.model}' does not support thinking; send the request without 'think' "
            "(or with 'think': false).",
            param="think",
        )
    for name in ("truncate", "shift"):
        if getattr(body, name):
            raise _invalid(
                f"'{name}': true is not supported: Blazar never cuts a conversation short "
                "or shifts the context; a prompt that does not fit is refused, and a "
                f'generation that fills the context stops with done_reason "length". '
                f"Send '{name}': false or leave it out.",
                param=name,
            )
    if body.top_logprobs and not body.logprobs:
        raise _invalid("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")


def check_keep_alive(keep_alive: protocol.KeepAlive) -> None:
    """Accept an absent or negative (forever) keep_alive: Blazar keeps Lanes loaded."""
    if keep_alive is None:
        return
    if isinstance(keep_alive, bool):
        forever = False
    elif isinstance(keep_alive, int | float):
        forever = keep_alive < 0
    else:
        text = keep_alive.strip()
        # A negative number of seconds as text ("-1") means what the number would.
        number = text.removeprefix("-")
        seconds = number.replace(".", "", 1).isdigit() and number.isascii()
        forever = text.startswith("-") and (seconds or bool(_GO_DURATION.fullmatch(text)))
    if not forever:
        raise _invalid(
            f"'keep_alive' {keep_alive!r} is not supported yet: Blazar keeps every Lane's "
            "replicas loaded until the Lane changes, and unloading after idle time (the "
            "Lane's idle.sleepAfter) is not built yet (issue 20). Leave 'keep_alive' out, "
            "or send a negative value (keep loaded).",
            param="keep_alive",
        )


def _message(message: protocol.Message, *, param: str) -> inference_pb2.Message:
    role = message.role.lower()
    if role == "tool" or message.tool_calls or message.tool_name or message.tool_call_id:
        field = next(
            name
            for name in ("tool_calls", "tool_name", "tool_call_id", "role")
            if getattr(message, name)
        )
        raise _invalid(
            f"{_TOOLS_NOT_YET}, so a conversation cannot carry '{param}.{field}'.",
            param=f"{param}.{field}",
        )
    if role not in ("system", "user", "assistant"):
        raise _invalid(
            f"Invalid value for '{param}.role': {message.role!r}; use system, user or assistant.",
            param=f"{param}.role",
        )
    if message.images:
        raise _invalid(
            f"'{param}.images' are not supported: Blazar serves text-only models.",
            param=f"{param}.images",
        )
    if message.thinking:
        raise _invalid(
            f"'{param}.thinking' is not supported: Blazar's models do not think; send the "
            "turn's content only.",
            param=f"{param}.thinking",
        )
    return inference_pb2.Message(role=role, content=message.content)


def constraint(fmt: protocol.Format) -> inference_pb2.Constraint | None:
    """Ollama's `format`: "json" is any JSON object, an object is a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return canonical.json_object()
    if isinstance(fmt, dict):
        return canonical.json_schema(fmt)
    raise _invalid(
        f"Invalid value for 'format': {fmt!r}; use \"json\" or a JSON schema (an object).",
        param="format",
    )


def _sampling_of(body: protocol.ChatRequest | protocol.GenerateRequest) -> inference_pb2.Sampling:
    out = sampling(body.options or {})
    if body.logprobs:
        out.logprobs = True
        out.top_logprobs = body.top_logprobs or 0
    return out


def sampling(options: Mapping[str, Any]) -> inference_pb2.Sampling:
    """Ollama's `options` as canonical sampling. `num_ctx` is not sampling: see
    `check_num_ctx`. Anything else is refused by name, never ignored; an option sent as
    null is not set (clients send every setting they have, set or not)."""
    options = {name: value for name, value in options.items() if value is not None}
    for name in options:
        if name not in _OPTIONS:
            raise _unsupported_option(name)
    read = _OptionReader(options)
    num_predict = read.integer("num_predict", low=-2, high=canonical.INT32_MAX)
    stop = options.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _invalid(
            "Invalid value for 'options.stop': use a string or a list of strings.",
            param="options.stop",
        )
    read.integer("num_ctx", low=1, high=canonical.INT32_MAX)
    return canonical.sampling(
        temperature=read.number("temperature", low=0),
        top_p=read.number("top_p", low=0, high=1),
        top_k=read.integer("top_k", low=0, high=canonical.INT32_MAX),
        min_p=read.number("min_p", low=0, high=1),
        repeat_penalty=read.number("repeat_penalty", low=0, low_open=True),
        presence_penalty=read.number("presence_penalty", low=-2, high=2),
        frequency_penalty=read.number("frequency_penalty", low=-2, high=2),
        seed=read.integer("seed"),
        max_tokens=None if num_predict in (None, *_UNLIMITED_PREDICT) else num_predict,
        stop=[stop] if isinstance(stop, str) else (stop or ()),
    )


_OPTIONS = frozenset(
    {
        "num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
        "repeat_penalty", "presence_penalty", "frequency_penalty", "num_ctx",
    }
)  # fmt: skip


def _unsupported_option(name: str) -> errors.InvalidRequest:
    param = f"options.{name}"
    if name in _SAMPLER_OPTIONS:
        why = "Blazar's sampler does not have it"
    elif name in _LANE_OPTIONS:
        setting = _LANE_OPTIONS[name]
        why = (
            f"it is an engine setting, which Blazar takes from the Lane ({setting})"
            if setting
            else "it is an engine setting Blazar does not take per request"
        )
    else:
        why = "it is not an option Blazar knows"
    supported = ", ".join(sorted(_OPTIONS))
    return _invalid(
        f"'{param}' is not supported: {why}. Supported options: {supported}.", param=param
    )


@dataclass(frozen=True)
class _OptionReader:
    options: Mapping[str, Any]

    def integer(self, name: str, *, low: int | None = None, high: int | None = None) -> int | None:
        value = self.options.get(name)
        if value is None:
            return None
        # Go decodes a whole JSON number into an int option; so does Ollama's client.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(
                f"Invalid value for 'options.{name}': {value!r} is not an integer.",
                param=f"options.{name}",
            )
        self._check_range(name, value, low=low, high=high, low_open=False)
        return value

    def number(
        self,
        name: str,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
    ) -> float | None:
        value = self.options.get(name)
        if value is None:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _invalid(
                f"Invalid value for 'options.{name}': {value!r} is not a number.",
                param=f"options.{name}",
            )
        self._check_range(name, value, low=low, high=high, low_open=low_open)
        return float(value)

    @staticmethod
    def _check_range(
        name: str, value: float, *, low: float | None, high: float | None, low_open: bool
    ) -> None:
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and value > high
        if below or above or not math.isfinite(value):
            bounds = []
            if low is not None:
                bounds.append(f"more than {low:g}" if low_open else f"at least {low:g}")
            if high is not None:
                bounds.append(f"at most {high:g}")
            raise _invalid(
                f"Invalid value for 'options.{name}': {value!r}; it must be "
                f"{' and '.join(bounds)}.",
                param=f"options.{name}",
            )


def num_ctx(options: Mapping[str, Any] | None) -> int | None:
    """The `num_ctx` option (checked by `sampling`), None when not sent."""
    value = (options or {}).get("num_ctx")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_num_ctx(requested: int, info: inference_pb2.ModelInfo) -> None:
    """A context up to the Lane's context per slot fits (every request gets that much);
    a larger one is refused, never silently served with less."""
    if requested > info.context_length:
        raise errors.ContextLengthExceeded(
            f"'options.num_ctx' {requested} is larger than the context Lane "
            f"'{info.lane}' serves per request (contextPerSlot {info.context_length}). Send "
            f"num_ctx {info.context_length} or less, or raise the Lane's contextPerSlot.",
            metadata={
                validation.PARAM_KEY: "options.num_ctx",
                "num_ctx": str(requested),
                "context_length": str(info.context_length),
            },
        )


def embed_request(body: protocol.EmbedRequest) -> inference_pb2.EmbedRequest:
    """/api/embed's embeddings are unit length, as Ollama's are."""
    _check_embedding(body.keep_alive, body.options, truncate=body.truncate)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    return inference_pb2.EmbedRequest(model=body.model, inputs=inputs, normalize=True)


def embeddings_request(body: protocol.EmbeddingsRequest) -> inference_pb2.EmbedRequest:
    """The older /api/embeddings: the raw embedding, not normalized, as Ollama's."""
    _check_embedding(body.keep_alive, body.options, truncate=None)
    return inference_pb2.EmbedRequest(model=body.model, inputs=[body.prompt], normalize=False)


def _check_embedding(
    keep_alive: protocol.KeepAlive, options: Mapping[str, Any] | None, *, truncate: bool | None
) -> None:
    check_keep_alive(keep_alive)
    if truncate:
        raise _invalid(
            "'truncate': true is not supported: Blazar never cuts an input short; an input "
            "longer than the context is refused. Send 'truncate': false or leave it out.",
            param="truncate",
        )
    for name, value in (options or {}).items():
        # Embedding has no sampling; only the context size means anything here.
        if name != "num_ctx" and value is not None:
            raise _invalid(
                f"'options.{name}' is not supported for embeddings; only num_ctx is.",
                param=f"options.{name}",
            )
    _OptionReader(options or {}).integer("num_ctx", low=1, high=canonical.INT32_MAX)


def model_info(response: inference_pb2.ListModelsResponse, name: str) -> inference_pb2.ModelInfo:
    """The listed model called `name` (a Lane name or an alias); ModelNotFound if none."""
    for info in response.models:
        if info.id == name:
            return info
    raise errors.ModelNotFound.of(name)


def show_name(body: protocol.ShowRequest) -> str:
    name = body.model or body.name
    if not name:
        raise _invalid("Missing required parameter: 'model'.", param="model")
    return name


def management_refused(route: str) -> errors.InvalidRequest:
    """What /api/pull, push, create, copy and delete answer."""
    return errors.InvalidRequest(f"{route} is not supported. {_MANAGED}")


# ---------------------------------------------------------------- responses


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, as Go writes `time.Time`."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _from_unix(seconds: int) -> str:
    return timestamp(datetime.fromtimestamp(seconds, UTC))


def done_reason(final: inference_pb2.Final) -> protocol.DoneReason:
    if final.finish_reason == inference_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "stop"


def _ns(milliseconds: float) -> int:
    return max(0, round(milliseconds * 1_000_000))


def metrics(final: inference_pb2.Final) -> protocol.Metrics:
    """Ollama's statistics from the canonical figures, in nanoseconds.

    `load_duration` is the queue time (admission, a free slot, preparing the prompt):
    Blazar's models are loaded already, and Ollama counts waiting for its runner there
    too. The prompt's figures are the prefill's; `eval_*` the decode's. The total runs
    from arrival to the last token: time to first token plus decoding, or, when the
    generation was parked after its first token, the parts plus the time parked.
    """
    timings = final.timings
    total_ms = max(
        timings.ttft_ms + timings.decode_ms,
        timings.queue_ms + timings.prefill_ms + timings.decode_ms + timings.parked_ms,
    )
    return {
        "total_duration": _ns(total_ms),
        "load_duration": _ns(timings.queue_ms),
        "prompt_eval_count": final.usage.prompt_tokens,
        "prompt_eval_duration": _ns(timings.prefill_ms),
        "eval_count": final.usage.completion_tokens,
        "eval_duration": _ns(timings.decode_ms),
    }


def logprobs(entries: Sequence[inference_pb2.TokenLogprob]) -> list[protocol.Logprob]:
    out: list[protocol.Logprob] = []
    for entry in entries:
        item: protocol.Logprob = {
            "token": entry.token,
            "logprob": entry.logprob,
            "bytes": list(entry.bytes),
        }
        if entry.top:
            item["top_logprobs"] = [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top
            ]
        out.append(item)
    return out


Line = protocol.ChatResponse | protocol.GenerateResponse


def _line(kind: Kind, *, model: str, created_at: str, text: str, done: bool) -> Line:
    if kind == "chat":
        chat: protocol.ChatResponse = {
            "model": model,
            "created_at": created_at,
            "message": {"role": "assistant", "content": text},
            "done": done,
        }
        return chat
    generate: protocol.GenerateResponse = {
        "model": model,
        "created_at": created_at,
        "response": text,
        "done": done,
    }
    return generate


def _finish(line: Line, final: inference_pb2.Final) -> Line:
    line["done_reason"] = done_reason(final)
    line.update(metrics(final))  # type: ignore[typeddict-item]
    return line


class Lines:
    """Renders one generation as Ollama's stream: an object per text delta
    (`done: false`), then one with `done: true`, the done reason and the statistics."""

    def __init__(
        self, kind: Kind, *, model: str, clock: Callable[[], str], logprobs: bool = False
    ) -> None:
        self._kind = kind
        self._model = model
        self._clock = clock
        self._logprobs = logprobs
        self.finished = False

    def render(self, chunk: inference_pb2.Chunk) -> list[Line]:
        part = chunk.WhichOneof("part")
        if part == "delta":
            entries = chunk.delta.logprobs if self._logprobs else ()
            if not chunk.delta.text and not entries:
                return []
            line = self._line(chunk.delta.text, done=False)
            if self._logprobs:
                line["logprobs"] = logprobs(entries)
            return [line]
        if part != "final":
            return []
        self.finished = True
        return [_finish(self._line("", done=True), chunk.final)]

    def _line(self, text: str, *, done: bool) -> Line:
        return _line(self._kind, model=self._model, created_at=self._clock(), text=text, done=done)


def answer(
    kind: Kind,
    collected: canonical.Answer,
    *,
    model: str,
    created_at: str,
    with_logprobs: bool = False,
) -> Line:
    """A whole generation as one object (`stream: false`)."""
    final = collected.finished()
    line = _line(kind, model=model, created_at=created_at, text=collected.text, done=True)
    if with_logprobs:
        line["logprobs"] = logprobs(collected.logprobs)
    return _finish(line, final)


def loaded(kind: Kind, *, model: str, created_at: str) -> Line:
    """The answer to a preload (see `is_load`)."""
    line = _line(kind, model=model, created_at=created_at, text="", done=True)
    line["done_reason"] = "load"
    return line


def embed_response(
    response: inference_pb2.EmbedResponse, *, model: str, dimensions: int | None
) -> protocol.EmbedResponse:
    """With `dimensions`, each embedding is cut to that many values and scaled to unit
    length again, as Ollama does; asking for more than the model has is refused."""
    vectors = []
    for embedding in response.embeddings:
        values = list(embedding.values)
        if dimensions is not None:
            if dimensions > len(values):
                raise _invalid(
                    f"'dimensions' {dimensions} is more than this model's {len(values)}.",
                    param="dimensions",
                )
            values = _unit(values[:dimensions])
        vectors.append(values)
    return {"model": model, "embeddings": vectors, "prompt_eval_count": response.prompt_tokens}


def _unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else values


def embeddings_response(response: inference_pb2.EmbedResponse) -> protocol.EmbeddingsResponse:
    """The one embedding; an empty prompt has none (Ollama answers an empty list)."""
    values = response.embeddings[0].values if response.embeddings else ()
    return {"embedding": list(values)}


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
        "capabilities": ["completion"],
        "modified_at": _modified_at(info),
    }


def ps(response: inference_pb2.ListModelsResponse, *, now: datetime) -> protocol.ProcessResponse:
    """One entry per Lane with a serving replica, under the Lane's name. Replicas share
    the file's pages, so `size` is the file's size once (KV caches not counted); Blazar
    does not report GPU offload here, so `size_vram` is 0. Lanes stay loaded, so they
    expire when Ollama's kept-forever models do."""
    expires_at = timestamp(now + _FOREVER)
    return {
        "models": [
            {
                "name": info.id,
                "model": info.id,
                "size": info.file.size_bytes,
                "digest": info.file.sha256,
                "details": _details(info),
                "expires_at": expires_at,
                "size_vram": 0,
                "context_length": info.context_length,
            }
            for info in response.models
            if info.id == info.lane and info.ready_replicas > 0
        ]
    }


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: protocol.ErrorBody
    headers: dict[str, str]


def error_response(err: errors.BlazarError) -> ErrorResponse:
    """Ollama's `{"error": "..."}` with the status every dialect shares."""
    return ErrorResponse(
        status=http_errors.http_status(err),
        body={"error": _error_message(err)},
        headers=http_errors.headers(err),
    )


def _error_message(err: errors.BlazarError) -> str:
    """The error's sentence, with a prompt that does not fit told in Ollama's terms
    (the daemon's says `max_tokens`, which is `options.num_predict` here)."""
    numbers = [err.metadata.get(k, "") for k in ("prompt_tokens", "max_tokens", "context_length")]
    if not isinstance(err, errors.ContextLengthExceeded) or not all(n.isdigit() for n in numbers):
        return err.message
    prompt, generate, context_length = map(int, numbers)
    return (
        f"This model's context is {context_length} tokens per request, but the request needs "
        f"{prompt + generate} ({prompt} in the prompt and {generate} to generate). Shorten "
        "the prompt, or lower options.num_predict."
    )
