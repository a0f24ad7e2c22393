"""A Generate request made ready to run: validated, its sampling resolved (with the
tools the model may call: `_resolve`), its chat rendered by the model's template or
Blazar's tool prompt, and its prompt tokenized and checked against the slot's context,
before any slot is taken. Tokenize renders and tokenizes a chat the same way.

`Preparing` is mixed into `service.EngineService`: its methods read the servicer's
decode loop (the model's vocabulary, a slot's context) and chat template, declared
below; the split is only of the text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable, Sequence

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import chatprompt, gbnf, jobs, llama, loop, sampling, text, tools

# Prompts up to this many characters are tokenized on the event loop; longer ones in a
# worker thread, so that other streams' tokens keep flowing. Tokenizing costs about 1 µs
# a character (measured on an EPYC core, README prose: 1.9 ms for 2 KiB, 18 ms for
# 16 KiB), the hop to a thread about 0.15 ms: at most 2 ms of the loop, and a hop only
# for prompts whose prefill takes far longer.
INLINE_TOKENIZE_CHARS = 2_048


class Preparing:
    """The preparation of `EngineService`'s requests (see the module docstring)."""

    _decode: loop.DecodeLoop
    _chat: text.ChatTemplate | None

    async def _prepare(
        self,
        request: engine_pb2.GenerateRequest,
        deliver: Callable[[jobs.Event], None],
        *,
        arrived: float,
    ) -> tuple[jobs.Job, tools.CallParser | None]:
        """Validate, render and tokenize; raise BlazarError when it cannot run. With
        tools, also the parser that finds the calls in the output."""
        which = request.WhichOneof("input")
        constraint = request.constraint

        def resolve() -> tuple[tools.ToolSet | None, sampling.SamplingParams]:
            toolset = tools.parse(request.chat) if which == "chat" else None
            params = _resolve(
                request.sampling, constraint=constraint, toolset=toolset, vocab=self._decode.vocab
            )
            return toolset, params

        # Off the event loop: a JSON schema (a forced call's too) becomes a grammar that
        # llama.cpp compiles, tools' schemas are checked, and ignore_eos needs the
        # end-of-generation tokens, found the first time by asking each of the
        # vocabulary's tokens (170 ms for 262k). Anything else takes microseconds, less
        # than a hop to a worker thread and back (which, with the decode threads busy on
        # every core, waits for a time slice).
        slow = (
            constraint.WhichOneof("kind") is not None
            or request.sampling.ignore_eos
            or (which == "chat" and len(request.chat.tools) > 0)
        )
        toolset, params = await asyncio.to_thread(resolve) if slow else resolve()
        active = toolset is not None and toolset.active
        turns: list[text.ChatTurn] | None = None
        final = which == "chat" and request.chat.continue_final_message
        if which == "prompt":
            prompt = request.prompt
        elif which == "chat":
            turns = self._chat_turns(request.chat.messages)
            if final:
                text.check_continuation(
                    constrained=constraint.WhichOneof("kind") is not None,
                    forced=toolset is not None and toolset.forced,
                )
            prompt = self._render(turns, toolset, continue_final=final)
        else:
            raise errors.InvalidRequest("Set either prompt or chat.")

        limit = text.context_limit(self._decode.context_per_slot, params.context_limit)
        # The request asked for less than a slot holds: its refusals say so.
        requested = limit != self._decode.context_per_slot

        def tokenize() -> list[int]:
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                # Tokenizing is not stopped by a caller who leaves, and costs about 1 µs
                # a byte (seconds for the 16 MiB a body may hold): a prompt too long in
                # bytes to fit is refused untokenized.
                least = text.fewest_tokens(prompt, self._decode.vocab.longest_piece)
                text.generation_room(
                    least,
                    params.max_tokens,
                    limit,
                    at_least=True,
                    up_to_context=params.max_tokens_up_to_context,
                    requested=requested,
                )
            if turns is None:
                # A raw prompt is the caller's whole prompt, control tokens included.
                return self._decode.vocab.tokenize(prompt)
            return self._chat_tokens(turns, toolset, prompt, final)

        if len(prompt) > INLINE_TOKENIZE_CHARS:
            tokens = await asyncio.to_thread(tokenize)
        else:
            tokens = tokenize()
        if not tokens:
            # An empty prompt starts from BOS, as with OpenAI and llama.cpp's server;
            # a model that adds none has nothing to start from.
            raise errors.InvalidRequest(
                "The prompt is empty.", metadata={errors.FIELD_KEY: "prompt"}
            )
        max_tokens = text.generation_room(
            len(tokens),
            params.max_tokens,
            limit,
            up_to_context=params.max_tokens_up_to_context,
            requested=requested,
        )
        job = jobs.Job(
            request_id=request.request_id,
            prompt=tokens,
            params=params,
            max_tokens=max_tokens,
            deliver=deliver,
            arrived=arrived,
            tpot_target_s=request.tpot_target_ms / 1000 if request.tpot_target_ms > 0 else None,
            cache_scope=request.cache_scope,
            # The caller's stop strings end the answer's text, not a call the model
            # writes in it (a forced call's grammar keeps them out: `_resolve`).
            stop_quiet=(tools.OPEN, tools.CLOSE) if active else None,
        )
        if toolset is None or not active:
            return job, None
        # An auto turn with a grammar has one only beside a structured answer (`_resolve`).
        return job, tools.CallParser(toolset, shaped=params.grammar is not None)

    def _chat_turns(self, messages: Sequence[inference_pb2.Message]) -> list[text.ChatTurn]:
        """A conversation's turns, checked: what Generate prefills and Tokenize counts."""
        if not messages:
            raise errors.InvalidRequest("The conversation has no messages.")
        turns = tools.history_turns(messages)
        text.check_roles(turns)
        return turns

    def _chat_tokens(
        self,
        turns: list[text.ChatTurn],
        toolset: tools.ToolSet | None,
        prompt: str,
        continue_final: bool,
    ) -> list[int]:
        """The rendered chat's tokens, where only the template's text may write control
        tokens: what the caller wrote (contents, tools, calls) is tokenized as text
        (`chatprompt`)."""
        vocab = self._decode.vocab
        nonce = secrets.token_hex(8)
        shown = toolset if toolset is not None and toolset.active else None
        masked = chatprompt.mask(turns, shown, risky=vocab.writes_control_tokens, nonce=nonce)
        if not masked.which:
            return vocab.tokenize(prompt)
        masked_prompt = self._render(
            masked.turns, masked.tools if shown else toolset, continue_final=continue_final
        )
        pieces = chatprompt.split(prompt, masked_prompt, masked.which, nonce)
        if pieces is None:
            where = masked.where[min(masked.which)]
            raise errors.InvalidRequest(
                f"{where} holds text that the model reads as a control token, and the "
                "chat template changes it in a way that cannot be followed to keep it as "
                "text; remove or escape that text.",
                metadata={errors.FIELD_KEY: where},
            )
        tokens: list[int] = []
        for k, piece in enumerate(pieces):
            tokens += vocab.tokenize(piece.text, add_bos=k == 0, parse_special=piece.special)
        return tokens

    def _render(
        self,
        turns: list[text.ChatTurn],
        toolset: tools.ToolSet | None,
        *,
        continue_final: bool,
    ) -> str:
        """The prompt: tools and tool turns by the model's template when it shows tools
        in the call format Blazar parses, else by Blazar's own tool prompt. With
        `continue_final`, the final assistant turn is left open (prefill)."""
        if self._chat is not None and self._chat.renders_tools:
            shown = toolset if toolset is not None and toolset.active else None
            return self._chat.render(
                turns,
                tools=tools.template_tools(shown) if shown else None,
                continue_final=continue_final,
            )
        if continue_final:
            # Checked before the tool prompt rewrites the turns: a final turn's calls
            # would be written into its text.
            text.check_continuable(turns)
        plain = tools.builtin_turns(turns, toolset)
        if self._chat is not None:
            return self._chat.render(plain, continue_final=continue_final)
        return text.render_gemma(plain, continue_final=continue_final)


