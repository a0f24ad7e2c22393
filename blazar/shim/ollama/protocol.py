"""Ollama's wire format, with Ollama's field names.

A request body refuses the top-level fields it does not know (`validation.StrictBody`,
as in the OpenAI and Anthropic dialects): Ollama's Go server ignores them, but there
they do nothing either, so a client that sends `num_ctx` beside `options` instead of in
it, or a newer Ollama field Blazar does not implement, learns it at once from a 400
naming every such field. Every top-level field of Ollama's requests for the routes
Blazar serves is declared, and those Blazar cannot honour are read only so that
`convert` (or `listing`) refuses them by name. Objects below the top level (messages,
tools) still ignore fields they do not know. `options` is read as an open mapping for
the same reason: an option Blazar does not support is refused, not dropped. Responses
are TypedDicts whose keys follow Ollama's JSON. Reference: ollama/ollama `api/types.go`
and `server/routes.go`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from blazar.api.wire import INT32_MAX
from blazar.shim import validation
from blazar.shim.ollama import options

# The Ollama release whose API this dialect follows, which `/api/version` answers:
# clients read that as Ollama's version to decide what the server can do (GitHub
# Copilot's Ollama provider refuses a server older than 0.6.4; others gate tools on
# 0.3.0), so Blazar's own version there would read as an Ollama too old to use. What
# Ollama's API has up to this release is served or refused by name; 0.12.11 brought
# `logprobs` and `top_logprobs`, the latest fields read here.
API_VERSION = "0.12.11"

# ---------------------------------------------------------------- requests


def _without_nulls(data: Any) -> Any:
    """Go decodes a JSON `null` into a field as its zero value, the same as leaving the
    field out, so Ollama reads `"content": null` as "", `"prompt": null` as no prompt (a
    preload) and `"messages": null` as none (Go's client sends that for an unset slice).
    So does Blazar: a null field takes its default, as if absent, known or not."""
    if isinstance(data, dict):
        return {name: value for name, value in data.items() if value is not None}
    return data


class _Request(BaseModel):
    """An object inside a request body: fields it does not know are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return _without_nulls(data)


class _Body(validation.StrictBody):
    """A whole request body: a top-level field it does not declare is a 400 naming it
    (and every other one), where Ollama's server would drop it unread."""

    # The route whose body this is, for the error's words.
    route: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Overrides StrictBody's (nulls of unknown fields only): every null is absent.
        return _without_nulls(data)

    @classmethod
    def unknown_fields_message(cls, names: Sequence[str]) -> str:
        quoted = ", ".join(f"'{name}'" for name in names)
        plural = "s" if len(names) > 1 else ""
        message = (
            f"Unknown field{plural} {quoted} in the body of {cls.route}: Blazar refuses "
            "the fields it does not know rather than ignore them."
        )
        misplaced = [name for name in names if options.is_option(name)]
        if misplaced:
            which = ", ".join(f"'{name}'" for name in misplaced)
            if len(misplaced) == 1:
                message += f" {which} is a model option: send it inside 'options'."
            else:
                message += f" {which} are model options: send them inside 'options'."
        if len(misplaced) < len(names):
            message += " Leave the others out." if misplaced else " Leave them out."
        return message


# Ollama's `keep_alive`: seconds as a number, or a Go duration such as "5m" or "-1h".
# A boolean is read only so that `convert` refuses it saying what would do.
KeepAlive = str | float | bool | None

# `format`: "json", a JSON schema, or empty for free text.
Format = str | dict[str, Any] | None

# `think`: true/false, or an effort ("high", "medium", "low") for models that take one.
Think = bool | str | None


class ToolCallFunction(_Request):
    name: str
    # A JSON object, not JSON text as in OpenAI's API; null or absent is no arguments.
    arguments: dict[str, Any] | None = None
    # Which call of its turn it was; the list's order says the same, so it is not read.
    index: int | None = None


class ToolCall(_Request):
    """A call an assistant message of the history made."""

    # Ollama's server names its calls; its Python client does not send the id back.
    id: str | None = None
    function: ToolCallFunction


class Message(_Request):
    # Ollama lowercases roles; `convert` does too and refuses the ones it cannot take.
    role: str
    content: str = ""
    # Assistant messages: the calls the model made.
    tool_calls: list[ToolCall] | None = None
    # Tool messages: the tool that answered, and the call it answers when the client
    # kept the call's id.
    tool_name: str | None = None
    tool_call_id: str | None = None
    # Read only to refuse them (see convert).
    images: list[str] | None = None
    thinking: str | None = None


class ToolFunction(_Request):
    name: str
    description: str | None = None
    # A JSON Schema object; absent means a function without parameters.
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    # Ollama's only kind of tool; its Python client sends it, Go's server does not check.
    type: str = "function"
    function: ToolFunction


class _Generation(_Body):
    model: str = Field(min_length=1)
    # Ollama streams unless told not to.
    stream: bool | None = None
    format: Format = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    think: Think = None
    # Read only to refuse `true` (see convert): Blazar never cuts a prompt short.
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Read only to refuse `true` (see convert): Blazar does not answer with the
    # rendered template instead of generating.
    debug_render_only: bool | None = Field(default=None, alias="_debug_render_only")


class ChatRequest(_Generation):
    route = "/api/chat"
    # Empty: load the model and answer at once (Ollama's preload).
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Generation):
    route = "/api/generate"
    # Empty: load the model and answer at once (Ollama's preload).
    prompt: str = ""
    system: str | None = None
    raw: bool | None = None
    # Read only to refuse them (see convert).
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None
    # Ollama's generate has no tools (its server ignores them): refused, not dropped.
    tools: list[Any] | None = None
    # Image generation (the `ollama` client's `width`, `height`, `steps`): refused.
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class EmbedRequest(_Body):
    route = "/api/embed"

    model: str = Field(min_length=1)
    # Empty or absent: nothing to embed, Ollama's preload (the `ollama` client sends "").
    input: str | list[str] = ""
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(_Body):
    """The older `/api/embeddings`: one prompt, an embedding that is not normalized."""

    route = "/api/embeddings"

    model: str = Field(min_length=1)
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ShowRequest(_Body):
    route = "/api/show"

    # `name` is the older spelling of `model`.
    model: str | None = None
    name: str | None = None
    verbose: bool | None = None
    # Read only to refuse them when set (see listing): Ollama shows the model as if
    # they were in its Modelfile. Go's client sends "" and null for them unset.
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None


