"""Anthropic's Messages API wire format, with Anthropic's field names.

A request's top level forbids fields it does not know, as Anthropic's API does: such a
field is a 400 in Anthropic's words (`<field>: Extra inputs are not permitted`), never
dropped (`validation.StrictBody`, as in the OpenAI dialect). Every top-level field of
Anthropic's Messages API (the `anthropic` package's `message_create_params.py` and its
beta twin) is declared, and those Blazar cannot honour are read only so that `convert`
refuses them by name. Objects below the top level still ignore fields they do not know.
A content block of a type Blazar does not take (an image, a document, a thinking block,
a server tool's result) is read as `OtherBlock` for the same reason: refused by its
type, never dropped. Responses are TypedDicts whose keys follow Anthropic's JSON.
Reference: the Messages, streaming, count_tokens and errors pages of Anthropic's API
documentation, checked against the Stainless-generated types of the `anthropic` package
(`types/message.py`, `raw_message_stream_event.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from blazar.api.wire import INT32_MAX
from blazar.shim import validation

# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# `cache_control` marks where Anthropic may cache a prefix. Blazar reuses any prefix its
# slot holds, marked or not, so the mark is accepted and asks for nothing more.
CacheControl = dict[str, Any] | None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    # Read only to refuse them (see convert): Blazar does not cite documents.
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Request):
    """A call an assistant turn of the history made."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    # Who made the call: the model (`{"type": "direct"}`, as when absent) or a code
    # execution tool. Read to refuse the latter (see convert).
    caller: dict[str, Any] | None = None


class OtherBlock(_Request):
    """A block of any type Blazar does not take; `convert` refuses it by its type."""

    type: str


def _block_tag(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in ("text", "tool_use", "tool_result") else "other"


# Without a tag pydantic would name its own discriminator function to the caller.
_UNTAGGED = "untagged_block"
_UNTAGGED_MESSAGE = (
    "a content block is an object whose 'type' says what it is (text, tool_use or "
    "tool_result; a tool result's content holds text blocks)"
)


def _result_tag(block: Any) -> str | None:
    tag = _block_tag(block)
    return None if tag is None else "text" if tag == "text" else "other"


# What a tool result may hold: text, or (refused by convert) images and the like.
ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_result_tag, custom_error_type=_UNTAGGED, custom_error_message=_UNTAGGED_MESSAGE),
]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag, custom_error_type=_UNTAGGED, custom_error_message=_UNTAGGED_MESSAGE),
]


class Message(_Request):
    # "system" turns are in the `anthropic` client's MessageParam beside the top-level
    # `system`; they become system turns of the conversation where they stand.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Request):
    name: str
    description: str | None = None
    # Required of client tools; server tools have none (and are refused by type).
    input_schema: dict[str, Any] | None = None
    # Absent or "custom" for a client tool; anything else names a server tool.
    type: str | None = None
    cache_control: CacheControl = None
    # Blazar keeps the promise whatever this says: a forced call's input is written
    # under a grammar from the schema, an auto call's validated (see docs/tools.md).
    strict: bool | None = None
    # Read only to refuse them (see convert).
    input_examples: list[Any] | None = None
    defer_loading: bool | None = None
    # Who may call the tool: "direct" (the model) or a code execution tool's version.
    # Read to refuse a tool the model may not call itself (see convert).
    allowed_callers: list[str] | None = None
    # Read only to refuse it (see convert): a call's input streams once it is whole.
    eager_input_streaming: bool | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    # `type: "tool"`: the tool to call.
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Request):
    # The end user's id: Blazar keys replica stickiness (the request's session) by it.
    user_id: str | None = None


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: JsonOutputFormat | None = None
    # Read only to refuse it (see convert).
    effort: str | None = None


class ContextEdit(_Request):
    # `clear_thinking_20251015`, `clear_tool_uses_20250919`, `compact_20260112`, ...
    type: str


class ContextManagement(_Request):
    edits: list[ContextEdit] | None = None


class Conversation(validation.StrictBody):
    """What `/v1/messages` and `/v1/messages/count_tokens` share: the prompt and tools.
    A top-level field it does not declare is a 400 in Anthropic's words, which are
    pydantic's (clients and proxies match on them)."""

    @classmethod
    def unknown_fields_message(cls, names: Sequence[str]) -> str:
        return "; ".join(f"{name}: Extra inputs are not permitted" for name in names)

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # The beta spelling of `output_config.format` (the `structured-outputs` beta).
    output_format: JsonOutputFormat | None = None
    cache_control: CacheControl = None
    # Read only to refuse them (see convert), save the values Blazar does as asked.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    context_management: ContextManagement | None = None
    speed: str | None = None
    compaction: dict[str, Any] | None = None
    # Who is billed: Blazar bills nobody, which `bill_to: "self"` (the default) accepts.
    billing_policy: dict[str, Any] | None = None


class MessagesRequest(Conversation):
    # Required, as in Anthropic's API; 0 pre-warms the cache: the prompt is prefilled
    # and nothing is written (`convert.requests.PREWARM_TOKENS`).
    max_tokens: int = Field(ge=0, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    # Anthropic's ranges.
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    stream: bool | None = None
    service_tier: str | None = None
    # Read only to refuse them (see convert).
    container: str | dict[str, Any] | None = None
    # Where inference runs: "global" (anywhere, the default) is taken; Blazar runs on
    # this host and knows no region to promise.
    inference_geo: str | None = None
    # Server-held conversation state (the `anthropic` client's message threads, which
    # its tool runner uses by default) and server-side summarizing: Blazar keeps no
    # conversation between requests and summarizes none.
    # Any shape: whatever it holds, the refusal carries the code the client acts on.
    thread: Any = None
    # Asks for `diagnostics.cache_miss_reason` against an earlier response, and (beta)
    # other models to try when this one declines: Blazar gives neither.
    diagnostics: dict[str, Any] | None = None
    fallbacks: Any = None
    # Redeems a refusal's credit on a retry: Blazar neither refuses so nor bills.
    fallback_credit_token: Any = None


class CountTokensRequest(Conversation):
    pass


# ---------------------------------------------------------------- responses

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class TextContent(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseContent(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


Content = TextContent | ToolUseContent


class Usage(TypedDict):
    """`input_tokens` are those prefilled; with the ones read from the cache they make
    the prompt (Anthropic's total is the sum of the three counts)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class MessageResponse(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Content]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str


class MessageStart(TypedDict):
    type: Literal["message_start"]
    message: MessageResponse


class ContentBlockStart(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: Content


class Ping(TypedDict):
    type: Literal["ping"]


class ContentBlockDelta(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(TypedDict):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(TypedDict):
    type: Literal["message_delta"]
    delta: StopDelta
    # Cumulative: the whole usage, now that the prompt's counts are known.
    usage: Usage


class MessageStop(TypedDict):
    type: Literal["message_stop"]


class ErrorDetail(TypedDict):
    type: str
    message: str
    # Machine-readable details some errors carry (`error_code`, ...), as Anthropic's do.
    details: NotRequired[dict[str, Any]]


class ErrorBody(TypedDict):
    type: Literal["error"]
    error: ErrorDetail
    request_id: NotRequired[str]


Event = (
    MessageStart
    | ContentBlockStart
    | Ping
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | ErrorBody
)


class TokenCount(TypedDict):
    input_tokens: int


class ModelInfo(TypedDict):
    """An entry of Anthropic's Models API."""

    type: Literal["model"]
    id: str
    display_name: str
    created_at: str  # RFC 3339


class ModelList(TypedDict):
    data: list[ModelInfo]
    first_id: str | None
    last_id: str | None
    has_more: bool
