"""The admission gate as tables: the queue's state + a policy -> would the smallest
request be refused now (`LaneQueue.gate`), and that a refused probe means every larger
request of the policy is refused too."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest

from blazar.dataplane import admission
from blazar.dataplane.admission import (
    FIFO_POLICY,
    Admit,
    LaneQueue,
    LaneView,
    Policy,
    Reason,
    Refuse,
    Resume,
    Ticket,
)
from tests.unit.test_admission import (
    BATCH,
    BUSY,
    CAPPED,
    IDLE,
    INTERACTIVE,
    LONG,
    NOBODY,
    PATIENT,
    POLICIES,
    Engines,
    held,
    lane,
    parking,
    queue_of,
    replica,
    run,
    ticket,
)

# Random traffic's policies, and one that refuses early yet can park nothing (its
# priority is batch work's), so that its probe misses its target now and then.
MIXED = [
    *POLICIES,
    replace(INTERACTIVE, name="low", priority=0, ttft_target_s=0.3, max_queue_depth=6),
]

# A slot that frees in 1 s (50 tokens at 0.02 s): a probe's first token well within 2 s.
SOON = lane(replica(run("r", left=50)))


def closed(
    policy: Policy, reason: Reason, *, retry: float, predicted: float | None = None
) -> Refuse:
    probe = Ticket(
        admission.PROBE_ID,
        policy,
        0.0,
        admission.PROBE_PROMPT_TOKENS,
        admission.PROBE_MAX_TOKENS,
    )
    return Refuse(probe, reason, retry, predicted_ttft_s=predicted)


@pytest.mark.parametrize(
    ("waiting", "view", "policy", "spill", "gate"),
    [
        # An idle slot takes any request at once: open.
        ([], IDLE, INTERACTIVE, False, None),
        # Nothing serves: nothing to forecast from, and the queue has room: open.
        ([], NOBODY, INTERACTIVE, False, None),
        # The slot frees in 2 s, the target is 2 s: even one prompt token misses it.
        (
            [],
            BUSY,
            INTERACTIVE,
            False,
            closed(INTERACTIVE, Reason.SLO_UNATTAINABLE, retry=0.1, predicted=2.001),
        ),
        # The same wait under onOverload: queue: it waits (within the depth): open.
        ([], BUSY, PATIENT, False, None),
        # A slot that frees in 1 s: a request as small as the probe meets the target.
        ([], SOON, INTERACTIVE, False, None),
        # ... until the policy's queue is full (depth 2): QUEUE_FULL, retry when the
        # first of them starts (1 s).
        (
            [ticket("a", PATIENT, prompt=1), ticket("b", PATIENT, prompt=1)],
            SOON,
            PATIENT,
            False,
            closed(PATIENT, Reason.QUEUE_FULL, retry=1.0),
        ),
        # A full queue of another policy is not this policy's bound; but its tickets
        # of the same priority come first (earlier deadlines) and push the probe late.
        (
            [ticket("a", PATIENT, prompt=1), ticket("b", PATIENT, prompt=1)],
            lane(replica(run("r", left=50), slots=1), replica(index=1, slots=1, step=0.02)),
            INTERACTIVE,
            False,
            None,
        ),
        # Priorities: batch work waiting does not delay an interactive probe ...
        (
            [ticket("a", BATCH), ticket("b", BATCH)],
            SOON,
            INTERACTIVE,
            False,
            None,
        ),
        # ... and a full batch queue refuses batch work whatever an idle slot elsewhere
        # would not take (its cap): the probe cannot start now, and may not wait.
        (
            [ticket("a", CAPPED), ticket("b", CAPPED)],
            lane(replica(held("x"), held("y"), slots=3)),
            replace(CAPPED, max_queue_depth=2),
            False,
            closed(replace(CAPPED, max_queue_depth=2), Reason.QUEUE_FULL, retry=2.0),
        ),
        # Preemption: a long batch generation on a replica that may park it: the
        # probe would take its slot: open.
        ([], lane(parking(LONG)), INTERACTIVE, False, None),
        # ... not when parking it would pass the replica's bound: the probe misses.
        (
            [],
            lane(parking(LONG, parked=950)),
            INTERACTIVE,
            False,
            closed(INTERACTIVE, Reason.SLO_UNATTAINABLE, retry=18.001, predicted=20.001),
        ),
        # ... nor work of its own priority.
        (
            [],
            lane(parking(run("long", priority=100, left=1000, kv=100))),
            INTERACTIVE,
            False,
            closed(INTERACTIVE, Reason.SLO_UNATTAINABLE, retry=18.001, predicted=20.001),
        ),
        # Spillover: a probe that misses here is offered to the spillover Lane, which
        # decides: open.
        ([], BUSY, INTERACTIVE, True, None),
        # ... and a full queue too: the probe would meet its target here (three slots
        # free in 1 s, one for each waiting ticket and one for it) and be refused, but
        # a larger request may miss it, and is offered there.
        (
            [ticket("a", PATIENT, prompt=1), ticket("b", PATIENT, prompt=1)],
            lane(replica(*(run(f"r{i}", left=50) for i in range(3)), slots=3)),
            PATIENT,
            True,
            None,
        ),
        # A policy without a target never spills: its full queue refuses.
        (
            [ticket("a", BATCH), ticket("b", BATCH)],
            BUSY,
            BATCH,
            True,
            closed(BATCH, Reason.QUEUE_FULL, retry=2.0),
        ),
        # The built-in FIFO: no target, a deep queue: open.
        ([ticket("a"), ticket("b")], BUSY, FIFO_POLICY, False, None),
    ],
)
def test_gate(
    waiting: list[Ticket], view: LaneView, policy: Policy, spill: bool, gate: Refuse | None
) -> None:
    queue = queue_of(*waiting, view=view)
    before = queue.tickets()
    found = queue.gate(policy, now=0.0, view=view, spill=spill)
    if gate is None:
        assert found is None
    else:
        assert found == replace(
            gate,
            retry_after_s=pytest.approx(gate.retry_after_s),
            predicted_ttft_s=found
            and (
                pytest.approx(gate.predicted_ttft_s) if gate.predicted_ttft_s is not None else None
            ),
        )
    # Asking changes nothing.
    assert queue.tickets() == before
    assert admission.PROBE_ID not in queue


def test_a_closed_gate_refuses_larger_requests_alike() -> None:
    """The probe's refusal stands for a request of any size of its policy, with the
    same reason; a larger one's first token is only later."""
    queue = LaneQueue()
    gate = queue.gate(INTERACTIVE, now=0.0, view=BUSY)
    assert gate is not None
    for prompt, max_tokens in [(1, 1), (1, 4000), (500, 50), (1500, 1)]:
        decision = queue.arrive(
            ticket(f"t{prompt}-{max_tokens}", INTERACTIVE, prompt=prompt, max_tokens=max_tokens),
            now=0.0,
            view=BUSY,
        )
        assert isinstance(decision, Refuse)
        assert decision.reason == gate.reason
        assert decision.predicted_ttft_s is not None and gate.predicted_ttft_s is not None
        assert decision.predicted_ttft_s >= gate.predicted_ttft_s


