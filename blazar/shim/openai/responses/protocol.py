"""The Responses API's wire format (`POST /v1/responses`), with OpenAI's field names.

As in the Chat Completions models (`blazar.shim.openai.protocol`), a request body
refuses the top-level fields it does not know (`validation.StrictBody`, in this API's
words: "Unknown parameter: 'foo'."), the objects inside it ignore theirs, and
responses are TypedDicts.
Fields OpenAI defines that a stateless server without built-in tools cannot honour
(`store: true`, `previous_response_id`, `conversation`, `background`, `reasoning`,
`truncation: "auto"`, ...) are read only to be refused by name (see `requests`).
Input items, tools and content parts are read loosely (`type` as any string) so that
an unsupported kind is refused naming its place and type, not as a union mismatch.
Reference: https://platform.openai.com/docs/api-reference/responses and its streaming
events, checked against the `openai` package's `types/responses` models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from blazar.api.wire import INT32_MAX
from blazar.shim import validation
from blazar.shim.openai import protocol as chat

# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ContentPart(_Request):
    """A part of a message's content; `input_text` and `output_text` carry text, and
    an assistant message's `refusal` (an earlier answer's) its refusal."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(_Request):
    """One item of `input`: a message (`type` "message" or absent), a `function_call`
    the model made earlier, or a `function_call_output` answering one."""

    type: str | None = None
    # Messages.
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    # Function calls and their outputs.
    call_id: str | None = None
    name: str | None = None
    # JSON text of the arguments, as the model wrote them.
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class Tool(_Request):
    """A tool the model may call; only `function` tools can be served (the built-in
    ones, web and file search, computer use, MCP, ..., need OpenAI's servers)."""

    type: str
    name: str | None = None
    description: str | None = None
    # A JSON Schema object; absent means a function without parameters.
    parameters: dict[str, Any] | None = None
    # Blazar keeps the promise whatever this says: a forced call's arguments are
    # written under a grammar from the schema, an auto call's validated.
    strict: bool | None = None


class ToolChoiceObject(_Request):
    """`{"type": "function", "name": ...}` forces that function; other types (hosted
    tools, `allowed_tools`, MCP, custom) are read only to be refused."""

    type: str
    name: str | None = None


class JsonSchemaFormat(_Request):
    """`text.format` for structured output: flat, unlike Chat Completions'
    `response_format.json_schema`."""

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    # Blazar always enforces the schema; `strict` is accepted and changes nothing.
    strict: bool | None = None


TextFormat = Annotated[
    chat.TextFormat | chat.JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class TextConfig(_Request):
    format: TextFormat | None = None
    # Read only to refuse it: a model without that control cannot honour it.
    verbosity: str | None = None


class Reasoning(_Request):
    """Read only to refuse it: the engine's models write no reasoning items."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class ResponseCreateRequest(validation.StrictBody):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    # The system prompt, ahead of `input`.
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    # Default true, as OpenAI's.
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # With `include: ["message.output_text.logprobs"]`: alternatives per token.
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = False
    # Read only to refuse what Blazar cannot honour (see requests): events are not padded.
    stream_options: chat.ObfuscationOption | None = None
    # Echoed in the response.
    metadata: Metadata | None = None
    # End-user identifiers; the first sent of these keys the session (replica
    # stickiness, so prefix reuse), as `user` does in Chat Completions.
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Not in OpenAI's Responses API: llama.cpp's server passes its chat fields
    # through on /v1/responses, and Blazar's Chat Completions takes these names.
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stop: str | list[str] | None = None
    cache_prompt: bool | None = None
    # Read only to refuse them (see requests): Blazar's Chat Completions takes these
    # constraints (llama.cpp's names); here `text.format` is the one.
    grammar: str | None = None
    json_schema: Any = None
    # Read only to refuse them (see requests): each needs state, a tool or a model
    # feature this server does not have.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: Any = None


class InputTokensRequest(validation.StrictBody):
    """`POST /v1/responses/input_tokens`: the fields of a response request that make its
    prompt, counted as `POST /v1/responses` would render it. OpenAI lets `model` and
    `input` be absent; Blazar needs the model to count with its tokenizer."""

    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # Read only to refuse them, as on `POST /v1/responses`.
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    personality: str | None = None


# ---------------------------------------------------------------- responses

Status = Literal["completed", "incomplete", "in_progress", "failed"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    # One entry per token, with `include: ["message.output_text.logprobs"]`.
    logprobs: list[chat.TokenLogprob]


class OutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCall(TypedDict):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    # JSON text of the arguments; always a whole document.
    arguments: str


OutputItem = OutputMessage | FunctionCall


class FunctionToolEcho(TypedDict):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class NamedFunction(TypedDict):
    type: Literal["function"]
    name: str


class TextFormatEcho(TypedDict):
    type: Literal["text", "json_object", "json_schema"]
    name: NotRequired[str]
    schema: NotRequired[dict[str, Any]]
    description: NotRequired[str | None]
    strict: NotRequired[bool | None]


class TextEcho(TypedDict):
    format: TextFormatEcho


class InputTokensDetails(TypedDict):
    cached_tokens: int
    # Always 0: the prefix cache is implicit (prompts stay in their slot as they are
    # prefilled), with no cache write to account for, as OpenAI's implicit mode.
    cache_write_tokens: int


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class Usage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class ResponseError(TypedDict):
    code: str
    message: str


class Response(TypedDict):
    """The `response` object: the whole body without streaming, and the snapshot
    that lifecycle events carry."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: dict[str, None]
    # Nothing is kept after the response is sent.
    store: Literal[False]
    temperature: float | None
    text: TextEcho
    tool_choice: str | NamedFunction
    tools: list[FunctionToolEcho]
    top_logprobs: int | None
    top_p: float | None
    truncation: Literal["disabled"]
    usage: Usage | None
    user: str | None
    # Echoed as sent, as OpenAI's response does.
    prompt_cache_key: str | None
    safety_identifier: str | None
    prompt_cache_retention: str | None
    # The tier that served it: this server has one.
    service_tier: Literal["default"]
    metadata: dict[str, str]
    background: Literal[False]
    # Blazar's extension, as on Chat Completions (llama.cpp server's figures).
    timings: NotRequired[chat.Timings]


class Event(TypedDict):
    """One streamed event; its `type` is also the SSE `event:` line. The keys past
    `type` and `sequence_number` depend on the type (OpenAI's streaming events)."""

    type: str
    sequence_number: int
    response: NotRequired[Response]
    output_index: NotRequired[int]
    item: NotRequired[OutputItem]
    item_id: NotRequired[str]
    content_index: NotRequired[int]
    part: NotRequired[OutputText]
    delta: NotRequired[str]
    text: NotRequired[str]
    logprobs: NotRequired[list[chat.TokenLogprob]]
    arguments: NotRequired[str]
    name: NotRequired[str]
    # The `error` event.
    code: NotRequired[str | None]
    message: NotRequired[str]
    param: NotRequired[str | None]


class InputTokenCount(TypedDict):
    """What `POST /v1/responses/input_tokens` answers."""

    object: Literal["response.input_tokens"]
    input_tokens: int
