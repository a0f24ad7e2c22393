"""The decode loop's waiting line, by state: arrival order, orders, cancellation, stop."""

from __future__ import annotations

from blazar.api import errors
from blazar.engine import jobs, parking, sampling, waiting


def job(name: str, *, arrived: float, seen: list[tuple[str, object]]) -> jobs.Job:
    return jobs.Job(
        request_id=name,
        prompt=[1, 2],
        params=sampling.SamplingParams(temperature=0.0),
        max_tokens=4,
        deliver=lambda event: seen.append((name, event)),
        arrived=arrived,
    )


def test_jobs_wait_in_order_of_arrival_not_of_submission() -> None:
    line = waiting.WaitingLine()
    seen: list[tuple[str, object]] = []
    line.put(job("late", arrived=2.0, seen=seen))
    line.put(job("early", arrived=1.0, seen=seen))
    assert line.collect(block=False)
    assert line.holds("late") and line.holds("early") and not line.holds("other")
    assert [line.pop().request_id, line.pop().request_id] == ["early", "late"]
    assert not line


def test_orders_are_kept_apart_from_jobs_and_taken_once() -> None:
    line = waiting.WaitingLine()
    replies: list[object] = []
    order = parking.Park(request_id="r", reply=replies.append)
    line.put(order)
    assert line.collect(block=False)
    assert not line
    assert line.take_orders() == [order]
    assert line.take_orders() == []


def test_a_cancelled_waiting_job_is_told_it_ended_and_leaves_the_line() -> None:
    line = waiting.WaitingLine()
    seen: list[tuple[str, object]] = []
    gone, kept = job("gone", arrived=1.0, seen=seen), job("kept", arrived=2.0, seen=seen)
    line.put(gone)
    line.put(kept)
    line.collect(block=False)
    gone.cancel()
    line.end_cancelled()
    assert [name for name, _ in seen] == ["gone"]
    assert isinstance(seen[0][1], jobs.Finished)
    assert seen[0][1].reason is jobs.FinishReason.CANCELLED
    assert line.pop() is kept and not line


def test_stop_ends_collect_and_close_answers_everything_left() -> None:
    line = waiting.WaitingLine()
    seen: list[tuple[str, object]] = []
    replies: list[object] = []
    line.put(job("queued", arrived=1.0, seen=seen))
    line.collect(block=False)
    line.put(parking.Resume(request_id="p", reply=replies.append))
    line.put(job("late", arrived=2.0, seen=seen))
    line.stop()
    assert not line.collect(block=True)
    line.close()
    assert sorted(name for name, _ in seen) == ["late", "queued"]
    assert all(
        isinstance(e, jobs.Finished) and e.reason is jobs.FinishReason.CANCELLED for _, e in seen
    )
    assert len(replies) == 1 and isinstance(replies[0], errors.Unavailable)


def test_wake_returns_a_blocked_collect_with_nothing_new() -> None:
    line = waiting.WaitingLine()
    line.wake()
    assert line.collect(block=True)
    assert not line and line.take_orders() == []
