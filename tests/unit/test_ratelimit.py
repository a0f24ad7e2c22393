"""`blazar.dataplane.ratelimit`: token buckets by state (no clock: `now` is given)."""

from __future__ import annotations

import pytest

from blazar.api.tenants import RateLimit
from blazar.dataplane import ratelimit
from blazar.dataplane.ratelimit import Bucket, Limiter


@pytest.mark.parametrize(
    ("bucket", "now", "level"),
    [
        (Bucket(60, 0.0, 10.0), 10.0, 0.0),
        (Bucket(60, 0.0, 10.0), 15.0, 5.0),  # one a second
        (Bucket(60, 0.0, 10.0), 1000.0, 60.0),  # never past its allowance
        (Bucket(60, -30.0, 10.0), 40.0, 0.0),  # a debt is paid back first
        (Bucket(60, 5.0, 10.0), 5.0, 5.0),  # a clock that went back adds nothing
    ],
)
def test_level_refills_at_the_allowance_per_minute(
    bucket: Bucket, now: float, level: float
) -> None:
    assert bucket.level_at(now) == pytest.approx(level)


@pytest.mark.parametrize(
    ("bucket", "need", "now", "wait"),
    [
        (Bucket(60, 1.0, 0.0), 1.0, 0.0, 0.0),
        (Bucket(60, 0.5, 0.0), 1.0, 0.0, 0.5),
        (Bucket(6, 0.0, 0.0), 1.0, 0.0, 10.0),
        (Bucket(60, -119.0, 0.0), 1.0, 0.0, 120.0),
        (Bucket(60, 0.0, 0.0), 1.0, 0.25, 0.75),
    ],
)
def test_wait_until_the_bucket_holds_what_is_needed(
    bucket: Bucket, need: float, now: float, wait: float
) -> None:
    assert bucket.wait_s(need, now=now) == pytest.approx(wait)


def test_take_may_overdraw_and_resize_keeps_the_level_up_to_the_new_allowance() -> None:
    bucket = Bucket.full(10, now=0.0).take(25, now=0.0)
    assert bucket.level_at(0.0) == -15
    assert bucket.resized(100, now=0.0).level_at(0.0) == -15
    assert Bucket.full(100, now=0.0).resized(10, now=0.0).level_at(0.0) == 10


def test_requests_per_minute_admits_a_minutes_burst_then_one_at_the_rate() -> None:
    limiter = Limiter.of(RateLimit(requests_per_minute=3), now=0.0)
    for _ in range(3):
        limiter, refusal = limiter.admit(now=0.0)
        assert refusal is None
    limiter, refusal = limiter.admit(now=0.0)
    assert refusal == ratelimit.Refusal(ratelimit.REQUESTS_PER_MINUTE, 3, pytest.approx(20.0))
    # Refused: nothing taken, so the wait does not grow.
    again, refusal2 = limiter.admit(now=10.0)
    assert again == limiter and refusal2 is not None
    assert refusal2.retry_after_s == pytest.approx(10.0)
    limiter, refusal = limiter.admit(now=20.0)
    assert refusal is None


def test_a_refund_gives_back_one_request_up_to_the_allowance() -> None:
    limiter = Limiter.of(RateLimit(requests_per_minute=2), now=0.0)
    limiter, _ = limiter.admit(now=0.0)
    limiter, _ = limiter.admit(now=0.0)
    assert limiter.admit(now=0.0)[1] is not None
    limiter = limiter.refund(now=0.0)
    limiter, refusal = limiter.admit(now=0.0)
    assert refusal is None
    # Never past the allowance, as refilling is not.
    full = Limiter.of(RateLimit(requests_per_minute=2), now=0.0).refund(now=5.0)
    assert full.requests is not None and full.requests.level_at(5.0) == 2.0
    # Without a requests limit there is nothing to give back.
    tokens_only = Limiter.of(RateLimit(tokens_per_minute=10), now=0.0)
    assert tokens_only.refund(now=1.0) == tokens_only


def test_tokens_are_charged_when_known_and_a_debt_blocks_the_next_request() -> None:
    limiter = Limiter.of(RateLimit(tokens_per_minute=600), now=0.0)
    limiter, refusal = limiter.admit(now=0.0)
    assert refusal is None
    limiter = limiter.charge(1000, now=1.0)  # still full (600) at t=1: -400 after
    limiter, refusal = limiter.admit(now=1.0)
    assert refusal is not None
    assert refusal.limit == ratelimit.TOKENS_PER_MINUTE
    assert refusal.retry_after_s == pytest.approx(40.1)  # 401 tokens at 10 a second
    limiter, refusal = limiter.admit(now=41.1)
    assert refusal is None


def test_the_longer_wait_of_both_limits_is_the_refusal() -> None:
    limiter = Limiter.of(RateLimit(requests_per_minute=60, tokens_per_minute=60), now=0.0)
    limiter = limiter.charge(120, now=0.0)  # tokens at -60: 61 s to hold one
    _, refusal = limiter.admit(now=0.0)
    assert refusal is not None and refusal.limit == ratelimit.TOKENS_PER_MINUTE
    assert refusal.retry_after_s == pytest.approx(61.0)


def test_no_limit_admits_everything_and_charges_nothing() -> None:
    limiter = Limiter.of(None, now=0.0)
    for _ in range(1000):
        limiter, refusal = limiter.admit(now=0.0)
        assert refusal is None
    assert limiter.charge(10**9, now=0.0) == Limiter()


def test_a_new_rate_limit_keeps_what_the_tenant_spent() -> None:
    limiter = Limiter.of(RateLimit(requests_per_minute=2), now=0.0)
    limiter, _ = limiter.admit(now=0.0)
    limiter, _ = limiter.admit(now=0.0)
    raised = limiter.updated(RateLimit(requests_per_minute=4), now=0.0)
    _, refusal = raised.admit(now=0.0)
    assert refusal is not None  # still spent: raising the allowance does not refill it
    assert limiter.updated(None, now=0.0) == Limiter()
    added = Limiter().updated(RateLimit(tokens_per_minute=5), now=0.0)
    assert added.tokens == Bucket.full(5, now=0.0)
