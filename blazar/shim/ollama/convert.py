"""Translate Ollama's requests into the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging. `chat_request` and `generate_request` build the
canonical request, with `options` read by `options.sampling`; `embed_request` and
`embeddings_request` the embedding one. Whatever Blazar cannot honour is refused by
name, never ignored. The way back is `render` (generations, errors) and `listing`
(tags, show, ps).

A chat that ends with an assistant message continues it, as Ollama's templates leave
the last assistant turn open (`_continues`).

Tools are OpenAI's function tools in Ollama's shape: a call's `arguments` is a JSON
object (the canonical request carries it as text), and a tool message names its tool
(`tool_name`) rather than the call it answers. Ollama has no tool choice; Blazar's
`x-blazar-tool-choice` header is read by `context.tool_choice`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from blazar._proto.v1 import inference_pb2
from blazar.api import jsonschemas
from blazar.shim import canonical, context, validation
from blazar.shim.ollama import options, protocol, template

# Ollama's keep_alive as a Go duration (`time.ParseDuration`): a sign, then one or
# more number-and-unit parts.
_GO_DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
_GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_ROLES = ("system", "user", "assistant", "tool")


def is_load(body: protocol.ChatRequest | protocol.GenerateRequest) -> bool:
    """Ollama's preload: a chat without messages or a generate without a prompt only
    loads the model (or, with keep_alive 0, unloads it: `is_unload`)."""
    if isinstance(body, protocol.ChatRequest):
        return not body.messages
    return not body.prompt


def check_load(body: protocol.ChatRequest | protocol.GenerateRequest) -> None:
    """What a preload is refused for beyond its conversion: a `format` that is not a
    JSON Schema, which a generation's engine refuses but a preload never reaches."""
    if isinstance(body.format, dict):
        jsonschemas.check(body.format)


def is_unload(body: protocol.ChatRequest | protocol.GenerateRequest) -> bool:
    """Ollama's unload: nothing to generate and keep_alive 0."""
    return is_load(body) and keep_alive_seconds(body.keep_alive) == 0


def chat_request(
    body: protocol.ChatRequest,
    *,
    session: str = "",
    slo: str = "",
    tool_choice: str = "",
    parallel_tool_calls: str = "",
) -> inference_pb2.ChatRequest:
    """The canonical request for a chat with at least one message. `session` and `slo`
    are the `x-blazar-session` and `x-blazar-slo` headers; `tool_choice` and
    `parallel_tool_calls` the `x-blazar-tool-choice` and `x-blazar-parallel-tool-calls`
    headers as sent (see `context`)."""
    _check_generation(body)
    tools = [_tool(tool, param=f"tools[{i}]") for i, tool in enumerate(body.tools or ())]
    choice = context.tool_choice(tool_choice, tools=[t.name for t in tools])
    parallel = context.parallel_tool_calls(parallel_tool_calls)
    messages = [
        _message(message, param=f"messages[{i}]") for i, message in enumerate(body.messages)
    ]
    request = inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=_sampling_of(body),
        constraint=constraint(body.format),
        session=session,
        slo=slo,
        tools=tools,
        tool_choice=choice,
    )
    if parallel is not None:
        request.parallel_tool_calls = parallel
    request.continue_final_message = _continues(request)
    keep_alive(request, body.keep_alive)
    return request


