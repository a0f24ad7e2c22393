"""OpenAI request bodies into the canonical `blazar.v1` requests.

Pure: no IO, no clock, no logging. `chat_request` and `complete_request` build proto
requests, setting in `Sampling` only what the client sent; `embed_request` the
embeddings one. What the canonical request cannot carry is refused by name
(`envelope.invalid`), never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from blazar._proto.v1 import inference_pb2
from blazar.api import sessions, wire
from blazar.shim import canonical
from blazar.shim.openai import protocol
from blazar.shim.openai.convert import envelope

_ROLES = {"developer": "system"}
# Roles whose messages OpenAI refuses without content. Its assistant turns may omit
# content when they carry tool_calls; one with neither is still taken here, as an
# empty turn.
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})
# OpenAI's legacy completions endpoint stops after 16 tokens when `max_tokens` is
# unset or null (vLLM does the same); chat has no such default and runs until the
# context is full.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def chat_request(
    body: protocol.ChatCompletionRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.ChatRequest:
    """The canonical request; `session` (the `x-blazar-session` header) keys replica
    stickiness, else the body's `user`, OpenAI's end-user id; `slo` (the `x-blazar-slo`
    header) names the SLOPolicy, else the Lane's applies."""
    _require_single_choice(body)
    _require_stream_for_options(body)
    refuse_uncached(body.cache_prompt)
    _refuse_functions(body)
    _refuse_non_text_output(body)
    _refuse_unhonoured(body)
    _require_content(body.messages)
    messages = [_message(message, i) for i, message in enumerate(body.messages)]
    _require_earlier_calls(messages)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    sampling = _sampling(body, max_tokens=max_tokens)
    if body.top_logprobs and not body.logprobs:
        raise envelope.invalid("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    if body.logprobs:
        sampling.logprobs = True
        sampling.top_logprobs = body.top_logprobs or 0
    request = inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        constraint=_constraint(body),
        session=session
        or sessions.of_field(body.prompt_cache_key or body.user or body.safety_identifier),
        slo=slo,
        tools=[_tool(t) for t in body.tools or ()],
        tool_choice=_tool_choice(body),
    )
    request.continue_final_message = _continues(body, messages, request)
    if body.parallel_tool_calls is not None:
        if not body.tools:
            # As OpenAI answers it: with no tools it would say nothing of any call.
            raise envelope.invalid(
                "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only "
                "allowed when 'tools' are specified.",
                param="parallel_tool_calls",
            )
        request.parallel_tool_calls = body.parallel_tool_calls
    one_call_when_named(request)
    return request


def _continues(
    body: protocol.ChatCompletionRequest,
    messages: Sequence[inference_pb2.Message],
    request: inference_pb2.ChatRequest,
) -> bool:
    """Whether the final assistant message is continued (prefill) rather than answered
    after, as OpenAI's API does: only when the request asks, by DeepSeek's and
    Mistral's `prefix: true` on it or vLLM's `continue_final_message` (with
    `add_generation_prompt` false, or unset). A continuation with what would shape a
    turn the prefill already began (a response format or grammar, a forced call) is
    refused, as is a final message that made calls."""
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        if message.prefix and (i != last or message.role != "assistant"):
            raise envelope.invalid(
                f"'messages[{i}].prefix' true goes only on the last message, an assistant "
                "one: the one to continue.",
                param=f"messages[{i}].prefix",
            )
    asked = bool(body.continue_final_message)
    if asked and body.add_generation_prompt:
        # vLLM's refusal: a new generation prompt would close the message to continue.
        raise envelope.invalid(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
            param="add_generation_prompt",
        )
    continues = asked or bool(body.messages[last].prefix)
    if body.add_generation_prompt is False and not continues:
        raise envelope.invalid(
            "'add_generation_prompt' false is supported only with 'continue_final_message' "
            "true: a conversation without it ends with a generation prompt.",
            param="add_generation_prompt",
        )
    if not continues:
        return False
    param = "continue_final_message" if asked else f"messages[{last}].prefix"
    if body.messages[last].role != "assistant":
        raise envelope.invalid(
            f"'{param}' continues the final message, which must be an assistant one; "
            f"messages[{last}] is a {body.messages[last].role} message.",
            param=param,
        )
    if messages[-1].tool_calls:
        raise envelope.invalid(
            f"'{param}' continues the final message, and messages[{last}] makes tool calls, "
            "which end its turn: send their results, or a final message of text only.",
            param=param,
        )
    if request.constraint.WhichOneof("kind") is not None:
        raise envelope.invalid(
            f"'{param}' continues the final assistant message, and a response format or "
            "grammar would shape only the continuation, not the answer the message "
            "began: send one or the other.",
            param=param,
        )
    mode = request.tool_choice.mode
    if mode in (inference_pb2.ToolChoice.MODE_REQUIRED, inference_pb2.ToolChoice.MODE_NAMED):
        raise envelope.invalid(
            f"'{param}' continues the final assistant message, which a forced tool call "
            "(tool_choice required or a named function) cannot: its turn holds calls only. "
            "Send one or the other.",
            param="tool_choice",
        )
    return True


