"""Responses API request bodies into the canonical `blazar.v1.ChatRequest`.

Pure: no IO, no clock, no logging. `instructions` becomes the system turn ahead of
`input`; an assistant `message` item and the `function_call` items after it are one
assistant turn (its text and its calls); a `function_call_output` is a tool turn.
What the canonical request cannot carry, or a stateless server cannot do, is refused
naming the field (`envelope.invalid`), never ignored: Blazar keeps no responses
(`store: true`, `previous_response_id`, `conversation`, `background`), runs no tools
of its own, and never truncates a conversation to fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from blazar._proto.v1 import inference_pb2
from blazar.api import jsontext, sessions
from blazar.shim import canonical
from blazar.shim.openai import protocol as chat
from blazar.shim.openai.convert import envelope, requests
from blazar.shim.openai.responses import protocol

# The one `include` value that asks for something Blazar produces.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_ROLES = {"developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def chat_request(
    body: protocol.ResponseCreateRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.ChatRequest:
    """The canonical request; `session` (the `x-blazar-session` header) keys replica
    stickiness, else the body's `prompt_cache_key`, `user` or `safety_identifier`;
    `slo` (the `x-blazar-slo` header) names the SLOPolicy, else the Lane's applies."""
    _refuse_state(body)
    _refuse_reasoning(body)
    _refuse_chat_constraints(body)
    requests.refuse_obfuscation(body.stream_options)
    requests.refuse_uncached(body.cache_prompt)
    messages: list[inference_pb2.Message] = []
    if body.instructions:
        messages.append(inference_pb2.Message(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(inference_pb2.Message(role="user", content=body.input))
    else:
        messages.extend(_turns(body.input))
    sampling = canonical.sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=body.max_output_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else (body.stop or ()),
    )
    if wants_logprobs(body):
        sampling.logprobs = True
        sampling.top_logprobs = body.top_logprobs or 0
    elif body.top_logprobs:
        raise envelope.invalid(
            f"'top_logprobs' needs 'include' to list \"{LOGPROBS_INCLUDE}\".",
            param="top_logprobs",
        )
    request = inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        constraint=_constraint(body.text),
        session=session
        or sessions.of_field(body.prompt_cache_key or body.user or body.safety_identifier),
        slo=slo,
        tools=[_tool(t, i) for i, t in enumerate(body.tools or ())],
        tool_choice=_tool_choice(body),
    )
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    requests.one_call_when_named(request)
    return request


def count_request(body: protocol.InputTokensRequest) -> inference_pb2.TokenizeRequest:
    """The Tokenize request that counts a response's prompt exactly as `chat_request`
    would build it (the same turns, tools and refusals): no `input` counts the
    instructions and tools alone. OpenAI's `personality` is a preset of its own models,
    refused by name."""
    if body.personality is not None:
        raise envelope.invalid(
            "'personality' is not supported: it is a style preset of OpenAI's models.",
            param="personality",
        )
    fields = body.model_dump(exclude={"personality", "input"}, exclude_unset=True, by_alias=True)
    create = protocol.ResponseCreateRequest.model_validate(
        {**fields, "input": body.input if body.input is not None else ""}
    )
    chat = chat_request(create)
    if body.input is None:
        # The empty user turn that "" became: without input there is no turn to count.
        del chat.messages[-1]
    return inference_pb2.TokenizeRequest(model=body.model, chat=chat, count_only=True)


def wants_logprobs(body: protocol.ResponseCreateRequest) -> bool:
    """Whether the response's text carries its tokens' log-probabilities; any other
    `include` value is refused (`chat_request`)."""
    return LOGPROBS_INCLUDE in (body.include or ())


def _refuse_chat_constraints(body: protocol.ResponseCreateRequest) -> None:
    """`grammar` and `json_schema` are Blazar's Chat Completions extensions (llama.cpp's
    names): sent here they would be dropped, and the answer unconstrained."""
    for name in ("grammar", "json_schema"):
        if name in body.model_fields_set:
            raise envelope.invalid(
                f"'{name}' is not a Responses API parameter: Blazar takes it on "
                "/v1/chat/completions and /v1/completions. Here send "
                '\'text.format\' ({"type": "json_schema", ...}).',
                param=name,
            )