def _continues(request: inference_pb2.ChatRequest) -> bool:
    """Whether the chat ends with an assistant message, which Ollama continues (its
    templates leave the last assistant turn open): the answer is what the model writes
    after it. Refused where a continuation cannot be honest: a message that made calls
    ends its turn, and a `format` or a forced call (`x-blazar-tool-choice`) would shape
    a turn that the message's text already began."""
    last = len(request.messages) - 1
    if last < 0 or request.messages[last].role != "assistant":
        return False
    final = request.messages[last]
    param = f"messages[{last}]"
    if final.tool_calls:
        raise validation.invalid(
            f"'{param}' is a final assistant message with tool_calls: its calls end its "
            "turn, so it cannot be continued. Send the calls' results as tool messages.",
            param=f"{param}.tool_calls",
        )
    if request.constraint.WhichOneof("kind") is not None:
        raise validation.invalid(
            f"'{param}' is a final assistant message, which is continued, and 'format' "
            "would shape only the continuation, not the answer the message began: send "
            "one or the other.",
            param="format",
        )
    if request.tool_choice.mode in (
        inference_pb2.ToolChoice.MODE_REQUIRED,
        inference_pb2.ToolChoice.MODE_NAMED,
    ):
        raise validation.invalid(
            f"'{param}' is a final assistant message, which is continued, and a forced "
            "tool call (x-blazar-tool-choice) makes a turn of calls only: send one or "
            "the other.",
            param="x-blazar-tool-choice",
        )
    return True


def _tool(tool: protocol.Tool, *, param: str) -> inference_pb2.Tool:
    """The daemon checks names and schemas, naming `tools[i].name` or `.parameters`.

    A Go client sends its structs' zero values for what it leaves unset (Ollama's
    `api.Tool` has no omitempty on `type`, `parameters`' `type` or `properties`):
    `"type": ""` and `"properties": null`, which Ollama reads as a function tool
    without parameters, and so does Blazar (an empty `properties`, so that the only
    call is `{}`; without it, any object would do)."""
    if tool.type not in ("function", ""):
        raise validation.invalid(
            f"Invalid value for '{param}.type': {tool.type!r}; the only type of tool is "
            "'function'.",
            param=f"{param}.type",
        )
    function = tool.function
    parameters = function.parameters
    if parameters is not None:
        parameters = dict(parameters)
        if parameters.get("type") == "":
            del parameters["type"]
        if "properties" in parameters and parameters["properties"] is None:
            parameters["properties"] = {}
    return inference_pb2.Tool(
        name=function.name,
        description=function.description or "",
        parameters="" if parameters is None else canonical.json_text(parameters),
    )


def generate_request(
    body: protocol.GenerateRequest,
    *,
    session: str = "",
    slo: str = "",
    tool_choice: str = "",
    parallel_tool_calls: str = "",
) -> inference_pb2.ChatRequest | inference_pb2.CompleteRequest:
    """A prompt through the model's chat template (with `system` as the system turn);
    with `template`, through that one (see `template.render`) instead; with `raw`, the
    prompt as it is. The last two are continued with no chat template. Generate has
    no tools, so `tool_choice` (the header) can only be auto or none; either header
    is still checked."""
    _check_generation(body)
    for name in ("images", "context", "tools"):
        if getattr(body, name):
            raise validation.invalid(_GENERATE_REFUSALS[name], param=name)
    for name in ("width", "height", "steps"):
        if getattr(body, name) is not None:
            raise validation.invalid(
                f"'{name}' is not supported: it sets up image generation, and Blazar "
                "serves text-only models. Leave it out.",
                param=name,
            )
    context.tool_choice(tool_choice, tools=())
    context.parallel_tool_calls(parallel_tool_calls)
    if body.suffix:
        raise validation.invalid(
            "'suffix' is not supported: Blazar only continues a prompt, it does not fill "
            "in between a prompt and a suffix.",
            param="suffix",
        )
    sampling = _sampling_of(body)
    if body.raw:
        for name in ("system", "template"):
            if getattr(body, name):
                raise validation.invalid(
                    f"'{name}' cannot go with 'raw': true (raw mode applies no template).",
                    param=name,
                )
    if body.raw or body.template:
        prompt = body.prompt
        if body.template:
            prompt = template.render(body.template, system=body.system or "", prompt=prompt)
        complete = inference_pb2.CompleteRequest(
            model=body.model,
            prompt=prompt,
            sampling=sampling,
            constraint=constraint(body.format),
            session=session,
            slo=slo,
        )
        keep_alive(complete, body.keep_alive)
        return complete
    messages = [inference_pb2.Message(role="user", content=body.prompt)]
    if body.system:
        messages.insert(0, inference_pb2.Message(role="system", content=body.system))
    chat = inference_pb2.ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        constraint=constraint(body.format),
        session=session,
        slo=slo,
    )
    keep_alive(chat, body.keep_alive)
    return chat


