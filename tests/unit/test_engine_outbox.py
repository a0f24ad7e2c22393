"""jobs.Outbox: events the decode thread holds reach the event loop only when flushed,
all of them, in order, each to its own sink."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from blazar.engine import jobs


def _delta(text: str) -> jobs.TextDelta:
    return jobs.TextDelta(text, 1)


async def _settle() -> None:
    """Let the event loop read the pipe and run what it handed over."""
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_held_events_reach_their_sinks_only_after_a_flush() -> None:
    asyncio.run(_test_held_events_reach_their_sinks_only_after_a_flush())


async def _test_held_events_reach_their_sinks_only_after_a_flush() -> None:
    outbox = jobs.Outbox(asyncio.get_running_loop())
    try:
        first: list[jobs.Event] = []
        second: list[jobs.Event] = []
        deliver_first, deliver_second = outbox.sender(first.append), outbox.sender(second.append)

        def decode_thread() -> None:
            deliver_first(_delta("a"))
            deliver_second(_delta("x"))
            deliver_first(_delta("b"))

        worker = threading.Thread(target=decode_thread)
        worker.start()
        worker.join()
        await _settle()
        assert first == [] and second == []

        flusher = threading.Thread(target=outbox.flush)
        flusher.start()
        flusher.join()
        await _settle()
        assert [e.text for e in first if isinstance(e, jobs.TextDelta)] == ["a", "b"]
        assert [e.text for e in second if isinstance(e, jobs.TextDelta)] == ["x"]
    finally:
        outbox.close()


def test_events_held_after_a_hand_over_wait_for_the_next_flush() -> None:
    asyncio.run(_test_events_held_after_a_hand_over_wait_for_the_next_flush())


async def _test_events_held_after_a_hand_over_wait_for_the_next_flush() -> None:
    outbox = jobs.Outbox(asyncio.get_running_loop())
    try:
        got: list[jobs.Event] = []
        deliver = outbox.sender(got.append)
        deliver(_delta("1"))
        outbox.flush()
        await _settle()
        deliver(_delta("2"))
        await _settle()
        assert len(got) == 1
        outbox.flush()
        outbox.flush()  # a second wake-up for the same events hands nothing twice
        await _settle()
        assert [e.text for e in got if isinstance(e, jobs.TextDelta)] == ["1", "2"]
    finally:
        outbox.close()


def test_a_flush_with_nothing_held_does_not_wake_the_loop() -> None:
    asyncio.run(_test_a_flush_with_nothing_held_does_not_wake_the_loop())


async def _test_a_flush_with_nothing_held_does_not_wake_the_loop() -> None:
    outbox = jobs.Outbox(asyncio.get_running_loop())
    try:
        outbox.flush()
        # Nothing was written: the pipe is empty.
        with pytest.raises(BlockingIOError):
            os.read(outbox._read_fd, 1)
    finally:
        outbox.close()


def test_many_flushes_before_the_loop_runs_fill_no_pipe() -> None:
    asyncio.run(_test_many_flushes_before_the_loop_runs_fill_no_pipe())


async def _test_many_flushes_before_the_loop_runs_fill_no_pipe() -> None:
    """More wake-ups than a pipe holds (the event loop busy elsewhere meanwhile) are
    not an error: one pending wake-up is enough, and every event still arrives."""
    outbox = jobs.Outbox(asyncio.get_running_loop())
    try:
        got: list[jobs.Event] = []
        deliver = outbox.sender(got.append)
        for i in range(70_000):
            deliver(_delta(str(i)))
            outbox.flush()
        await _settle()
        assert len(got) == 70_000
    finally:
        outbox.close()


def test_a_flush_for_several_streams_returns_once_the_loop_took_their_events() -> None:
    asyncio.run(_test_a_flush_for_several_streams_returns_once_the_loop_took_their_events())


async def _test_a_flush_for_several_streams_returns_once_the_loop_took_their_events() -> None:
    """The decode thread does not start its next step beside the event loop's work for
    several streams: when flush returns, every stream has its event."""
    outbox = jobs.Outbox(asyncio.get_running_loop())
    try:
        streams: list[list[jobs.Event]] = [[] for _ in range(4)]
        senders = [outbox.sender(got.append) for got in streams]

        def decode_thread() -> list[int]:
            for i, deliver in enumerate(senders):
                deliver(_delta(str(i)))
            outbox.flush()
            return [len(got) for got in streams]

        assert await asyncio.to_thread(decode_thread) == [1, 1, 1, 1]
    finally:
        outbox.close()
