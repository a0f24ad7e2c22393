"""The work queue's guarantees: de-duplication, no concurrent processing, backoff."""

from __future__ import annotations

import asyncio

from blazar.controller.workqueue import WorkQueue


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_duplicates_collapse() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        q.add("a")
        q.add("b")
        assert len(q) == 2
        assert [await q.get(), await q.get()] == ["a", "b"]

    run(main())


def test_key_added_while_processing_runs_again_after_done() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        key = await q.get()
        q.add("a")  # arrives while "a" is being processed
        assert len(q) == 0  # not handed to a second worker
        q.done(key)
        assert len(q) == 1 and await q.get() == "a"

    run(main())


def test_rate_limited_backoff_doubles_and_forget_resets() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
        assert [q.add_rate_limited("a") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
        q.forget("a")
        assert q.add_rate_limited("a") == 0.01
        assert await asyncio.wait_for(q.get(), timeout=1) == "a"

    run(main())


def test_add_after_keeps_the_earliest_and_add_cancels_it() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add_after("a", 10)
        q.add_after("a", 0.01)
        assert await asyncio.wait_for(q.get(), timeout=1) == "a"
        q.done("a")
        q.add_after("b", 10)
        q.add("b")
        assert await asyncio.wait_for(q.get(), timeout=1) == "b"
        q.shut_down()

    run(main())


def test_a_retry_bound_caps_the_backoff_of_that_failure() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=1.0)
        assert [q.add_rate_limited("a", max_delay=0.02) for _ in range(3)] == [0.01, 0.02, 0.02]
        assert q.add_rate_limited("a") == 0.08  # the failures still count

    run(main())
