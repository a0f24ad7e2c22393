"""`blazar top`'s tokens per second: finished requests' tokens over a sliding window,
and how the table shows a Lane."""

from __future__ import annotations

import json

import pytest

from blazar.cli import printers
from blazar.dataplane.throughput import Throughput


@pytest.mark.parametrize(
    ("finished", "now", "rate"),
    [
        ([], 0.0, 0.0),
        ([(1.0, 20)], 1.0, 2.0),
        ([(1.0, 20), (5.0, 30)], 10.0, 5.0),
        ([(1.0, 20), (5.0, 30)], 11.0, 3.0),  # the first left the window
        ([(1.0, 20), (5.0, 30)], 15.0, 0.0),
    ],
)
def test_rate_counts_the_last_window(
    finished: list[tuple[float, int]], now: float, rate: float
) -> None:
    meter = Throughput(window_s=10.0)
    for at, tokens in finished:
        meter.record(at, tokens)
    assert meter.rate(now) == pytest.approx(rate)


def load(reporting: int) -> printers.LaneLoad:
    return printers.LaneLoad(
        lane="gemma3", replicas_reporting=reporting, slots_busy=1, slots_total=4, queued=2,
        running=1, tokens_per_second=12.345, memory_bytes=300 * 1024 * 1024,
    )  # fmt: skip


def test_top_table_shows_what_engines_reported_and_dashes_otherwise() -> None:
    header, row = printers.top_table([load(1)]).splitlines()
    assert header.split() == ["LANE", "REPLICAS", "SLOTS", "QUEUE", "RUNNING", "TOKENS/S", "MEMORY"]
    assert row.split() == ["gemma3", "1", "1/4", "2", "1", "12.3", "300.0MiB"]
    _, silent = printers.top_table([load(0)]).splitlines()
    assert silent.split() == ["gemma3", "0", "-", "2", "1", "12.3", "-"]
    assert printers.top_table([]) == "No Lane resources found."


def test_top_json_keys_are_camel_case_as_every_other_json_output() -> None:
    (row,) = json.loads(printers.top_json([load(1)]))
    assert set(row) == {
        "lane", "replicasReporting", "slotsBusy", "slotsTotal", "queued", "running",
        "tokensPerSecond", "memoryBytes",
    }  # fmt: skip
    assert (row["slotsBusy"], row["slotsTotal"], row["queued"]) == (1, 4, 2)
