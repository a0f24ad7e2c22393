"""What the engine's events say on the wire (`inference_pb2`): a Delta of parsed text
and tool calls, logprobs as each token's bytes, and the Final with its usage, timings
and routing. Pure: the Generate servicer (`service`) streams what these return.
"""

from __future__ import annotations

from collections.abc import Sequence

from blazar._proto.v1 import inference_pb2
from blazar.engine import jobs, llama, logprobs, tools

_FINISH = {
    jobs.FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    jobs.FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    jobs.FinishReason.CANCELLED: inference_pb2.FINISH_REASON_CANCELLED,
}


def delta(
    parsed: tools.Parsed,
    *,
    tokens: int,
    logprobs: Sequence[inference_pb2.TokenLogprob] = (),
) -> inference_pb2.Delta:
    return inference_pb2.Delta(
        text=parsed.text,
        tokens=tokens,
        logprobs=logprobs,
        tool_calls=[
            inference_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in parsed.calls
        ],
    )


def wire_logprobs(
    vocab: llama.Vocab, scores: Sequence[logprobs.TokenLogprob], *, special: bool = False
) -> list[inference_pb2.TokenLogprob]:
    """Each token as its bytes. With `special`, control tokens as written (`<bos>`): a
    prompt's, which was read with them (completions' `echo` shows it so); the output's
    text leaves them out, and so do its tokens."""

    def entry(token: int, logprob: float) -> inference_pb2.TokenLogprob:
        piece = vocab.piece(token, special=special)
        return inference_pb2.TokenLogprob(
            id=token,
            token=piece.decode("utf-8", errors="replace"),
            logprob=logprob,
            bytes=piece,
        )

    wire = []
    for score in scores:
        item = entry(score.token, score.logprob)
        item.top.extend(entry(t, lp) for t, lp in score.top)
        wire.append(item)
    return wire


def final(event: jobs.Finished) -> inference_pb2.Final:
    return inference_pb2.Final(
        finish_reason=_FINISH[event.reason],
        usage=inference_pb2.Usage(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            cached_tokens=event.cached_tokens,
        ),
        timings=inference_pb2.Timings(
            queue_ms=event.queue_ms,
            prefill_ms=event.prefill_ms,
            prefill_wait_ms=event.prefill_wait_ms,
            ttft_ms=event.ttft_ms,
            decode_ms=event.decode_ms,
            decode_tokens_per_second=event.decode_tokens_per_second,
            parked_ms=event.parked_ms,
            decode_batch=event.decode_batch,
            prefill_batch=event.prefill_batch,
        ),
        routing=inference_pb2.Routing(
            slot=event.slot,
            prefix_tokens_reused=event.cached_tokens,
            drafted_tokens=event.drafted_tokens,
            accepted_tokens=event.accepted_tokens,
            speculation=event.speculation,
        ),
        stop_sequence=event.stop_sequence,
    )
