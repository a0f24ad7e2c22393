"""Anthropic's Messages API requests as canonical `blazar.v1` requests.

Pure: no IO, no clock, no logging. `messages_request` builds the canonical chat (the
system prompt as the first turn, `tool_use` blocks as the assistant's calls,
`tool_result` blocks as tool turns, consecutive turns of one role merged as Anthropic
merges them, a final assistant turn continued as Anthropic continues it: `_prefill`),
and `count_request` the Tokenize request that counts the same prompt as
the chat would render it. Every field is either done as Anthropic does it or refused
by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, sessions
from blazar.shim import canonical, validation
from blazar.shim.anthropic import protocol
from blazar.shim.anthropic.convert import envelope

_MODES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "any": inference_pb2.ToolChoice.MODE_REQUIRED,
    "tool": inference_pb2.ToolChoice.MODE_NAMED,
    "none": inference_pb2.ToolChoice.MODE_NONE,
}
# Block types Blazar does not take, and why.
_TEXT_ONLY = "Blazar serves text-only models"
# A document or search result may hold nothing but text: "text-only" would not say why
# it is refused, nor that its text goes through in a text block.
_REFUSED_BLOCKS = {
    "image": _TEXT_ONLY,
    "document": "Blazar reads no documents (PDFs, images, or text to cite); send a text "
    "document's text in a text block",
    "search_result": "Blazar cites no search results; send a result's text in a text block",
    "container_upload": "Blazar runs no containers",
    "thinking": "Blazar's models do not think",
    "redacted_thinking": "Blazar's models do not think",
}
# Service tiers Blazar honours: it has one, and it is the standard one.
_SERVICE_TIERS = ("auto", "standard_only")
# Where inference may run: "global" is anywhere, and this host is somewhere.
_INFERENCE_GEOS = ("global",)
# Context edits Blazar does as Anthropic would. A `clear_thinking` edit drops earlier
# turns' thinking blocks: Blazar's models write none and a history holding one is
# refused, so there is none to clear (Claude Code sends this edit on every request).
_CONTEXT_EDITS_TAKEN = ("clear_thinking_20251015",)
# What a tool result flagged `is_error` says to the model before the result.
ERROR_RESULT_PREFIX = "Error: "
# The tokens a generation of `max_tokens: 0` (Anthropic's cache pre-warming) runs to.
# An engine samples once its prompt is in: it prefills the prompt, and so leaves it in
# the slot's cache, then ends on this one token, which is never decoded into the cache
# and which the answer leaves out (`render.ResponseMeta.prewarm`).
PREWARM_TOKENS = 1


def _invalid(message: str, *, param: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message, metadata={validation.PARAM_KEY: param})


def messages_request(
    body: protocol.MessagesRequest, *, session: str = "", slo: str = ""
) -> inference_pb2.ChatRequest:
    """The canonical chat; `session` (the `x-blazar-session` header) keys replica
    stickiness, else `metadata.user_id`; `slo` (`x-blazar-slo`) names the SLOPolicy."""
    _refuse_generation_fields(body)
    request = _chat(body)
    request.sampling.CopyFrom(
        canonical.sampling(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=PREWARM_TOKENS if prewarms(body) else body.max_tokens,
            stop=body.stop_sequences or (),
        )
    )
    # As Anthropic's current models take it, max_tokens bounds the answer and reserves
    # nothing: a prompt that leaves less room is served, and the answer stops where the
    # context ends (stop_reason "model_context_window_exceeded", `render.stop_reason`).
    # Only a prompt that leaves no room is refused ("prompt is too long").
    request.sampling.max_tokens_up_to_context = True
    constraint = _constraint(body)
    if constraint is not None:
        if request.continue_final_message:
            raise _invalid(
                f"'messages[{len(body.messages) - 1}]' is a final assistant turn (prefill), "
                "and an output format would shape only its continuation, not the answer "
                "the prefill begins: send one or the other.",
                param="output_config.format",
            )
        request.constraint.CopyFrom(constraint)
    request.session = session or sessions.of_field(body.metadata.user_id if body.metadata else None)
    request.slo = slo
    return request


def prewarms(body: protocol.MessagesRequest) -> bool:
    """Whether the request only pre-warms the cache (`max_tokens: 0`)."""
    return body.max_tokens == 0


def count_request(body: protocol.CountTokensRequest) -> inference_pb2.TokenizeRequest:
    """Tokenize's chat form: the prompt counted exactly as the chat would render it.
    The output format is checked as for a generation, though it adds no prompt tokens."""
    chat = _chat(body)
    _constraint(body)
    return inference_pb2.TokenizeRequest(model=body.model, chat=chat, count_only=True)


def _chat(body: protocol.Conversation) -> inference_pb2.ChatRequest:
    """The model, conversation and tools both endpoints read."""
    _refuse_conversation_fields(body)
    request = inference_pb2.ChatRequest(
        model=body.model, messages=_messages(body), tools=_tools(body.tools or ())
    )
    request.continue_final_message = _prefill(body, request)
    choice = body.tool_choice
    if choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(choice, body.tools or ()))
        if choice.disable_parallel_tool_use is not None:
            request.parallel_tool_calls = not choice.disable_parallel_tool_use
    return request


# Thinking configurations Blazar honours: none, or the model's own choice
# ("adaptive": it decides when and how much to think, and Blazar's never choose to).
_THINKING_TAKEN = ("disabled", "adaptive")


def _refuse_conversation_fields(body: protocol.Conversation) -> None:
    thinking = body.thinking
    if thinking is not None and thinking.get("type") not in _THINKING_TAKEN:
        raise _invalid(
            "'thinking' is not supported: Blazar's models do not think. Leave it out, or "
            'send {"type": "disabled"} or {"type": "adaptive"} (under which they never '
            "choose to).",
            param="thinking",
        )
    if body.mcp_servers:
        raise _invalid(
            "'mcp_servers' is not supported: Blazar does not connect to MCP servers. Run "
            "the MCP client yourself and pass its tools in 'tools'.",
            param="mcp_servers",
        )
    _refuse_context_edits(body.context_management)
    if body.compaction is not None:
        raise _invalid(
            "'compaction' is not supported: Blazar does not summarize conversations. "
            "Leave it out, and send the context you want the model to read.",
            param="compaction",
        )
    if body.speed not in (None, "standard"):
        raise _invalid(
            f"'speed' {body.speed!r} is not supported: Blazar has one speed; send "
            '"standard" or leave it out.',
            param="speed",
        )
    billing = body.billing_policy
    if billing is not None and billing.get("bill_to", "self") != "self":
        raise _invalid(
            f"'billing_policy.bill_to' {billing.get('bill_to')!r} is not supported: Blazar "
            'bills nobody. Send "self" or leave it out.',
            param="billing_policy.bill_to",
        )
    if body.output_config is not None and body.output_config.effort is not None:
        raise _invalid(
            "'output_config.effort' is not supported: Blazar's models have no effort "
            "setting. Leave it out.",
            param="output_config.effort",
        )


def _refuse_context_edits(management: protocol.ContextManagement | None) -> None:
    for i, edit in enumerate(management.edits or () if management else ()):
        if edit.type not in _CONTEXT_EDITS_TAKEN:
            raise _invalid(
                f"'context_management.edits[{i}]' {edit.type!r} is not supported: Blazar "
                "never edits a conversation; send the context you want the model to read. "
                f"Blazar takes only {', '.join(_CONTEXT_EDITS_TAKEN)} (there is no thinking "
                "to clear).",
                param=f"context_management.edits[{i}].type",
            )


def _refuse_generation_fields(body: protocol.MessagesRequest) -> None:
    if body.thread is not None:
        # The code tells the `anthropic` client's threads (and so its tool runner) to
        # send the whole conversation without `thread` instead.
        raise errors.InvalidRequest(
            "'thread' is not supported: Blazar keeps no conversation between requests. "
            "Send the whole conversation in 'messages', without 'thread'.",
            metadata={
                validation.PARAM_KEY: "thread",
                envelope.ERROR_CODE_KEY: "thread_unsupported_request",
            },
        )
    if body.diagnostics is not None:
        raise _invalid(
            "'diagnostics' is not supported: Blazar keeps no earlier request to explain a "
            "cache miss against. The answer's usage says how many prompt tokens the cache "
            "held (cache_read_input_tokens). Leave it out.",
            param="diagnostics",
        )
    if body.fallbacks is not None:
        raise _invalid(
            "'fallbacks' is not supported: a request runs on the model it names. Leave it out.",
            param="fallbacks",
        )
    if body.container is not None:
        raise _invalid(
            "'container' is not supported: Blazar runs no code execution containers.",
            param="container",
        )
    if body.fallback_credit_token is not None:
        raise _invalid(
            "'fallback_credit_token' is not supported: Blazar mints no fallback credit "
            "(it refuses no request so, and bills none). Leave it out.",
            param="fallback_credit_token",
        )
    if body.inference_geo not in (None, *_INFERENCE_GEOS):
        raise _invalid(
            f"'inference_geo' {body.inference_geo!r} is not supported: Blazar runs on this "
            'host and promises no region; send "global" or leave it out.',
            param="inference_geo",
        )
    if body.service_tier not in (None, *_SERVICE_TIERS):
        raise _invalid(
            f"'service_tier' {body.service_tier!r} is not supported: Blazar has one tier "
            '(standard); send "auto" or "standard_only", or leave it out.',
            param="service_tier",
        )


def _constraint(
    body: protocol.Conversation,
) -> inference_pb2.Constraint | None:
    """Structured output: `output_config.format`, or its beta spelling `output_format`."""
    given = {
        "output_config.format": body.output_config.format if body.output_config else None,
        "output_format": body.output_format,
    }
    named = [name for name, fmt in given.items() if fmt is not None]
    if not named:
        return None
    if len(named) > 1:
        raise _invalid(
            "Send one of 'output_config.format' and 'output_format' (its beta spelling).",
            param="output_format",
        )
    fmt = given[named[0]]
    assert fmt is not None
    return canonical.json_schema(fmt.json_schema)


def _messages(
    body: protocol.Conversation,
) -> list[inference_pb2.Message]:
    out: list[inference_pb2.Message] = []
    if body.system is not None:
        system = _text(body.system, param="system")
        if system:
            out.append(inference_pb2.Message(role="system", content=system))
    names: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        for turn in _turns(message, param=f"messages[{i}]", names=names):
            _append(out, turn)
    return out


def _prefill(body: protocol.Conversation, request: inference_pb2.ChatRequest) -> bool:
    """Whether the conversation ends with an assistant turn, which Anthropic continues
    (prefill): the answer is what the model writes after it. Refused as Anthropic
    refuses it (trailing whitespace), and where a continuation cannot be honest: a turn
    that makes calls ends there, and a forced tool call or an output format would shape
    a turn that the prefill's text already began."""
    last = len(body.messages) - 1
    if body.messages[last].role != "assistant":
        return False
    param = f"messages[{last}]"
    final = request.messages[-1]
    if final.tool_calls:
        raise _invalid(
            f"'{param}' is a final assistant turn with tool_use blocks: a turn's calls end "
            "it, so it cannot be continued (prefill). Send the calls' results in a user turn.",
            param=param,
        )
    if final.content != final.content.rstrip():
        # Anthropic's own wording for it.
        raise _invalid(
            "messages: final assistant content cannot end with trailing whitespace", param=param
        )
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool"):
        raise _invalid(
            f"'{param}' is a final assistant turn (prefill), which a forced tool call "
            f"(tool_choice {choice.type!r}) cannot continue: its turn holds calls only. Send "
            "one or the other.",
            param="tool_choice",
        )
    return True