def _refuse_state(body: protocol.ResponseCreateRequest) -> None:
    """What needs a response store, a background queue or built-in tools: Blazar keeps
    nothing after a response is sent, so a client must send the whole conversation."""
    stateless = "Blazar keeps no responses: send the whole conversation in 'input'."
    if body.store:
        raise envelope.invalid(f"'store' must be false or absent. {stateless}", param="store")
    if body.previous_response_id is not None:
        raise envelope.invalid(
            f"'previous_response_id' is not supported by this server. {stateless}",
            param="previous_response_id",
        )
    if body.conversation is not None:
        raise envelope.invalid(
            f"'conversation' is not supported by this server. {stateless}",
            param="conversation",
        )
    if body.background:
        raise envelope.invalid(
            "Background responses are not supported by this server: it keeps no "
            "responses to poll. Stream the response instead.",
            param="background",
        )
    if body.prompt is not None:
        raise envelope.invalid(
            "Stored prompts ('prompt') are not supported by this server; send "
            "'instructions' and 'input'.",
            param="prompt",
        )
    if body.truncation == "auto":
        raise envelope.invalid(
            "'truncation' \"auto\" is not supported: this server never drops part of "
            'a conversation to fit. Send "disabled" (a conversation too long for the '
            "context is a 400) and shorten the input yourself.",
            param="truncation",
        )
    if body.context_management:
        raise envelope.invalid(
            "'context_management' (compaction) is not supported: this server never "
            "summarizes or drops part of a conversation to fit. Omit it; a conversation "
            "too long for the context is a 400, and shortening it is yours.",
            param="context_management",
        )
    if body.moderation is not None:
        raise envelope.invalid(f"'moderation': {requests.MODERATION_REFUSED}.", param="moderation")
    requests.refuse_prompt_cache(body.prompt_cache_retention, body.prompt_cache_options)
    for param, value, why in (
        ("background_options", body.background_options, "background responses are not"),
        ("image", body.image, "image options are not"),
        ("access_programs", body.access_programs, "access programs are not"),
    ):
        if value is not None:
            raise envelope.invalid(f"'{param}': {why} supported by this server.", param=param)
    if body.max_tool_calls is not None:
        raise envelope.invalid(
            "'max_tool_calls' limits built-in tools, and this server runs none; the "
            "model's function calls are yours to run.",
            param="max_tool_calls",
        )
    if body.service_tier not in (None, "auto", "default"):
        raise envelope.invalid(
            f"'service_tier' {body.service_tier!r} is not supported; this server has one "
            "tier (requests are ordered by the Lane's SLOPolicy, or `x-blazar-slo`).",
            param="service_tier",
        )
    for i, value in enumerate(body.include or ()):
        if value != LOGPROBS_INCLUDE:
            raise envelope.invalid(
                f"'include[{i}]' {value!r} is not supported; this server can include "
                f'only "{LOGPROBS_INCLUDE}".',
                param=f"include[{i}]",
            )


def _refuse_reasoning(body: protocol.ResponseCreateRequest) -> None:
    """The models Blazar serves write no reasoning items, and `verbosity` is a control
    only some OpenAI models have: ignoring them would pass off another answer."""
    reasoning = body.reasoning
    if reasoning is not None:
        if reasoning.effort not in (None, "none"):
            raise envelope.invalid(
                f"'reasoning.effort' {reasoning.effort!r} is not supported: this server's "
                "models do not reason. Omit 'reasoning' or send effort \"none\".",
                param="reasoning.effort",
            )
        for name in ("summary", "generate_summary"):
            if getattr(reasoning, name) is not None:
                raise envelope.invalid(
                    f"'reasoning.{name}' is not supported: this server's models write no "
                    "reasoning to summarize.",
                    param=f"reasoning.{name}",
                )
    if body.text is not None and body.text.verbosity is not None:
        raise envelope.invalid(
            "'text.verbosity' is not supported by this server's models; omit it.",
            param="text.verbosity",
        )