# ---------------------------------------------------------------- responses

DoneReason = Literal["stop", "length", "load", "unload"]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class Logprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: NotRequired[list[TopLogprob]]


class FunctionCall(TypedDict):
    # The call's place in its turn (0, 1, ...).
    index: int
    name: str
    # A JSON object, never text.
    arguments: dict[str, Any]


class CallMade(TypedDict):
    """A call the model made, whole: Ollama sends no fragments of one."""

    id: str
    function: FunctionCall


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str
    tool_calls: NotRequired[list[CallMade]]


class _Statistics(TypedDict):
    """The final object's figures: nanoseconds, and token counts."""

    done_reason: NotRequired[DoneReason]
    total_duration: NotRequired[int]
    load_duration: NotRequired[int]
    prompt_eval_count: NotRequired[int]
    prompt_eval_duration: NotRequired[int]
    eval_count: NotRequired[int]
    eval_duration: NotRequired[int]


class ChatResponse(_Statistics):
    """A streamed line, or the whole answer; the final one carries the statistics."""

    model: str
    created_at: str
    message: AssistantMessage
    done: bool
    logprobs: NotRequired[list[Logprob]]


class GenerateResponse(_Statistics):
    model: str
    created_at: str
    response: str
    done: bool
    logprobs: NotRequired[list[Logprob]]


class Metrics(TypedDict):
    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class EmbedResponse(TypedDict):
    model: str
    embeddings: list[list[float]]
    # Nanoseconds from the request's arrival at the shim to its answer.
    total_duration: int
    prompt_eval_count: int


class EmbeddingsResponse(TypedDict):
    embedding: list[float]


class ModelDetails(TypedDict):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(TypedDict):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ListResponse(TypedDict):
    models: list[ListedModel]


class ShowResponse(TypedDict):
    modelfile: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class RunningModel(TypedDict):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(TypedDict):
    models: list[RunningModel]


class VersionResponse(TypedDict):
    version: str


class ErrorBody(TypedDict):
    error: str