def _append(out: list[inference_pb2.Message], turn: inference_pb2.Message) -> None:
    """Consecutive user or assistant turns are one turn, as Anthropic combines them."""
    previous = out[-1] if out else None
    if previous is None or previous.role != turn.role or turn.role not in ("user", "assistant"):
        out.append(turn)
        return
    previous.content = "\n".join(part for part in (previous.content, turn.content) if part)
    previous.tool_calls.extend(turn.tool_calls)


def _turns(
    message: protocol.Message, *, param: str, names: dict[str, str]
) -> list[inference_pb2.Message]:
    """One Anthropic message as canonical turns: its text, its calls (assistant), and
    each tool result as a tool turn of its own, in the order the blocks come."""
    content = message.content
    if isinstance(content, str):
        return [inference_pb2.Message(role=message.role, content=content)]
    if not content:
        raise _invalid(
            f"Invalid value for '{param}.content': a message needs at least one content block.",
            param=f"{param}.content",
        )
    turns: list[inference_pb2.Message] = []
    texts: list[str] = []
    calls: list[inference_pb2.ToolCall] = []

    def flush() -> None:
        if texts or calls:
            turns.append(
                inference_pb2.Message(role=message.role, content="\n".join(texts), tool_calls=calls)
            )
        texts.clear()
        calls.clear()

    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        if isinstance(block, protocol.TextBlock):
            _refuse_citations(block, param=where)
            texts.append(block.text)
        elif isinstance(block, protocol.ToolUseBlock):
            if message.role != "assistant":
                raise _invalid(
                    f"'{where}' is a tool_use block in a {message.role} turn; only assistant "
                    "turns make tool calls.",
                    param=where,
                )
            if block.caller is not None and block.caller.get("type") != "direct":
                # A call code execution made: Blazar runs none, and showing it to the
                # model as its own call would rewrite the history.
                raise _invalid(
                    f"'{where}.caller' {block.caller.get('type')!r} is not supported: Blazar "
                    'runs no code execution, so every call is the model\'s ("direct"). Leave '
                    "it out.",
                    param=f"{where}.caller",
                )
            names[block.id] = block.name
            calls.append(
                inference_pb2.ToolCall(
                    id=block.id, name=block.name, arguments=canonical.json_text(block.input)
                )
            )
        elif isinstance(block, protocol.ToolResultBlock):
            if message.role != "user":
                raise _invalid(
                    f"'{where}' is a tool_result block in a {message.role} turn; tool results "
                    "come in user turns.",
                    param=where,
                )
            flush()
            turns.append(_tool_result(block, param=where, names=names))
        else:
            raise _refused_block(block.type, param=where)
    flush()
    return turns


