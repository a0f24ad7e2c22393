"""OpenAI's wire format, with OpenAI's field names.

Request bodies refuse the top-level fields they do not know, naming them in OpenAI's
words (`_Body`); objects inside a body (messages, tools, content parts) ignore theirs,
as clients echo back fields of OpenAI's output there (an item's `id`, `status`).
Responses are TypedDicts because their JSON must match OpenAI byte for byte in shape:
some keys are present-but-null (`logprobs`, `finish_reason`), others absent
(`delta.role` after the first chunk), which a plain dict states most directly.
Reference: https://platform.openai.com/docs/api-reference/chat, /completions and
/embeddings (checked against the Stainless-generated types of the `openai` package).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from blazar.api.wire import INT32_MAX
from blazar.shim import validation

# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Body(validation.StrictBody):
    """A whole request body of Chat Completions, Completions or Embeddings: a field it
    does not declare is a 400 in OpenAI's words for these APIs (a null one passes)."""

    @classmethod
    def unknown_fields_message(cls, names: Sequence[str]) -> str:
        if len(names) == 1:
            return f"Unrecognized request argument supplied: {names[0]}"
        return f"Unrecognized request arguments supplied: {', '.join(names)}"


class ContentPart(_Request):
    """One part of a multi-part message; only `text` parts carry meaning here."""

    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    # JSON text of the arguments, as the model wrote them.
    arguments: str


class ToolCallParam(_Request):
    """A call an assistant message of the history made."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
    # "developer" is OpenAI's newer name for "system" on reasoning models.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Null is legal for assistant turns that only made tool calls.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    # Tool messages: the call this is the result of.
    tool_call_id: str | None = None
    # Assistant messages: what the model said in declining (OpenAI returns it in place
    # of content); part of the turn's text.
    refusal: str | None = None
    # Assistant messages: a previous audio answer, by id. Read only to refuse it (see
    # convert): this server keeps no audio to replay.
    audio: dict[str, Any] | None = None
    # Assistant messages: the deprecated form of a call. Read only to refuse it (see
    # convert), as the request's `functions` and `function_call` are.
    function_call: dict[str, Any] | None = None
    # Not in OpenAI's API: DeepSeek's and Mistral's, on the last message, an assistant
    # one: continue it (prefill) instead of answering after it (see convert).
    prefix: bool | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    # A JSON Schema object; absent means a function without parameters.
    parameters: dict[str, Any] | None = None
    # Blazar keeps the promise whatever this says: a forced call's arguments are
    # written under a grammar from the schema, an auto call's validated (see docs/tools.md).
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ObfuscationOption(_Request):
    """`stream_options` as the Responses API has it; Chat Completions' adds usage."""

    # Read only to refuse true (see convert): streamed chunks are not padded.
    include_obfuscation: bool | None = None


class StreamOptions(ObfuscationOption):
    include_usage: bool = False


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]
    # Not in OpenAI's API: llama.cpp's server (and llama-cpp-python's) constrain the
    # output to this JSON Schema, not just to any object. `schema` would shadow a
    # BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class JsonSchemaSpec(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Blazar always enforces the schema; `strict` is accepted and changes nothing.
    strict: bool | None = None


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]

# OpenAI: token id (as a JSON object key) -> bias in [-100, 100]; -100 bans the token.
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]


class _Sampling(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    # Not in OpenAI's API; llama.cpp's server accepts them under these names (vLLM
    # too, but for `repetition_penalty`).
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: LogitBias | None = None
    # Not in OpenAI's completions API, but vLLM and llama.cpp's server accept it there too.
    response_format: ResponseFormat | None = None
    # Not in OpenAI's API: llama.cpp's server takes a GBNF grammar, or a bare JSON schema,
    # on both endpoints. At most one constraint is accepted (see convert).
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Not in OpenAI's API: llama.cpp's server (and vLLM) generate past end-of-generation.
    ignore_eos: bool | None = None
    # Not in OpenAI's API: llama.cpp's server reuses the cached prefix of a prompt unless
    # this is false. Blazar always does, so true is what happens and false is refused.
    cache_prompt: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # Newer name for max_tokens; wins when both are sent.
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Default true, as OpenAI's.
    parallel_tool_calls: bool | None = None
    # Read only to refuse them (see convert): the older form of tools.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Read only to refuse them (see convert): output is text, generated token by token.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # Read only to refuse what Blazar cannot honour (see convert), or to use as the
    # session (prompt_cache_key, as OpenAI keys its prompt cache by it).
    reasoning_effort: str | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Not in OpenAI's API: vLLM's (and SGLang's) way to continue the final assistant
    # message, which goes with add_generation_prompt false (see convert).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Sampling):
    # A list is accepted only when it holds exactly one string; token arrays are read
    # only to refuse them (checked in convert).
    prompt: str | list[str] | list[int] | list[list[int]]
    # The legacy API's number of alternatives per token (OpenAI allows up to 5).
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    # Read only to refuse them (see convert): one candidate, no insertion.
    best_of: int | None = None
    suffix: str | None = None


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    # Token arrays are accepted by the schema only to be refused clearly in convert.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    user: str | None = None


# ---------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(TypedDict):
    """llama.cpp server's `timings` extension, which tools built on it read (OpenAI's
    clients keep unknown fields). `prompt_n` counts the prompt tokens computed, those
    reused from the cache are `cache_n`; `predicted_ms` spans the first to the last
    token, and the rates divide `predicted_n` by it, as llama.cpp's do.
    `draft_n`/`draft_n_accepted` only when tokens were drafted (speculation);
    `load_ms` (Blazar's) only when the request waited for its Lane to wake from
    idle.sleepAfter; `parked_ms` (Blazar's) only when it was parked for more urgent
    work (the pause, kept out of `predicted_ms`)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: NotRequired[int]
    draft_n_accepted: NotRequired[int]
    load_ms: NotRequired[float]
    parked_ms: NotRequired[float]


class FunctionDelta(TypedDict, total=False):
    name: str
    arguments: str


class ToolCallDelta(TypedDict):
    """Part of a streamed call. `id` and `type` only on a call's first delta: the
    official client joins the deltas of one index by concatenating their strings
    (but `index` and `type`)."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionDelta


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallDelta]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    # Present (null until the last chunk) only when stream_options.include_usage is set.
    usage: NotRequired[Usage | None]
    # On the chunk that carries the finish reason.
    timings: NotRequired[Timings]


class Function(TypedDict):
    name: str
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: Function


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    # Null when the message only made tool calls, as OpenAI's.
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class CompletionLogprobs(TypedDict):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    # Character offset of each token in the choice's text (continuing across chunks).
    text_offset: list[int]


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(TypedDict):
    """Both the non-streaming body and each streamed chunk (`object` is the same)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]
    # Always in a non-streaming body; streamed, on the chunk with the finish reason.
    timings: NotRequired[Timings]


class Embedding(TypedDict):
    object: Literal["embedding"]
    # A list of floats, or with encoding_format "base64" little-endian float32 bytes.
    embedding: list[float] | str
    index: int


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(TypedDict):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    error: ErrorDetail
