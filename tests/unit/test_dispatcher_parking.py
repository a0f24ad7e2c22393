"""A preemption as the Lane's dispatcher carries it out: the park takes time, and that
time is measured as itself, never as the urgent request's start overhead."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
from structlog.testing import capture_logs

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.dataplane import admission, routing
from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.parking import Parked
from blazar.dataplane.preempting import PARK_TRIES
from blazar.dataplane.runs import Run
from tests.dispatching import one_slot_route

PARK_S = 0.2
BATCH = admission.Policy(name="batch", priority=0, max_queue_depth=8)
URGENT = admission.Policy(
    name="urgent", priority=100, ttft_target_s=2.0, max_queue_depth=8, reject_early=True
)
PATIENT = dataclasses.replace(URGENT, name="patient", reject_early=False)
# One request measured: a 100-token prompt in 10 ms, ten decode steps in a second, all
# of its budget generated.
MEASURED = inference_pb2.Final(
    usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
    timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=1000.0),
)


class SlowParker:
    """Parks after `seconds`, as an engine does between two decode steps; `None`
    parks nothing (the engine could not)."""

    def __init__(
        self,
        seconds: float = PARK_S,
        *,
        parks: bool = True,
        copy_s: float = PARK_S,
        refuse_first: int = 0,
    ) -> None:
        self.seconds = seconds
        self.copy_s = copy_s
        self.refuse_first = refuse_first
        # How long a Resume takes to be answered.
        self.resume_s = 0.0
        self.parks = parks
        self.parked: list[str] = []
        self.asked = 0

    async def park(self, replica: routing.Replica, request_id: str) -> Parked | None:
        self.asked += 1
        await asyncio.sleep(self.seconds)
        if not self.parks or self.asked <= self.refuse_first:
            return None
        self.parked.append(request_id)
        return Parked(parked_bytes=1000, tokens=10, copy_s=self.copy_s)

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        await asyncio.sleep(self.resume_s)
        return True


def ticket(id: str, policy: admission.Policy, *, prompt: int = 10) -> admission.Ticket:
    return admission.Ticket(id, policy, time.monotonic(), prompt_tokens=prompt, max_tokens=1000)


def dispatcher_of(parker: SlowParker) -> LaneDispatcher:
    dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
    # Batch requests run to their budget: one holds its slot for 100 s.
    dispatcher.measurements.record(0, MEASURED, prompt_chars=400, policy=BATCH.name, max_tokens=11)
    return dispatcher


def test_the_urgent_request_starts_after_the_park_and_the_park_is_measured() -> None:
    async def run() -> tuple[float, float, float, admission.ReplicaView]:
        parker = SlowParker()
        dispatcher = dispatcher_of(parker)
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            asked = time.monotonic()
            urgent = await dispatcher.admit(
                ticket("urgent", URGENT), request_id="u", prompt_chars=40
            )
            assert parker.parked == ["b"]
            view = dispatcher.measurements.replica_view(0, slots=1, running=())
            return asked, urgent.started_at, time.monotonic(), view
        finally:
            await dispatcher.close()

    asked, started_at, answered, view = asyncio.run(run())
    # Started when the slot was free (after the park), not when the park was asked for:
    # its first token's overhead will not count the park.
    assert asked + PARK_S <= started_at <= answered
    # The park is a figure of its own, which the forecast adds to a preempting start.
    assert view.park_s == pytest.approx(PARK_S, abs=0.05)


@pytest.mark.parametrize(("seconds", "copy_s", "recorded"), [(0.05, 0.01, 0.05), (0.5, 0.01, 0.11)])
def test_a_park_counts_at_most_its_copy_and_the_step_in_flight(
    seconds: float, copy_s: float, recorded: float
) -> None:
    """A decode step here takes 0.1 s (`MEASURED`): a park that took 0.5 s (it came
    while a long prompt chunk ran, say) is counted as the engine's 10 ms copy and one
    step, so that a few such parks cannot hold the figure up; a quick one as it came."""

    async def run() -> admission.ReplicaView:
        parker = SlowParker(seconds, copy_s=copy_s)
        dispatcher = dispatcher_of(parker)
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            await dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40)
            assert parker.parked == ["b"]
            return dispatcher.measurements.replica_view(0, slots=1, running=())
        finally:
            await dispatcher.close()

    assert asyncio.run(run()).park_s == pytest.approx(recorded, abs=0.02)


def test_the_queue_goes_on_deciding_while_an_engine_parks() -> None:
    """A park that takes 0.5 s does not hold up the Lane: a request arriving meanwhile
    is decided at once (here refused: its prefill alone misses its target), and sees the
    urgent request, not the victim, in the slot being freed (no second park)."""

    async def run() -> tuple[float, str, list[str]]:
        parker = SlowParker(0.5)
        dispatcher = dispatcher_of(parker)
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            urgent = asyncio.create_task(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40)
            )
            await asyncio.sleep(0.05)  # the park is under way
            asked = time.monotonic()
            with pytest.raises(errors.SloUnattainable) as refused:
                # 100,000 prompt tokens at the measured 10,000 per second: 10 s.
                late = ticket("late", URGENT, prompt=100_000)
                await dispatcher.admit(late, request_id="l", prompt_chars=40)
            took = time.monotonic() - asked
            assert (await urgent).replica.index == 0
            return took, str(refused.value), parker.parked
        finally:
            await dispatcher.close()

    took, message, parked = asyncio.run(run())
    assert took < 0.25, message
    assert parked == ["b"]


def test_the_ticket_a_park_is_for_holds_the_prefill_line_until_its_first_token_is_due() -> None:
    """While the engine parks, the slot shows the urgent ticket, whose 10,000-token
    prompt (1 s at the measured rate) holds the replica's prefill line from its
    forecast start (once parked: no park measured yet, one decode step, 0.1 s; then the
    step the engine goes on with, 0.1 s): a second urgent ticket that preempts at once is
    prefilled after it, not beside it."""

    async def run() -> float:
        parker = SlowParker(0.5)
        dispatcher = dispatcher_of(parker)
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            urgent = asyncio.create_task(
                dispatcher.admit(
                    ticket("urgent", URGENT, prompt=10_000), request_id="u", prompt_chars=40
                )
            )
            await asyncio.sleep(0.1)  # the park is under way
            (holder,) = dispatcher._view().replicas[0].running
            assert holder.id == "urgent"
            await urgent
            return holder.prefill_left_s
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == pytest.approx(0.1 + 0.1 + 1.0 - 0.1, abs=0.05)


async def batch_then_urgent(
    dispatcher: LaneDispatcher, *, decoding: bool, policy: admission.Policy, name: str
) -> tuple[Run, asyncio.Task[Run | admission.Spill]]:
    """A batch run (`decoding`: past its first token, 2 generated; else not seated yet
    as far as anyone knows), then a request of `policy` that would park it."""
    batch = await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
    assert isinstance(batch, Run)
    if decoding:
        dispatcher.first_token(batch, time.monotonic() - batch.ticket.arrived)
        batch.generated = 2
    urgent = asyncio.create_task(
        dispatcher.admit(ticket(name, policy), request_id=name[0], prompt_chars=40)
    )
    return batch, urgent


@pytest.mark.parametrize(("decoding", "asked"), [(True, 1), (False, PARK_TRIES)])
def test_a_park_the_engine_refuses_leaves_the_ticket_waiting_and_the_victim_running(
    decoding: bool, asked: int
) -> None:
    """A victim that decodes is not asked again until it has generated more; one with
    no first token yet (its engine may not have seated it) is asked again a step later,
    `PARK_TRIES` times in all. Then the ticket waits for the slot, the victim runs on."""

    async def run() -> tuple[str, int, int]:
        parker = SlowParker(0.02, parks=False)
        dispatcher = dispatcher_of(parker)
        try:
            _, urgent = await batch_then_urgent(
                dispatcher, decoding=decoding, policy=PATIENT, name="patient"
            )
            await asyncio.sleep(0.3 + PARK_TRIES * 0.1)
            return str(dispatcher.queued()), dispatcher.running(), parker.asked
        finally:
            await dispatcher.close()
            with contextlib.suppress(errors.BlazarError):
                await urgent

    assert asyncio.run(run()) == ("{'patient': 1}", 1, asked)


def test_a_victim_not_seated_yet_is_parked_when_asked_again() -> None:
    """The engine refuses the first Park (the batch run waits for its seat) and parks on
    the second: the urgent request starts in its slot, not refused nor left waiting."""

    async def run() -> tuple[list[str], int, str]:
        parker = SlowParker(0.02, refuse_first=1)
        dispatcher = dispatcher_of(parker)
        try:
            await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40),
                timeout=1.0,
            )
            assert isinstance(urgent, Run)
            return parker.parked, parker.asked, urgent.request_id
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == (["b"], 2, "u")


@pytest.mark.parametrize(
    ("seated", "cancel_after", "asked"),
    [
        # The victim decodes: the one park asked is refused after the caller left.
        (True, 0.01, 1),
        # Not seated yet: the caller leaves while the engine is to be asked again a
        # step later (0.1 s here, `MEASURED`), and it is not asked again.
        (False, 0.05, 1),
    ],
)
def test_a_caller_that_leaves_while_its_park_is_asked_leaves_nothing_behind(
    seated: bool, cancel_after: float, asked: int
) -> None:
    """The victim runs on in its slot, parked for no one, and once it ends the Lane
    holds nothing of the urgent request (it is idle)."""

    async def run() -> tuple[int, list[str], int, bool]:
        parker = SlowParker(0.03, parks=False)
        dispatcher = dispatcher_of(parker)
        try:
            batch, urgent = await batch_then_urgent(
                dispatcher, decoding=seated, policy=URGENT, name="urgent"
            )
            await asyncio.sleep(cancel_after)
            urgent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await urgent
            await asyncio.sleep(0.3)
            running = dispatcher.running()
            dispatcher.end(batch, None)
            await asyncio.sleep(0.05)
            return parker.asked, parker.parked, running, dispatcher.busy()
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == (asked, [], 1, False)


async def decoding_batch(dispatcher: LaneDispatcher) -> Run:
    """A batch run that has decoded for 0.2 s since its first token, 20 tokens since."""
    batch = await dispatcher.admit(ticket("batch", BATCH), request_id="b", prompt_chars=40)
    assert isinstance(batch, Run)
    dispatcher.first_token(batch, time.monotonic() - batch.ticket.arrived)
    await asyncio.sleep(0.2)
    batch.generated = 21
    return batch


def test_a_lane_that_has_finished_nothing_preempts_by_what_its_runs_in_flight_measure() -> None:
    """No request has finished, so no rate is measured: the batch run's pace so far (20
    tokens in 0.2 s, 980 of its 1,000 to go) shows its slot busy for seconds, and the
    urgent request parks it instead of waiting for a slot it would see free at once."""

    async def run() -> list[str]:
        parker = SlowParker(0.05)
        dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
        try:
            await decoding_batch(dispatcher)
            urgent = asyncio.create_task(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40)
            )
            done, _ = await asyncio.wait({urgent}, timeout=1.0)
            if not done:
                urgent.cancel()
                return ["still waiting after 1 s", *parker.parked]
            assert urgent.result().replica.index == 0
            return parker.parked
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == ["b"]


def test_a_resumed_run_measures_its_decode_without_the_time_it_was_parked() -> None:
    """20 tokens in 0.2 s, then parked for about 0.6 s: once resumed, the run's pace in
    flight is what it decoded over the time it decoded, about 0.01 s a token, not the
    0.04 s that counting the park would make it (and its slot would look busy longer)."""

    async def run() -> float:
        parker = SlowParker(0.05)
        dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
        try:
            batch = await decoding_batch(dispatcher)
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40), 1.0
            )
            assert parker.parked == ["b"]
            await asyncio.sleep(0.6)
            dispatcher.end(urgent, None)
            for _ in range(100):
                if batch.parked_at is None:
                    break
                await asyncio.sleep(0.01)
            assert batch.parked_at is None, "the parked run was not resumed"
            return dispatcher._view().rates["batch"].seconds
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) < 0.02


def test_a_run_that_falls_behind_its_pace_is_parked_before_the_urgent_deadline() -> None:
    """The batch run decoded 20 tokens in 0.2 s and has 39 to go: its slot frees in
    0.4 s, so the urgent request waits for it. Then it stalls, and no event comes: the
    dispatcher reads the forecast again each step (`LaneQueue.recheck_at`), sees the
    slot free later and later, and parks the run while the urgent request can still
    meet its 2 s target (without that, it would be refused at its deadline)."""

    async def run() -> tuple[float, list[str]]:
        parker = SlowParker(0.05)
        dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
        try:
            batch_ticket = admission.Ticket(
                "batch", BATCH, time.monotonic(), prompt_tokens=10, max_tokens=60
            )
            batch = await dispatcher.admit(batch_ticket, request_id="b", prompt_chars=40)
            assert isinstance(batch, Run)
            dispatcher.first_token(batch, time.monotonic() - batch.ticket.arrived)
            await asyncio.sleep(0.2)
            batch.generated = 21
            asked = time.monotonic()
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40), 3.0
            )
            assert urgent.replica.index == 0
            return urgent.started_at - asked, parker.parked
        finally:
            await dispatcher.close()

    waited, parked = asyncio.run(run())
    assert parked == ["b"]
    assert 0.2 < waited < 1.5, waited


def test_reading_the_forecast_again_each_step_leaves_the_lane_loop_mostly_idle() -> None:
    """A patient request (a 1,000 s target) waits behind a batch run that decodes a
    token each 20 ms, with 600 batch requests queued: its forecast is read again each
    step (`LaneQueue.recheck_at`), and each reading forecasts all 601 tickets, several
    milliseconds apiece. Nothing else happens, and the Lane's loop (the daemon's one
    event loop, which also serves HTTP and relays every stream) spends at most
    `RECHECK_BUSY_SHARE` of its time on those readings, not most of it: the period
    stretches to what a reading costs."""
    queued = 600
    many = dataclasses.replace(BATCH, max_queue_depth=queued + 1)
    slow = dataclasses.replace(PATIENT, name="slow", ttft_target_s=1000.0)
    # A token each 20 ms: the recheck's period at its shortest.
    fast = inference_pb2.Final(
        usage=inference_pb2.Usage(prompt_tokens=100, completion_tokens=11),
        timings=inference_pb2.Timings(prefill_ms=10.0, decode_ms=200.0),
    )

    async def run() -> tuple[float, bool]:
        dispatcher = LaneDispatcher(one_slot_route(), parker=SlowParker(0.05))
        dispatcher.measurements.record(0, fast, prompt_chars=400, policy=BATCH.name, max_tokens=11)
        spent: list[float] = []
        decide = dispatcher._decide

        def timed() -> None:
            started = time.perf_counter()
            decide()
            spent.append(time.perf_counter() - started)

        dispatcher._decide = timed  # type: ignore[method-assign]
        waiting = []
        try:
            batch = await dispatcher.admit(ticket("batch", many), request_id="b", prompt_chars=40)
            assert isinstance(batch, Run)
            dispatcher.first_token(batch, 0.01)
            waiting = [
                asyncio.create_task(
                    dispatcher.admit(ticket(f"q{i}", many), request_id=f"q{i}", prompt_chars=40)
                )
                for i in range(queued)
            ]
            waiting.append(
                asyncio.create_task(
                    dispatcher.admit(ticket("slow", slow), request_id="s", prompt_chars=40)
                )
            )
            while dispatcher.queued().get("slow") != 1:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            spent.clear()
            started = time.perf_counter()
            await asyncio.sleep(1.5)
            share = sum(spent) / (time.perf_counter() - started)
            return share, waiting[-1].done()
        finally:
            await dispatcher.close()
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    share, served = asyncio.run(run())
    assert not served  # it waits (its target is far): nothing happens but the rechecks
    assert share < 0.4, share  # twice `RECHECK_BUSY_SHARE`: margin for a busy host


def test_a_run_being_resumed_is_no_victim_until_its_engine_answers() -> None:
    """The urgent request that parked the batch run ends; the run is resumed, which its
    engine answers 0.3 s later. A patient request arriving meanwhile does not ask to park
    it (the engine, holding it parked still, would refuse); once the resume is answered
    it does."""

    async def run() -> tuple[int, int]:
        parker = SlowParker(0.02)
        parker.resume_s = 0.3
        dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
        try:
            await decoding_batch(dispatcher)
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40), 1.0
            )
            assert isinstance(urgent, Run) and parker.parked == ["b"]
            dispatcher.end(urgent, None)
            await asyncio.sleep(0.05)
            patient = asyncio.create_task(
                dispatcher.admit(ticket("patient", PATIENT), request_id="p", prompt_chars=40)
            )
            await asyncio.sleep(0.15)
            while_resuming = parker.asked
            await asyncio.sleep(0.4)
            patient.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.BlazarError):
                await patient
            return while_resuming, parker.asked
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == (1, 2)


def test_a_victim_seated_while_its_park_was_asked_is_parked_when_asked_again() -> None:
    """The engine refuses the first Park (the batch run had not been seated when asked)
    and the run's first token comes while that answer is on its way: the token says it
    is seated now, so it is asked again and parked; the urgent request starts."""

    async def run() -> tuple[list[str], int, str]:
        parker = SlowParker(0.1, refuse_first=1)
        dispatcher = dispatcher_of(parker)
        try:
            batch, urgent = await batch_then_urgent(
                dispatcher, decoding=False, policy=URGENT, name="urgent"
            )
            await asyncio.sleep(0.05)  # the first Park is asked, not yet answered
            dispatcher.first_token(batch, time.monotonic() - batch.ticket.arrived)
            batch.generated = 1
            started = await asyncio.wait_for(urgent, timeout=1.0)
            assert isinstance(started, Run)
            return parker.parked, parker.asked, started.request_id
        finally:
            await dispatcher.close()

    assert asyncio.run(run()) == (["b"], 2, "u")


class LeftParker(SlowParker):
    """Its Resume finds nothing parked, as when the parked generation's caller left
    while the Resume was on its way (the engine dropped it on the cancel)."""

    async def resume(self, replica: routing.Replica, request_id: str) -> bool:
        await asyncio.sleep(self.resume_s)
        return False


def test_a_resume_whose_caller_left_meanwhile_is_no_lost_generation() -> None:
    """The urgent request ends and the parked batch run is resumed; its caller leaves
    before the engine answers, and the engine, which dropped it on the cancel, finds
    nothing to resume. Nothing was lost: no warning."""

    async def run() -> list[dict[str, object]]:
        parker = LeftParker(0.02)
        parker.resume_s = 0.2
        dispatcher = LaneDispatcher(one_slot_route(), parker=parker)
        try:
            batch = await decoding_batch(dispatcher)
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40), 1.0
            )
            assert isinstance(urgent, Run) and parker.parked == ["b"]
            with capture_logs() as logs:
                dispatcher.end(urgent, None)
                for _ in range(100):
                    if batch.resuming:
                        break
                    await asyncio.sleep(0.01)
                assert batch.resuming, "the parked run was not resumed"
                dispatcher.end(batch, None)
                for _ in range(100):
                    if not batch.resuming:
                        break
                    await asyncio.sleep(0.01)
            return logs
        finally:
            await dispatcher.close()

    logs = asyncio.run(run())
    assert [x for x in logs if x["log_level"] == "warning"] == []


def test_a_parked_run_past_its_wait_bound_is_resumed_not_dropped() -> None:
    """Its policy bounds waits at 0.3 s; parked for 0.6 s, it is still the Lane's (its
    parked bytes counted) and resumes once the urgent request ends: the bound is for a
    request that has not started, and taking a parked one out would leave its open
    stream waiting for a resume that never comes."""
    bounded = dataclasses.replace(BATCH, max_queue_wait_s=0.3)

    async def run() -> tuple[tuple[int, int], Run]:
        parker = SlowParker(0.05)
        dispatcher = dispatcher_of(parker)
        try:
            batch = await dispatcher.admit(ticket("b", bounded), request_id="b", prompt_chars=40)
            urgent = await asyncio.wait_for(
                dispatcher.admit(ticket("urgent", URGENT), request_id="u", prompt_chars=40), 1.0
            )
            assert parker.parked == ["b"]
            await asyncio.sleep(0.6)
            parked = dispatcher.parked()
            dispatcher.end(urgent, None)
            for _ in range(100):
                if batch.parked_at is None:
                    break
                await asyncio.sleep(0.01)
            return parked, batch
        finally:
            await dispatcher.close()

    parked, batch = asyncio.run(run())
    assert parked == (1, 1000)
    assert batch.parked_at is None and batch.resuming is False, "the parked run was not resumed"