def _tool_result(
    block: protocol.ToolResultBlock, *, param: str, names: dict[str, str]
) -> inference_pb2.Message:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, protocol.TextBlock):
                raise _refused_block(part.type, param=f"{param}.content[{k}]")
            _refuse_citations(part, param=f"{param}.content[{k}]")
            parts.append(part.text)
        text = "\n".join(parts)
    if block.tool_use_id not in names:
        # Anthropic refuses it too: a result must answer a call made before it.
        raise _invalid(
            f"'{param}.tool_use_id' {block.tool_use_id!r} matches no tool_use block in an "
            "earlier assistant turn; each tool_result block answers a call made before it.",
            param=f"{param}.tool_use_id",
        )
    if block.is_error:
        text = ERROR_RESULT_PREFIX + text
    return inference_pb2.Message(
        role="tool",
        content=text,
        tool_call_id=block.tool_use_id,
        # The tool's name, for templates that print it: the call's, when the history has it.
        name=names[block.tool_use_id],
    )


def _refuse_citations(block: protocol.TextBlock, *, param: str) -> None:
    if block.citations:
        raise _invalid(
            f"'{param}.citations' are not supported: Blazar does not cite documents.",
            param=f"{param}.citations",
        )


def _refused_block(kind: str, *, param: str) -> errors.InvalidRequest:
    why = _REFUSED_BLOCKS.get(kind)
    if why is None and (kind.endswith("_tool_result") or kind == "server_tool_use"):
        why = "Blazar runs no server tools"
    if why is None:
        why = "it is not a content block type Blazar knows"
    return _invalid(
        f"'{param}' is a {kind!r} block, which is not supported: {why}. Send text, "
        "tool_use and tool_result blocks.",
        param=f"{param}.type",
    )


