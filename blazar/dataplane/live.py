"""Admission's live figures for an object's status as the Control API shows it
(`blazar get`, `blazar describe`): read from the Lanes' dispatchers on each call,
never stored.

- a Lane: its running requests, the generations parked for more urgent ones (and
  the host memory they hold), its queue by policy (how many wait, the oldest wait)
  and the tokens a second its replicas made lately;
- an SLOPolicy: over every Lane, the requests queued under it, their first tokens,
  its refusals by reason (those the HTTP shim answered from a closed gate too, as
  admission would have) and its attainment (the share of first tokens within the
  target, once any request had one).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from blazar.api.kinds import Kind
from blazar.dataplane import dispatcher
from blazar.rpc import refusals


def status(dispatchers: dispatcher.Dispatchers, kind: Kind, name: str) -> dict[str, Any]:
    """The live part of `name`'s status; {} for other kinds and unknown names."""
    if kind == Kind.LANE:
        lane = dispatchers.of(name)
        if lane is None:
            return {}
        oldest = lane.oldest_wait_s()
        queue = [
            {"policy": policy, "waiting": n, "oldestWaitMs": round(oldest[policy] * 1000)}
            for policy, n in sorted(lane.queued().items())
        ]
        parked, parked_bytes = lane.parked()
        return {
            "admission": {
                "running": lane.running(),
                "parked": parked,
                "parkedBytes": parked_bytes,
                "queue": queue,
                "tokensPerSecond": round(lane.tokens_per_second(), 2),
            }
        }
    if kind == Kind.SLO_POLICY:
        queued = first_tokens = met = targeted = 0
        refused: Counter[str] = Counter()
        for lane in dispatchers.all():
            figures = lane.figures.get(name)
            if figures is None:
                continue
            queued += figures.queued
            first_tokens += figures.first_tokens
            met += figures.met
            targeted += figures.targeted
            refused.update(figures.refused)
        refused.update(refusals.gated(name))
        live: dict[str, Any] = {
            "queued": queued,
            "firstTokens": first_tokens,
            "refused": dict(sorted(refused.items())),
        }
        if targeted:
            live["attainment"] = round(met / targeted, 4)
        return {"admission": live}
    return {}