def _turns(items: Sequence[protocol.InputItem]) -> list[inference_pb2.Message]:
    if not items:
        raise envelope.invalid("'input' must not be an empty list.", param="input")
    messages: list[inference_pb2.Message] = []
    # Call id -> tool name, for the outputs that answer them.
    calls: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            calls[call.id] = call.name
            last = messages[-1] if messages else None
            # A call belongs to the assistant turn it follows (its text, earlier calls).
            if last is not None and last.role == "assistant":
                last.tool_calls.append(call)
            else:
                messages.append(inference_pb2.Message(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _required(item.call_id, f"{where}.call_id")
            if call_id not in calls:
                raise envelope.invalid(
                    f"No 'function_call' item before {where} has call_id {call_id!r}; a "
                    "function_call_output answers a call made earlier in 'input'.",
                    param=f"{where}.call_id",
                )
            if item.output is None:
                raise envelope.invalid(
                    f"Missing required parameter: '{where}.output'.", param=f"{where}.output"
                )
            messages.append(
                inference_pb2.Message(
                    role="tool",
                    content=_text(item.output, param=f"{where}.output"),
                    tool_call_id=call_id,
                    name=calls[call_id],
                )
            )
        else:
            raise envelope.invalid(
                f"Input items of type {kind!r} are not supported by this server ({where}); "
                "send messages, 'function_call' and 'function_call_output' items.",
                param=f"{where}.type",
            )
    return messages


def _message(item: protocol.InputItem, where: str) -> inference_pb2.Message:
    role = item.role
    if role is None:
        raise envelope.invalid(
            f"Missing required parameter: '{where}.role'.", param=f"{where}.role"
        )
    if item.content is None:
        raise envelope.invalid(
            f"Missing required parameter: '{where}.content'.", param=f"{where}.content"
        )
    if role != "assistant" and isinstance(item.content, list) and not item.content:
        raise envelope.invalid(
            f"Invalid value for '{where}.content': a {role} message needs at least one "
            "content part.",
            param=f"{where}.content",
        )
    return inference_pb2.Message(
        role=_ROLES.get(role, role),
        content=_text(item.content, param=f"{where}.content", refusals=role == "assistant"),
    )


def _call(item: protocol.InputItem, where: str) -> inference_pb2.ToolCall:
    call_id = _required(item.call_id, f"{where}.call_id")
    name = _required(item.name, f"{where}.name")
    arguments = item.arguments
    if arguments is None:
        raise envelope.invalid(
            f"Missing required parameter: '{where}.arguments'.", param=f"{where}.arguments"
        )
    try:
        document = jsontext.loads(arguments or "{}")
    except jsontext.NotJSON:
        document = None
    if not isinstance(document, dict):
        raise envelope.invalid(
            f"Invalid value for '{where}.arguments': the arguments of a call are JSON "
            "text of an object.",
            param=f"{where}.arguments",
        )
    return inference_pb2.ToolCall(id=call_id, name=name, arguments=arguments)


def _required(value: str | None, param: str) -> str:
    if not value:
        raise envelope.invalid(f"Missing required parameter: '{param}'.", param=param)
    return value


def _text(content: str | list[protocol.ContentPart], *, param: str, refusals: bool = False) -> str:
    """Text parts joined with newlines, as the Chat Completions dialect joins them. With
    `refusals` (an assistant's message, as OpenAI's output holds it) a `refusal` part
    is text too, as Chat Completions takes an assistant turn's `refusal`."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if refusals and part.type == "refusal":
            if part.refusal is None:
                raise envelope.invalid(
                    f"Missing required parameter: '{param}[{j}].refusal'.",
                    param=f"{param}[{j}].refusal",
                )
            texts.append(part.refusal)
            continue
        if part.type not in _TEXT_PARTS:
            raise envelope.invalid(
                f"Only text content parts ('input_text', 'output_text') are supported; "
                f"'{param}[{j}]' has type {part.type!r}.",
                param=f"{param}[{j}].type",
            )
        if part.text is None:
            raise envelope.invalid(
                f"Missing required parameter: '{param}[{j}].text'.", param=f"{param}[{j}].text"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _tool(tool: protocol.Tool, i: int) -> inference_pb2.Tool:
    if tool.type != "function":
        raise envelope.invalid(
            f"Tools of type {tool.type!r} are not supported by this server ('tools[{i}]'): "
            "it runs no tools of its own. Send function tools and run them yourself.",
            param=f"tools[{i}].type",
        )
    name = _required(tool.name, f"tools[{i}].name")
    parameters = tool.parameters
    return inference_pb2.Tool(
        name=name,
        description=tool.description or "",
        parameters="" if parameters is None else canonical.json_text(parameters),
    )


def _tool_choice(body: protocol.ResponseCreateRequest) -> inference_pb2.ToolChoice | None:
    def name_of(choice: protocol.ToolChoiceObject) -> str:
        if choice.type != "function":
            raise envelope.invalid(
                f"'tool_choice' of type {choice.type!r} is not supported by this server; send "
                '"auto", "none", "required" or {"type": "function", "name": ...}.',
                param="tool_choice.type",
            )
        return _required(choice.name, "tool_choice.name")

    return requests.tool_choice(body.tool_choice, has_tools=bool(body.tools), name_of=name_of)


def _constraint(text: protocol.TextConfig | None) -> inference_pb2.Constraint | None:
    fmt = text.format if text is not None else None
    if isinstance(fmt, protocol.JsonSchemaFormat):
        return canonical.json_schema(fmt.json_schema)
    if isinstance(fmt, chat.JsonObjectFormat):
        return requests.json_object(fmt)
    return None
