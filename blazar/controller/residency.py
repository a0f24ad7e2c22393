"""Residency under a memory budget: which idle Lanes sleep so that a wanted one fits.

When a request waits for a Lane (asleep, or never started) whose replica does not fit
because other Lanes hold the memory, the Lane reconciler asks `choose` which Lanes to
put to sleep, as Ollama's scheduler unloads its least recently used runner:

- never a Lane with a request in flight, nor one a request waits for (`wanted`);
- never one with `preload: true`;
- never one resident for less than the minimum residency (`serve --min-residency`),
  so that requests alternating between two Lanes that do not fit together swap them at
  most once per residency rather than at every request;
- of the others, the least recently used first (longest idle), until what they free
  covers the shortfall. If the eligible Lanes cannot cover it yet, none is put to sleep
  (a sleep that frees too little would only cost a reload), and the decision says when
  the earliest residency among the rest ends, so the controller looks again then; a
  request's end wakes it too.

Lanes waiting for memory start in the order their requests came, as Ollama serves
pending loads: a Lane put to sleep for another, whose own request comes before that one
has started, stays asleep until it has (`sleeper.Sleeper`), rather than take back the
memory it freed and leave the other waiting out its whole residency.

Every Lane without `preload` is swappable, whether or not it sets idle.sleepAfter: a
user who runs two big models under one budget expects both to be served on demand.
A Lane put to sleep this way wakes on its next request as a sleeping one does.

`choose` is pure (figures and `now` in, names out); `Residency` keeps the little state
the reconciler needs between passes: which Lanes it put to sleep, since when each Lane
is resident, and which wait for memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

# How long a Lane stays resident before the budget may put it to sleep. A swap costs a
# model load (under a second for the bundled model, seconds to tens of seconds for a
# 7B from page cache or disk); 30 s keeps that cost to a small share of the time even
# when every request alternates between two Lanes, and is short enough that a request
# waiting for the other Lane stays within a typical queue bound of a minute.
DEFAULT_MIN_RESIDENCY_S = 30.0


@dataclass(frozen=True)
class Candidate:
    """A Lane holding memory, as the eviction decision sees it."""

    lane: str
    # Bytes its running replicas are charged (what its sleep frees).
    held_bytes: int
    # When its replicas started (it became resident); None when unknown.
    resident_since: datetime | None
    # Seconds since its last request ended.
    idle_s: float
    in_flight: int = 0
    wanted: bool = False
    preload: bool = False


@dataclass(frozen=True)
class Eviction:
    """The Lanes to put to sleep now (least recently used first), and when to look again
    when none can be yet (seconds; None: only a request's end can help)."""

    victims: tuple[str, ...] = ()
    recheck_after: float | None = None


def choose(
    *,
    shortfall: int,
    candidates: Sequence[Candidate],
    now: datetime,
    min_residency_s: float,
) -> Eviction:
    """The least recently used eligible Lanes whose memory covers `shortfall` bytes."""
    if shortfall <= 0:
        return Eviction()
    eligible = [
        c
        for c in candidates
        if c.in_flight == 0 and not c.wanted and not c.preload and c.held_bytes > 0
    ]
    young: list[float] = []
    old: list[Candidate] = []
    for c in eligible:
        resident_s = (
            min_residency_s
            if c.resident_since is None
            else (now - c.resident_since).total_seconds()
        )
        if resident_s < min_residency_s:
            young.append(min_residency_s - resident_s)
        else:
            old.append(c)
    victims: list[str] = []
    freed = 0
    for c in sorted(old, key=lambda c: (-c.idle_s, c.lane)):
        if freed >= shortfall:
            break
        victims.append(c.lane)
        freed += c.held_bytes
    if freed >= shortfall:
        return Eviction(victims=tuple(victims))
    return Eviction(recheck_after=min(young, default=None))


class Residency:
    """What the Lane reconciler remembers between passes about the budget's sleeps.
    One per daemon, used from the controller's event loop only."""

    def __init__(self, *, min_residency_s: float = DEFAULT_MIN_RESIDENCY_S) -> None:
        self.min_residency_s = min_residency_s
        # Put to sleep for memory -> the Lane it made room for.
        self._evicted: dict[str, str] = {}
        self._since: dict[str, datetime] = {}
        self._waiting: set[str] = set()

    def evict(self, lane: str, *, for_lane: str) -> None:
        self._evicted[lane] = for_lane

    def evicted_for(self, lane: str) -> str | None:
        """The Lane this one was put to sleep for; None when it was not."""
        return self._evicted.get(lane)

    def woken(self, lane: str) -> None:
        """A request wants the Lane: it is no longer asleep for memory."""
        self._evicted.pop(lane, None)

    def resident(self, lane: str, since: datetime) -> None:
        """The Lane's first replica started at `since` (kept while any runs)."""
        self._since.setdefault(lane, since)

    def gone(self, lane: str) -> None:
        """The Lane has no replica running any more."""
        self._since.pop(lane, None)

    def resident_since(self, lane: str) -> datetime | None:
        return self._since.get(lane)

    def evicted_for_lane(self, lane: str) -> list[str]:
        """The Lanes put to sleep to make room for `lane`."""
        return sorted(name for name, first in self._evicted.items() if first == lane)

    def wait(self, lane: str, waiting: bool) -> bool:
        """Whether a request for the Lane waits for memory; True when that changed."""
        if waiting == (lane in self._waiting):
            return False
        if waiting:
            self._waiting.add(lane)
        else:
            self._waiting.discard(lane)
        return True

    def waits(self, lane: str) -> bool:
        return lane in self._waiting

    def waiting(self) -> list[str]:
        return sorted(self._waiting)

    def forget(self, lane: str) -> None:
        """The Lane is deleted."""
        self._evicted.pop(lane, None)
        self._since.pop(lane, None)
        self._waiting.discard(lane)