def one_call_when_named(request: inference_pb2.ChatRequest) -> None:
    """OpenAI's named `tool_choice` (either API) is "call exactly one specific function"
    (its function-calling guide), whatever `parallel_tool_calls` says: extraction
    libraries (Instructor, LangChain) read the one call. Left to the 1 to 8 calls of
    a parallel turn, the bundled model wrote all 8, past their `max_tokens`."""
    if request.tool_choice.mode == inference_pb2.ToolChoice.MODE_NAMED:
        request.parallel_tool_calls = False


def _message(message: protocol.ChatMessage, i: int) -> inference_pb2.Message:
    if message.role == "tool" and not message.tool_call_id:
        raise envelope.invalid(
            f"Missing required parameter: 'messages[{i}].tool_call_id' (a tool message "
            "answers a call).",
            param=f"messages[{i}].tool_call_id",
        )
    if message.tool_calls and message.role != "assistant":
        raise envelope.invalid(
            f"Only assistant messages carry 'tool_calls'; message {i} is a {message.role} one.",
            param=f"messages[{i}].tool_calls",
        )
    if message.function_call is not None:
        raise envelope.invalid(
            f"'messages[{i}].function_call' (deprecated by OpenAI) is not supported by this "
            "server; send the call in 'tool_calls', and its result as a 'tool' message.",
            param=f"messages[{i}].function_call",
        )
    if message.audio is not None:
        raise envelope.invalid(
            f"'messages[{i}].audio' is not supported: this server keeps no audio answers "
            "to replay; send the turn's transcript as its 'content'.",
            param=f"messages[{i}].audio",
        )
    content = _flatten(message.content, param=f"messages[{i}].content")
    if message.refusal and message.role == "assistant":
        # OpenAI's answer in place of content: the model said it, so the turn holds it.
        content = "\n".join(text for text in (content, message.refusal) if text)
    return inference_pb2.Message(
        role=_ROLES.get(message.role, message.role),
        content=content,
        tool_calls=[
            inference_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or ()
        ],
        tool_call_id=message.tool_call_id or "",
        # A tool message's name is the tool's; other roles' are participants'.
        name=message.name or "",
    )


def _require_earlier_calls(messages: Sequence[inference_pb2.Message]) -> None:
    """A tool message answers a call an assistant turn made before it, as OpenAI
    insists: a result whose `tool_call_id` matches no call is an app's bug (an id
    mistyped, a history trimmed of its call), not a turn to show the model."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise envelope.invalid(
                f"Invalid parameter: 'messages[{i}].tool_call_id' {message.tool_call_id!r} "
                "matches no call in the 'tool_calls' of an earlier assistant message; a tool "
                "message answers a call made before it.",
                param=f"messages[{i}].tool_call_id",
            )


def _tool(tool: protocol.FunctionTool) -> inference_pb2.Tool:
    function = tool.function
    parameters = function.parameters
    return inference_pb2.Tool(
        name=function.name,
        description=function.description or "",
        parameters="" if parameters is None else canonical.json_text(parameters),
    )


Named = TypeVar("Named")
_CHOICES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "none": inference_pb2.ToolChoice.MODE_NONE,
    "required": inference_pb2.ToolChoice.MODE_REQUIRED,
}


def tool_choice(
    choice: str | Named | None, *, has_tools: bool, name_of: Callable[[Named], str]
) -> inference_pb2.ToolChoice | None:
    """OpenAI's `tool_choice` in either API: None (unset) is OpenAI's default, and
    Blazar's ("auto" when there are tools); a mode by name; or a named tool, whose name
    `name_of` reads (and checks) in that API's own shape."""
    if choice is None:
        return None
    if not has_tools and choice != "none":
        raise envelope.invalid(
            "'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
        )
    if isinstance(choice, str):
        return inference_pb2.ToolChoice(mode=_CHOICES[choice])
    return inference_pb2.ToolChoice(mode=inference_pb2.ToolChoice.MODE_NAMED, name=name_of(choice))