_GENERATE_REFUSALS = {
    "images": "'images' are not supported: Blazar serves text-only models.",
    "context": (
        "'context' (token ids from an earlier answer) is not supported; send the "
        "conversation as messages to /api/chat instead."
    ),
    "tools": (
        "'tools' are not supported on /api/generate (Ollama's generate has none); send "
        "the conversation and its tools to /api/chat."
    ),
}


def keep_alive(
    request: inference_pb2.ChatRequest
    | inference_pb2.CompleteRequest
    | inference_pb2.EmbedRequest
    | inference_pb2.KeepAliveRequest,
    sent: protocol.KeepAlive,
) -> None:
    """Set the canonical request's `keep_alive_s` from Ollama's `keep_alive`."""
    seconds = keep_alive_seconds(sent)
    if seconds is not None:
        request.keep_alive_s = seconds


def _check_generation(body: protocol.ChatRequest | protocol.GenerateRequest) -> None:
    """The fields of chat and generate Blazar cannot honour, refused by name."""
    check_keep_alive(body.keep_alive)
    if body.think is not None and body.think is not False:
        raise validation.invalid(
            f"'{body.model}' does not support thinking; send the request without 'think' "
            "(or with 'think': false).",
            param="think",
        )
    for name in ("truncate", "shift"):
        if getattr(body, name):
            raise validation.invalid(
                f"'{name}': true is not supported: Blazar never cuts a conversation short "
                "or shifts the context; a prompt that does not fit is refused, and a "
                f'generation that fills the context stops with done_reason "length". '
                f"Send '{name}': false or leave it out.",
                param=name,
            )
    if body.debug_render_only:
        raise validation.invalid(
            "'_debug_render_only': true is not supported: Blazar does not answer with the "
            "rendered prompt. Leave it out.",
            param="_debug_render_only",
        )
    if body.top_logprobs and not body.logprobs:
        raise validation.invalid(
            "'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs"
        )


def keep_alive_seconds(keep_alive: protocol.KeepAlive) -> float | None:
    """Ollama's keep_alive in seconds, as the canonical `keep_alive_s` carries it: None
    when absent, -1 for any negative value (keep loaded), 0 to unload after the
    request. A number is seconds; text is a Go duration ("5m", "-1h", "0") or a number
    of seconds ("300", "-1"). Anything else is refused by name."""
    if keep_alive is None:
        return None
    seconds: float | None = None
    if isinstance(keep_alive, bool):
        seconds = None
    elif isinstance(keep_alive, int | float):
        seconds = float(keep_alive)
    else:
        text = keep_alive.strip()
        number = text.removeprefix("-").removeprefix("+")
        if number.isascii() and number.replace(".", "", 1).isdigit():
            seconds = float(text)
        elif _GO_DURATION.fullmatch(text):
            total = sum(
                float(n) * _GO_UNIT_SECONDS[unit] for n, unit in _GO_DURATION_PART.findall(text)
            )
            seconds = -total if text.startswith("-") else total
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise validation.invalid(
            f"Invalid value for 'keep_alive': {keep_alive!r}; use a number of seconds or a "
            'duration such as "5m" (0 unloads the model after the request, a negative '
            "value keeps it loaded).",
            param="keep_alive",
        )
    return -1.0 if seconds < 0 else seconds


def check_keep_alive(keep_alive: protocol.KeepAlive) -> None:
    """Refuse a keep_alive that does not read; used where it cannot act yet."""
    keep_alive_seconds(keep_alive)