def test_a_probe_comes_after_tickets_that_arrived_with_it() -> None:
    """A ticket that arrived at the same instant waits ahead of the probe, as it would
    ahead of any later request."""
    queue = queue_of(ticket("a", INTERACTIVE, prompt=1, arrived=0.0), view=SOON)
    # One slot, freeing in 1 s: "a" takes it; the probe would wait for "a" too.
    view = lane(replica(run("r", left=50)))
    gate = queue.gate(INTERACTIVE, now=0.0, view=view)
    assert gate is not None and gate.reason == Reason.SLO_UNATTAINABLE


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize("lateness", [1.0, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_a_refused_probe_means_every_request_is_refused(
    seed: int, lateness: float, spill: bool
) -> None:
    """Random traffic on two replicas that park, with priorities, caps and bounds:
    whenever the gate of a policy is closed, a fresh request of that policy of any
    size arriving then (no tenant, no session) is refused with the same reason. With a
    spillover Lane the gate of a policy with a target never closes: a larger request
    may miss its target where the probe would not, and is offered there."""
    rng = random.Random(seed)
    queue = LaneQueue()
    engines = Engines(lateness=lateness)
    tickets: dict[str, Ticket] = {}
    now = 0.0
    checked = {reason: 0 for reason in (Reason.QUEUE_FULL, Reason.SLO_UNATTAINABLE)}
    for step in range(300):
        now += rng.choice([0.0, 0.01, 0.05, 0.2])
        engines.step(rng)
        view = engines.view()
        for policy in MIXED:
            gate = queue.gate(policy, now=now, view=view, spill=spill)
            if gate is None:
                continue
            # A request the shim holds to the gate arrives after it was computed.
            later = now + 1e-6
            larger = ticket(
                "larger",
                policy,
                arrived=later,
                prompt=rng.randint(1, 1500),
                max_tokens=rng.randint(1, 400),
            )
            decision = copy.deepcopy(queue).arrive(larger, now=later, view=view, spill=spill)
            assert isinstance(decision, Refuse), (policy.name, gate, decision)
            assert decision.reason == gate.reason
            checked[gate.reason] += 1
        op = rng.random()
        if op < 0.5:
            policy = rng.choice(MIXED)
            t = ticket(
                f"t{step}",
                policy,
                arrived=now,
                prompt=rng.randint(10, 1500),
                max_tokens=rng.randint(1, 60 if policy.priority else 400),
            )
            tickets[t.id] = t
            queue.arrive(t, now=now, view=view, spill=spill)
        elif op < 0.75:
            for d in queue.dispatch(now=now, view=view):
                engines.start(d.ticket, d.replica)
            queue.expire(now=now, view=engines.view())
        else:
            preempt = queue.preemption(now=now, view=view)
            if preempt is not None:
                index, victim = engines.running.pop(preempt.victim)
                engines.parked[victim.id] = (index, victim)
                queue.requeue(tickets[victim.id], now=now, resume=Resume(index, victim.tokens_left))
                engines.start(preempt.ticket, index)
    # Both kinds of closed gate were seen and checked (only QUEUE_FULL with spillover).
    assert checked[Reason.QUEUE_FULL]
    assert spill or checked[Reason.SLO_UNATTAINABLE], checked


def test_admit_is_what_arrive_answers_an_open_gate() -> None:
    """An open gate and an arrival of the probe's size agree: it is admitted."""
    queue = LaneQueue()
    assert queue.gate(INTERACTIVE, now=0.0, view=SOON) is None
    decision = queue.arrive(ticket("t", INTERACTIVE, prompt=1, max_tokens=1), now=0.0, view=SOON)
    assert isinstance(decision, Admit)


# --- filling: closed once the idle slots are taken ------------------------------------


def test_filling_names_the_requests_that_close_the_gate() -> None:
    """Two idle slots, 0.02 s a token, a 2 s target: two requests that generate 98
    tokens or more hold both slots past the target of the one after them (1.96 s, and
    the first token after a wait may come two steps later, `WAIT_STEPS`)."""
    view = lane(replica(slots=2))
    queue = LaneQueue()
    # Its depth (2) does not count the requests that take the idle slots.
    assert queue.gate(INTERACTIVE, now=0.0, view=view) is None
    assert queue.idle_for(INTERACTIVE, now=0.0, view=view) == 2
    found = queue.filling(INTERACTIVE, now=0.0, view=view, max_tokens=2048)
    assert found is not None
    assert (found.requests, found.max_tokens, found.most_max_tokens) == (2, 98, 0)
    assert found.refusal.reason == Reason.SLO_UNATTAINABLE
    # Started from a hint, right or wrong, the same answer.
    for hint in (98, 97, 99, 1, 2048):
        assert queue.filling(INTERACTIVE, now=0.0, view=view, max_tokens=2048, hint=hint) == found
    # As arrivals (each started before the next comes): two of 98 tokens, and the
    # next is refused; of 97, admitted.
    for tokens, refused in [(98, True), (97, False)]:
        q = LaneQueue()
        engines = lane(replica(slots=2))
        for i in range(2):
            t = ticket(f"a{i}", INTERACTIVE, prompt=1, max_tokens=tokens)
            assert isinstance(q.arrive(t, now=0.0, view=engines), Admit)
            [started] = q.dispatch(now=0.0, view=engines)
            running = run(started.ticket.id, priority=100, left=tokens, kv=1)
            engines = lane(
                replace(engines.replicas[0], running=(*engines.replicas[0].running, running))
            )
        decision = q.arrive(ticket("next", INTERACTIVE, prompt=1), now=0.0, view=engines)
        assert isinstance(decision, Refuse) == refused


@pytest.mark.parametrize(
    ("policy", "view"),
    [
        (PATIENT, lane(replica(slots=2))),  # onOverload: queue refuses nothing early
        (INTERACTIVE, BUSY),  # no idle slot: the gate itself says it
        (INTERACTIVE, lane(replica(slots=2, step=0.0001))),  # never, up to max_tokens
    ],
)
def test_no_filling(policy: Policy, view: LaneView) -> None:
    assert LaneQueue().filling(policy, now=0.0, view=view, max_tokens=2048) is None


# Two idle slots, 0.02 s a token, 1,000 prompt tokens a second, a 2 s target, and room
# to wait.
ROOMY = replace(INTERACTIVE, max_queue_depth=8)


def test_filling_past_the_idle_slots_counts_the_requests_that_may_wait() -> None:
    """Requests like the latest (10 prompt tokens, 40 to generate) hold a slot for
    0.81 s: two take the idle slots, four more wait and meet the target (two turns),
    and the seventh would not. The idle slots alone close only after requests of 98
    tokens or more, for a request of any prompt."""
    view = lane(replica(slots=2))
    queue = LaneQueue()
    found = queue.filling(ROOMY, now=0.0, view=view, max_tokens=2048, latest=(10, 40))
    assert found is not None
    assert (found.requests, found.max_tokens) == (6, 40)
    # Sized for exactly its max_tokens and prompts of half to twice its own.
    assert found.most_max_tokens == 40
    assert (found.least_prompt_tokens, found.most_prompt_tokens) == (5, 20)
    assert found.refusal.reason == Reason.SLO_UNATTAINABLE
    # As arrivals, at once: six of any prompt from 5 to 20 tokens are admitted, the
    # next of 5 or more is refused; after five, it is admitted.
    for count, refused in [(6, True), (5, False)]:
        q = LaneQueue()
        for i in range(count):
            t = ticket(f"a{i}", ROOMY, prompt=5 + 15 * (i % 2), max_tokens=40)
            assert isinstance(q.arrive(t, now=0.0, view=view), Admit)
        decision = q.arrive(ticket("next", ROOMY, prompt=5, max_tokens=1), now=0.0, view=view)
        assert isinstance(decision, Refuse) == refused, count


def test_filling_for_requests_like_the_latest_counts_their_prompts() -> None:
    """Two idle slots taken by requests of 97 tokens (1.94 s): the next one with a
    one-token prompt meets its 2 s target (with two steps to spare, `WAIT_STEPS`), one
    with 32 prompt tokens (half the latest's 64) does not. So the gate closes after the
    two, for requests of 32 to 64 prompt tokens."""
    view = lane(replica(slots=2))
    found = LaneQueue().filling(ROOMY, now=0.0, view=view, max_tokens=2048, latest=(64, 97))
    assert found is not None
    assert (found.requests, found.max_tokens, found.most_max_tokens) == (2, 97, 97)
    assert (found.least_prompt_tokens, found.most_prompt_tokens) == (32, 64)
    for prompt, refused in [(32, True), (1, False)]:
        q = LaneQueue()
        for i in range(2):
            t = ticket(f"a{i}", ROOMY, prompt=32, max_tokens=97)
            assert isinstance(q.arrive(t, now=0.0, view=view), Admit)
            q.dispatch(now=0.0, view=view)
        engines = lane(replica(run("a0", left=97, kv=32), run("a1", left=97, kv=32), slots=2))
        decision = q.arrive(ticket("next", ROOMY, prompt=prompt), now=0.0, view=engines)
        assert isinstance(decision, Refuse) == refused, prompt


@pytest.mark.parametrize(
    ("policy", "latest", "requests"),
    [
        # Requests as large as the idle slots' answer: it stands.
        (ROOMY, (10, 200), 2),
        # A long prompt leaves the short prompts' line: the idle slots' answer stands.
        (ROOMY, (70, 40), 2),
        # The queue's depth (5) would refuse the fifth that waits as QUEUE_FULL.
        (replace(ROOMY, max_queue_depth=5), (10, 40), 2),
    ],
)
def test_filling_past_the_idle_slots_only_where_it_holds(
    policy: Policy, latest: tuple[int, int], requests: int
) -> None:
    found = LaneQueue().filling(
        policy, now=0.0, view=lane(replica(slots=2)), max_tokens=2048, latest=latest
    )
    assert found is not None
    assert (found.requests, found.max_tokens, found.most_max_tokens) == (requests, 98, 0)


def test_filling_past_busy_slots() -> None:
    """No idle slot: the gate is open while requests may still wait in time."""
    view = lane(replica(run("r", left=20), slots=1))  # frees in 0.4 s
    found = LaneQueue().filling(ROOMY, now=0.0, view=view, max_tokens=2048, latest=(10, 40))
    assert found is not None
    # 0.41, 1.22 s: two wait in time, the third would start at 2.03 s.
    assert (found.requests, found.max_tokens, found.most_max_tokens) == (2, 40, 40)


@pytest.mark.parametrize("sizes", [[25] * 5, [64] * 5, [64, 25, 64, 25, 25]])
def test_filling_like_the_latest_holds_when_larger_requests_ahead_park_work(
    sizes: list[int],
) -> None:
    """Requests like the latest (50 prompt tokens, 119 to generate): one takes the idle
    slot, the others may park the two batch requests on the other replica. Larger
    prompts ahead (64 tokens, within the sizes the gate names) are more likely to miss
    by waiting, so they park both, which frees the slots the smaller ones waited for:
    the next request with the least prompt (25) is refused after the smallest and
    admitted after larger ones, so no gate may close for requests of 25 to 64 (a
    larger request ahead is not just a later one here)."""
    view = lane(
        replica(index=0, slots=1, prefill=2000.0, step=0.01, parked_max=3000),
        replica(
            run("b1", left=195, kv=24),
            run("b2", left=282, kv=125),
            index=1,
            slots=2,
            prefill=2000.0,
            step=0.01,
            parked_max=3000,
        ),
    )
    found = LaneQueue().filling(ROOMY, now=0.0, view=view, max_tokens=2048, latest=(50, 119))
    # No band for requests like the latest (work here may be parked); the idle slot's
    # answer, for requests of any prompt, stands if any.
    assert found is None or not found.most_max_tokens, found
    # What the band found before would have named: five of 25 to 64 prompt tokens.
    queue = LaneQueue()
    for i, prompt in enumerate(sizes):
        t = ticket(f"a{i}", ROOMY, prompt=prompt, max_tokens=119)
        assert isinstance(queue.arrive(t, now=0.0, view=view), Admit)
    decision = queue.arrive(ticket("next", ROOMY, prompt=25, max_tokens=1), now=0.0, view=view)
    # Refused after the smallest, admitted after larger ones: no gate may say "refused".
    assert isinstance(decision, Refuse) == (sizes == [25] * 5), decision


@pytest.mark.parametrize("seed", range(4))
def test_filled_idle_slots_refuse_the_next_request(seed: int) -> None:
    """Random traffic: whenever `filling` answers k requests of max_tokens of at least
    m (and of the sizes it names), k fresh requests of the policy of any such size,
    then one more of any size (of at least the least prompt it names), arriving after
    it: the last is refused as SLO_UNATTAINABLE. The requests that take idle slots arrive one after another,
    each started before the next comes (in one batch instead, they wait together and
    the last may be QUEUE_FULL); those that wait past them, at once or one by one."""
    rng = random.Random(seed)
    queue = LaneQueue()
    engines = Engines()
    checked = checked_banded = 0
    now = 0.0
    for step in range(200):
        now += rng.choice([0.0, 0.05, 0.2, 0.5])
        engines.step(rng)
        view = engines.view()
        for policy in MIXED:
            latest = (rng.randint(1, 80), rng.randint(1, 300))
            found = queue.filling(policy, now=now, view=view, max_tokens=400, latest=latest)
            if found is None:
                continue
            banded = bool(found.most_max_tokens)
            checked_banded += banded
            least_prompt = found.least_prompt_tokens or 1
            most_prompt = found.most_prompt_tokens or 300
            most_tokens = found.most_max_tokens or 400
            at_once = banded and rng.random() < 0.5
            trial, running = copy.deepcopy(queue), copy.deepcopy(engines)
            later = now + 1e-6
            for i in range(found.requests):
                t = ticket(
                    f"fill{i}",
                    policy,
                    arrived=later,
                    prompt=rng.randint(least_prompt, most_prompt),
                    max_tokens=rng.randint(found.max_tokens, most_tokens),
                )
                assert isinstance(trial.arrive(t, now=later, view=running.view()), Admit), found
                if not at_once:
                    for d in trial.dispatch(now=later, view=running.view()):
                        running.start(d.ticket, d.replica)
            last = ticket("last", policy, arrived=later, prompt=rng.randint(least_prompt, 300))
            decision = trial.arrive(last, now=later, view=running.view())
            assert isinstance(decision, Refuse), (policy.name, found, decision)
            assert decision.reason == Reason.SLO_UNATTAINABLE
            checked += 1
        if rng.random() < 0.5:
            policy = rng.choice(MIXED)
            t = ticket(
                f"t{step}",
                policy,
                arrived=now,
                prompt=rng.randint(10, 800),
                max_tokens=rng.randint(1, 300),
            )
            queue.arrive(t, now=now, view=view)
        for d in queue.dispatch(now=now, view=engines.view()):
            engines.start(d.ticket, d.replica)
        queue.expire(now=now, view=engines.view())
    assert checked and checked_banded
