"""What a generation likely needs of a slot on its Lane: its prompt's tokens as the
Lane's measurements estimate them, its max_tokens, and the context they fill. Admission
reads it to pick a replica whose slots hold the request and to forecast its output;
the relay and the spill-over to another Lane each ask it of the Lane they offer to.
"""

from __future__ import annotations

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.dataplane import dispatcher, routing


def estimate(
    lane: dispatcher.LaneDispatcher,
    route: routing.Route,
    generate: engine_pb2.GenerateRequest,
    prompt_chars: int,
) -> tuple[int, int, int]:
    """A request's prompt tokens as the Lane's measured characters per token estimate
    them, its max_tokens (as asked, else the rest of a slot's context, and no more than
    that rest when max_tokens only bounds it: `max_tokens_up_to_context`), and the tokens
    of a slot's context the prompt and what it asked for likely need (it likely fits
    a slot of the Lane's when they are at most its context; admission starts it only
    on a replica whose slots hold them, `Ticket.context_tokens`)."""
    prompt_tokens = lane.measurements.prompt_tokens(prompt_chars)
    sampling = generate.sampling
    room = max(1, context(route, sampling) - prompt_tokens)
    if not sampling.HasField("max_tokens"):
        return prompt_tokens, room, prompt_tokens + 1
    if sampling.max_tokens_up_to_context:
        # A bound only: the generation stops where the context ends, so the prompt
        # needs a slot, not the prompt and max_tokens together.
        return prompt_tokens, min(sampling.max_tokens, room), prompt_tokens + 1
    return prompt_tokens, sampling.max_tokens, prompt_tokens + (sampling.max_tokens or 1)


def context(route: routing.Route, sampling: inference_pb2.Sampling) -> int:
    """The context a request may fill on `route`: a slot's, or the smaller one it asked
    for (`Sampling.context_limit`; the engine bounds it so: `text.context_limit`)."""
    asked = sampling.context_limit
    return min(route.context_length, asked) if asked else route.context_length