def _tool_choice(body: protocol.ChatCompletionRequest) -> inference_pb2.ToolChoice | None:
    return tool_choice(
        body.tool_choice, has_tools=bool(body.tools), name_of=lambda c: c.function.name
    )


def complete_request(
    body: protocol.CompletionRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.CompleteRequest:
    """The canonical request; `session` and `slo` as for `chat_request`."""
    _require_single_choice(body)
    _require_stream_for_options(body)
    refuse_uncached(body.cache_prompt)
    _refuse_best_of_and_suffix(body)
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif not all(isinstance(item, str) for item in body.prompt):
        raise envelope.invalid(
            "'prompt' must be a string or a list of one string; token arrays are not "
            "supported. Send the text.",
            param="prompt",
        )
    elif len(body.prompt) == 1 and isinstance(body.prompt[0], str):
        prompt = body.prompt[0]
    else:
        raise envelope.invalid(
            f"'prompt' must be a string or a list of exactly one string; got a list of "
            f"{len(body.prompt)}. Send one request per prompt.",
            param="prompt",
        )
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    sampling = _sampling(body, max_tokens=max_tokens)
    if body.logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = body.logprobs
        if body.echo:
            if body.stream:
                raise envelope.invalid(
                    "'echo' with 'logprobs' is not supported when streaming; the prompt's "
                    "log-probabilities only arrive at the end.",
                    param="echo",
                )
            sampling.prompt_logprobs = True
    return inference_pb2.CompleteRequest(
        model=body.model,
        prompt=prompt,
        sampling=sampling,
        constraint=_constraint(body),
        session=session or sessions.of_field(body.user),
        slo=slo,
    )


def prompt_text(body: protocol.CompletionRequest) -> str:
    """The one prompt string of a request `complete_request` accepted."""
    first = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    assert isinstance(first, str), "complete_request refuses token arrays"
    return first


def embed_request(body: protocol.EmbeddingRequest) -> inference_pb2.EmbedRequest:
    """OpenAI's embeddings are unit length, so Blazar's are normalized too; `dimensions`
    keeps the first values (the engine checks the model has that many)."""
    if isinstance(body.input, str):
        inputs = [body.input]
    elif all(isinstance(item, str) for item in body.input):
        inputs = [item for item in body.input if isinstance(item, str)]
    else:
        # LangChain's OpenAIEmbeddings sends ids of OpenAI's tokenizer (tiktoken) by
        # default, which name other tokens in this model's vocabulary: embedding them
        # would answer for a text nobody sent. Say how to send the text instead.
        raise envelope.invalid(
            "'input' must be a string or a list of strings; token arrays are not supported "
            "(ids of another tokenizer would embed a different text). Send the text: with "
            "LangChain's OpenAIEmbeddings, set check_embedding_ctx_length=False.",
            param="input",
        )
    if not inputs:
        raise envelope.invalid("'input' must not be an empty list.", param="input")
    for i, text in enumerate(inputs):
        if not text:
            param = "input" if isinstance(body.input, str) else f"input[{i}]"
            raise envelope.invalid(f"'{param}' must not be empty.", param=param)
    return inference_pb2.EmbedRequest(
        model=body.model, inputs=inputs, normalize=True, dimensions=body.dimensions
    )


def _constraint(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> inference_pb2.Constraint | None:
    """OpenAI's `response_format`, or llama.cpp's `grammar` or `json_schema`: one of them."""
    given = _constraints(body)
    named = list(given)
    if len(named) > 1:
        raise envelope.invalid(
            f"Send one of 'response_format', 'grammar' and 'json_schema'; got "
            f"'{named[0]}' and '{named[1]}'.",
            param=named[1],
        )
    return given[named[0]] if named else None


def blame_of(body: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> envelope.Blame:
    """The parameters errors about this request's prompt and constraint blame."""
    constraint = next(iter(_constraints(body)), "response_format")
    prompt = "prompt" if isinstance(body, protocol.CompletionRequest) else "messages"
    return envelope.Blame(prompt=prompt, constraint=constraint)


def _constraints(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> dict[str, inference_pb2.Constraint]:
    """The constraints the request sends, by parameter. An empty grammar constrains
    nothing, as in llama.cpp; nor does a `text` response format."""
    schema = body.json_schema
    given = {
        "response_format": _format_constraint(body.response_format),
        "grammar": inference_pb2.Constraint(grammar=body.grammar) if body.grammar else None,
        "json_schema": None if schema is None else canonical.json_schema(schema),
    }
    return {name: constraint for name, constraint in given.items() if constraint is not None}


def _format_constraint(fmt: protocol.ResponseFormat | None) -> inference_pb2.Constraint | None:
    if isinstance(fmt, protocol.JsonObjectFormat):
        return json_object(fmt)
    if isinstance(fmt, protocol.JsonSchemaFormat):
        schema = fmt.json_schema.json_schema
        if schema is None:
            return canonical.json_object()
        return canonical.json_schema(schema)
    return None


def json_object(fmt: protocol.JsonObjectFormat) -> inference_pb2.Constraint:
    """`json_object`: any JSON object, or with llama.cpp's `schema` beside the type, one
    valid against that schema (as llama.cpp's server reads it, never dropped)."""
    if fmt.json_schema is None:
        return canonical.json_object()
    return canonical.json_schema(fmt.json_schema)


def _require_single_choice(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> None:
    if body.n is not None and body.n != 1:
        raise envelope.invalid(f"Only n=1 is supported; got n={body.n}.", param="n")


def _require_stream_for_options(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
) -> None:
    """OpenAI refuses `stream_options` on a request that does not stream."""
    if body.stream_options is not None and not body.stream:
        raise envelope.invalid(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    refuse_obfuscation(body.stream_options)


def refuse_uncached(cache_prompt: bool | None) -> None:
    """llama.cpp's `cache_prompt`: true (its default) is what Blazar always does, reuse
    the longest cached prefix of the prompt; false asks for a prefill from scratch,
    which the engine has no way to do."""
    if cache_prompt is False:
        raise envelope.invalid(
            "'cache_prompt' false is not supported: this server always reuses the cached "
            "prefix of a prompt. Send true or omit it.",
            param="cache_prompt",
        )


def refuse_obfuscation(options: protocol.ObfuscationOption | None) -> None:
    """Chat Completions' and the Responses API's `stream_options.include_obfuscation`
    pads each chunk (or event) against size side channels; Blazar's are not padded, so
    asking for it is refused (its default, on at OpenAI, is off here)."""
    if options is not None and options.include_obfuscation:
        raise envelope.invalid(
            "Stream obfuscation is not supported by this server: streamed chunks are not "
            "padded. Send 'include_obfuscation' false or omit it, and serve over TLS "
            "(--tls-cert) on links you do not trust.",
            param="stream_options.include_obfuscation",
        )


def _refuse_best_of_and_suffix(body: protocol.CompletionRequest) -> None:
    """As with `n`, ignoring these would pass off a different answer as the one asked for."""
    if body.best_of is not None and body.best_of != 1:
        raise envelope.invalid(
            f"Only best_of=1 is supported; got best_of={body.best_of}.", param="best_of"
        )
    if body.suffix:
        raise envelope.invalid(
            "'suffix' is not supported by this server: completions only continue the prompt.",
            param="suffix",
        )


def _refuse_non_text_output(body: protocol.ChatCompletionRequest) -> None:
    """Blazar generates text only, token by token, with no predicted-output path."""
    if body.modalities is not None and body.modalities != ["text"]:
        raise envelope.invalid(
            f"Only text output is supported; 'modalities' must be [\"text\"], got "
            f"{json.dumps(body.modalities)}.",
            param="modalities",
        )
    if body.audio is not None:
        raise envelope.invalid("Audio output is not supported by this server.", param="audio")
    if body.prediction is not None:
        raise envelope.invalid(
            "Predicted outputs ('prediction') are not supported by this server.",
            param="prediction",
        )


# Chat Completions' and the Responses API's `moderation`: a request asking to have its
# input or output scored or blocked must not get an unmoderated answer as if it had.
MODERATION_REFUSED = (
    "moderation is not run by this server: nothing would score or block the input or "
    "the output. Moderate them yourself, and omit 'moderation'"
)


def refuse_prompt_cache(retention: str | None, options: dict[str, Any] | None) -> None:
    """Refuse Chat Completions' and the Responses API's prompt-cache controls that this
    server cannot honour; pass those that ask for what it does. Its cache is implicit,
    in memory and per tenant, kept while a slot holds it: no retention or minimum
    lifetime is promised, and there are no explicit breakpoints."""
    if retention not in (None, "in_memory"):
        raise envelope.invalid(
            f"'prompt_cache_retention' {retention!r} is not supported: prompts are cached "
            'in memory only, while an engine\'s slot holds them; send "in_memory" or omit it.',
            param="prompt_cache_retention",
        )
    for key, value in (options or {}).items():
        if key == "mode" and value in (None, "implicit"):
            continue
        raise envelope.invalid(
            f"'prompt_cache_options.{key}' is not supported: the prompt cache is implicit "
            "(every prompt's prefix is reused while an engine's slot holds it), with no "
            'breakpoints and no promised lifetime; omit it, or send mode "implicit".',
            param=f"prompt_cache_options.{key}",
        )


def _refuse_unhonoured(body: protocol.ChatCompletionRequest) -> None:
    """OpenAI's fields that change what its models do, which this server cannot honour:
    refused by name rather than ignored. Their defaults pass."""
    refusals = (
        (
            "reasoning_effort",
            body.reasoning_effort not in (None, "none"),
            "reasoning effort is not supported: the model answers without a reasoning phase",
        ),
        (
            "verbosity",
            body.verbosity not in (None, "medium"),
            "'verbosity' is not supported; bound the answer with 'max_completion_tokens'",
        ),
        (
            "service_tier",
            body.service_tier not in (None, "auto", "default"),
            "there is one service tier; requests are ordered by the Lane's SLOPolicy, or "
            "the one 'x-blazar-slo' names",
        ),
        (
            "store",
            bool(body.store),
            "completions are not stored by this server ('store' must be false)",
        ),
        (
            "metadata",
            bool(body.metadata),
            "'metadata' tags stored completions, and this server stores none",
        ),
        (
            "web_search_options",
            body.web_search_options is not None,
            "web search is not supported by this server",
        ),
        (
            "moderation",
            body.moderation is not None,
            MODERATION_REFUSED,
        ),
    )
    for param, refused, why in refusals:
        if refused:
            raise envelope.invalid(f"'{param}': {why}.", param=param)
    refuse_prompt_cache(body.prompt_cache_retention, body.prompt_cache_options)


def _refuse_functions(body: protocol.ChatCompletionRequest) -> None:
    """The deprecated form of tools: say which form to use rather than ignore it."""
    for param in ("functions", "function_call"):
        if getattr(body, param) is not None:
            raise envelope.invalid(
                f"'{param}' (deprecated by OpenAI) is not supported by this server; send "
                "'tools' and 'tool_choice'.",
                param=param,
            )


def _require_content(messages: Sequence[protocol.ChatMessage]) -> None:
    """A system or user turn without content is a client bug, not an empty turn."""
    for i, message in enumerate(messages):
        if message.role not in _CONTENT_REQUIRED:
            continue
        param = f"messages[{i}].content"
        if message.content is None:
            raise envelope.invalid(
                f"Missing required parameter: '{param}' (a {message.role} message needs content).",
                param=param,
            )
        if isinstance(message.content, list) and not message.content:
            raise envelope.invalid(
                f"Invalid value for '{param}': a {message.role} message needs at least one "
                "content part.",
                param=param,
            )


def _flatten(content: str | list[protocol.ContentPart] | None, *, param: str) -> str:
    """Join text parts with newlines, as vLLM and llama.cpp's server do."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise envelope.invalid(
                f"Only text content parts are supported; '{param}[{i}]' has type '{part.type}'.",
                param=f"{param}[{i}].type",
            )
        if part.text is None:
            raise envelope.invalid(
                f"Missing required parameter: '{param}[{i}].text'.", param=f"{param}[{i}].text"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _sampling(
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest, *, max_tokens: int | None
) -> inference_pb2.Sampling:
    sampling = canonical.sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else (body.stop or ()),
    )
    for key, bias in (body.logit_bias or {}).items():
        # Digits only: int() would also take " 5", "1_000" and other scripts' digits.
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token <= wire.INT32_MAX:
            raise envelope.invalid(
                f"Invalid key in 'logit_bias': {key!r} is not a token id.", param="logit_bias"
            )
        sampling.logit_bias[token] = bias
    sampling.ignore_eos = bool(body.ignore_eos)
    return sampling


def include_usage(body: protocol.ChatCompletionRequest | protocol.CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