def _text(content: str | list[protocol.TextBlock], *, param: str) -> str:
    """A string, or text blocks joined with newlines (as the other dialects join parts)."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        _refuse_citations(block, param=f"{param}[{j}]")
    return "\n".join(block.text for block in content)


def _tools(tools: Sequence[protocol.Tool]) -> list[inference_pb2.Tool]:
    out: list[inference_pb2.Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type not in (None, "custom"):
            raise _invalid(
                f"'{where}' is the server tool {tool.type!r}, which is not supported: Blazar "
                "runs no server tools. Define a client tool (name, description, input_schema) "
                "and run it yourself.",
                param=f"{where}.type",
            )
        if tool.input_schema is None:
            raise _invalid(
                f"Missing required parameter: '{where}.input_schema'.",
                param=f"{where}.input_schema",
            )
        if tool.input_examples:
            raise _invalid(
                f"'{where}.input_examples' is not supported: Blazar shows the model the "
                "tool's description and schema only. Leave it out.",
                param=f"{where}.input_examples",
            )
        if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
            # Only code execution may call it, and Blazar runs none: offering it to the
            # model would let the model call what the caller reserved for code.
            raise _invalid(
                f"'{where}.allowed_callers' without \"direct\" is not supported: Blazar runs "
                'no code execution, so the model is the only caller. Add "direct" or leave '
                "it out.",
                param=f"{where}.allowed_callers",
            )
        if tool.eager_input_streaming:
            raise _invalid(
                f"'{where}.eager_input_streaming' is not supported: Blazar streams a "
                "call's input once it is whole and valid, in one input_json_delta. Leave "
                "it out.",
                param=f"{where}.eager_input_streaming",
            )
        if tool.defer_loading:
            raise _invalid(
                f"'{where}.defer_loading' is not supported: Blazar has no tool search, so "
                "every tool is shown. Leave it out.",
                param=f"{where}.defer_loading",
            )
        out.append(
            inference_pb2.Tool(
                name=tool.name,
                description=tool.description or "",
                parameters=canonical.json_text(tool.input_schema),
            )
        )
    return out


def _tool_choice(
    choice: protocol.ToolChoice, tools: Sequence[protocol.Tool]
) -> inference_pb2.ToolChoice:
    """`any` and `tool` force a call (a grammar from the schemas keeps it valid)."""
    if not tools and choice.type != "none":
        raise _invalid(
            f"'tool_choice' {choice.type!r} needs 'tools' to choose from; none were given.",
            param="tool_choice",
        )
    if choice.type != "tool":
        if choice.name is not None:
            raise _invalid(
                f"'tool_choice.name' goes only with type 'tool'; this tool_choice is "
                f"{choice.type!r}.",
                param="tool_choice.name",
            )
        return inference_pb2.ToolChoice(mode=_MODES[choice.type])
    if not choice.name:
        raise _invalid(
            "Missing required parameter: 'tool_choice.name' (the tool to call).",
            param="tool_choice.name",
        )
    if choice.name not in {t.name for t in tools}:
        raise _invalid(
            f"'tool_choice' names the tool {choice.name!r}, which is not among the tools.",
            param="tool_choice.name",
        )
    return inference_pb2.ToolChoice(mode=_MODES["tool"], name=choice.name)