def _message(message: protocol.Message, *, param: str) -> inference_pb2.Message:
    role = message.role.lower()
    if role not in _ROLES:
        raise validation.invalid(
            f"Invalid value for '{param}.role': {message.role!r}; use system, user, "
            "assistant or tool.",
            param=f"{param}.role",
        )
    if message.tool_calls and role != "assistant":
        raise validation.invalid(
            f"Only assistant messages carry 'tool_calls'; '{param}' is a {role} message.",
            param=f"{param}.tool_calls",
        )
    for name in ("tool_name", "tool_call_id"):
        if getattr(message, name) and role != "tool":
            raise validation.invalid(
                f"Only tool messages carry '{name}'; '{param}' is a {role} message.",
                param=f"{param}.{name}",
            )
    if message.images:
        raise validation.invalid(
            f"'{param}.images' are not supported: Blazar serves text-only models.",
            param=f"{param}.images",
        )
    if message.thinking:
        raise validation.invalid(
            f"'{param}.thinking' is not supported: Blazar's models do not think; send the "
            "turn's content only.",
            param=f"{param}.thinking",
        )
    return inference_pb2.Message(
        role=role,
        content=message.content,
        tool_calls=[
            inference_pb2.ToolCall(
                id=call.id or "",
                name=call.function.name,
                arguments=canonical.json_text(call.function.arguments or {}),
            )
            for call in message.tool_calls or ()
        ],
        tool_call_id=message.tool_call_id or "",
        name=message.tool_name or "",
    )


def constraint(fmt: protocol.Format) -> inference_pb2.Constraint | None:
    """Ollama's `format`: "json" is any JSON object, an object is a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return canonical.json_object()
    if isinstance(fmt, dict):
        return canonical.json_schema(fmt)
    raise validation.invalid(
        f"Invalid value for 'format': {fmt!r}; use \"json\" or a JSON schema (an object).",
        param="format",
    )


def _sampling_of(body: protocol.ChatRequest | protocol.GenerateRequest) -> inference_pb2.Sampling:
    out = options.sampling(body.options or {})
    if body.logprobs:
        out.logprobs = True
        out.top_logprobs = body.top_logprobs or 0
    return out


def embed_request(body: protocol.EmbedRequest) -> inference_pb2.EmbedRequest:
    """/api/embed's embeddings are unit length, as Ollama's are; `dimensions` keeps the
    first values (the engine checks the model has that many)."""
    _check_embedding(body.keep_alive, body.options, truncate=body.truncate)
    # An empty string is no input, as in Ollama (a preload); an empty item of a list
    # is an input, which the engine refuses.
    if isinstance(body.input, str):
        inputs = [body.input] if body.input else []
    else:
        inputs = list(body.input)
    request = inference_pb2.EmbedRequest(
        model=body.model,
        inputs=inputs,
        normalize=True,
        dimensions=body.dimensions,
        context_limit=options.num_ctx(body.options),
    )
    keep_alive(request, body.keep_alive)
    return request


def embeddings_request(body: protocol.EmbeddingsRequest) -> inference_pb2.EmbedRequest:
    """The older /api/embeddings: the raw embedding, not normalized, as Ollama's."""
    _check_embedding(body.keep_alive, body.options, truncate=None)
    request = inference_pb2.EmbedRequest(
        model=body.model,
        inputs=[body.prompt],
        normalize=False,
        context_limit=options.num_ctx(body.options),
    )
    keep_alive(request, body.keep_alive)
    return request


def _check_embedding(
    keep_alive: protocol.KeepAlive,
    embedding_options: Mapping[str, Any] | None,
    *,
    truncate: bool | None,
) -> None:
    check_keep_alive(keep_alive)
    if truncate:
        raise validation.invalid(
            "'truncate': true is not supported: Blazar never cuts an input short; an input "
            "longer than the context is refused. Send 'truncate': false or leave it out.",
            param="truncate",
        )
    options.check_embedding(embedding_options)