def _resolve(
    wire: inference_pb2.Sampling,
    *,
    constraint: inference_pb2.Constraint,
    toolset: tools.ToolSet | None,
    vocab: llama.Vocab,
) -> sampling.SamplingParams:
    """The request's sampling, with tools the model may call in it:

    - a forced call's grammar is its constraint. It keeps none of the caller's stop
      strings: its grammar lets the model write calls only, so a stop string could only
      match inside one (`"\n"` in every call's format) and cut the call the caller
      forced. A response format is checked and shapes no output of this turn, which
      has only calls (it shapes the answer of a later turn, as OpenAI reads it).
    - in auto mode, the model stops where it would begin a tool's result: that is the
      caller's to give, and a model that writes one is making it up. With a response
      format, the grammar lets it write calls (and that opening after them, while it
      is a stop string) or the formatted answer (`tools.grammar`).
    """
    if toolset is None or not toolset.active:
        return sampling.resolve(wire, constraint=constraint, vocab=vocab)
    if constraint.WhichOneof("kind") == "grammar":
        raise errors.InvalidRequest(
            "A GBNF grammar and tools the model may call cannot both apply: send a JSON "
            "schema as the response format instead (the model then calls tools or answers "
            "in it), or tool_choice none.",
            metadata={errors.FIELD_KEY: sampling.CONSTRAINT_FIELD},
        )
    wire = _copy(wire)
    if toolset.forced:
        del wire.stop[:]
    elif tools.RESULT_OPEN not in wire.stop and len(wire.stop) < sampling.MAX_STOPS:
        wire.stop.append(tools.RESULT_OPEN)
    # The caller's own format first, as if alone: what is wrong with it is said of it.
    params = sampling.resolve(wire, constraint=constraint, vocab=vocab)
    if not toolset.forced and params.grammar is None:
        return params
    made = tools.grammar(
        toolset,
        answer=None if toolset.forced else params.grammar,
        result_stops=tools.RESULT_OPEN in wire.stop,
    )
    what = "The grammar that forces a call of these tools"
    if not toolset.forced:
        what = "The grammar of these tools' calls or the structured answer"
    try:
        gbnf.check_bounds(made, what=what)
        if vocab is not None:
            sampling.check_grammar(made, vocab)
    except errors.InvalidRequest as err:
        err.metadata[errors.FIELD_KEY] = tools.TOOLS_FIELD
        raise
    return dataclasses.replace(params, grammar=made)


def _copy(wire: inference_pb2.Sampling) -> inference_pb2.Sampling:
    out = inference_pb2.Sampling()
    out.CopyFrom(wire)
    return out
