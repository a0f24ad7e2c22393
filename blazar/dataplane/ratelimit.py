"""Per-tenant rate limits as token buckets: requests per minute and tokens per minute.

A bucket holds up to its per-minute allowance and refills continuously at that
allowance per 60 s, so a tenant may burst up to a minute's worth and then goes at the
allowed rate. A request takes one from the requests bucket when it is admitted, and is
refused when less than one is there; a request the server then refuses for its own
state (no ready replica, a full queue, a missed target) gets it back, as the HTTP
shim's early refusals of the same never took it. Tokens are charged once they are known (prompt
plus completion, from a generation's final usage; an embedding's input tokens), so a
request is admitted while the tokens bucket holds at least one token, and a large one
may take it below zero: the debt is paid back, at the same rate, before the next
request. The refusal says when a retry finds enough in the bucket.

Pure: every call takes `now` (seconds on any monotonic clock); no clock, IO or logging.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blazar.api import tenants

REQUESTS_PER_MINUTE = "requestsPerMinute"
TOKENS_PER_MINUTE = "tokensPerMinute"


@dataclass(frozen=True)
class Bucket:
    per_minute: int
    # What the bucket held at `at`; below zero when tokens charged after the fact
    # overdrew it.
    level: float
    at: float

    @classmethod
    def full(cls, per_minute: int, *, now: float) -> Bucket:
        return cls(per_minute, float(per_minute), now)

    @property
    def rate_per_s(self) -> float:
        return self.per_minute / 60.0

    def level_at(self, now: float) -> float:
        elapsed = max(0.0, now - self.at)
        return min(float(self.per_minute), self.level + elapsed * self.rate_per_s)

    def take(self, amount: float, *, now: float) -> Bucket:
        """The bucket after `amount` is taken at `now` (it may go below zero)."""
        return Bucket(self.per_minute, self.level_at(now) - amount, max(now, self.at))

    def wait_s(self, need: float, *, now: float) -> float:
        """Seconds from `now` until the bucket holds `need`; 0 when it does now."""
        missing = need - self.level_at(now)
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def resized(self, per_minute: int, *, now: float) -> Bucket:
        """The same bucket under a new allowance: what it holds is kept, up to it."""
        return Bucket(per_minute, min(self.level_at(now), float(per_minute)), max(now, self.at))


@dataclass(frozen=True)
class Refusal:
    limit: str  # REQUESTS_PER_MINUTE or TOKENS_PER_MINUTE
    per_minute: int
    retry_after_s: float


@dataclass(frozen=True)
class Limiter:
    """One tenant's buckets; None where its rateLimit sets no limit."""

    requests: Bucket | None = None
    tokens: Bucket | None = None

    @classmethod
    def of(cls, limit: tenants.RateLimit | None, *, now: float) -> Limiter:
        return cls().updated(limit, now=now)

    def updated(self, limit: tenants.RateLimit | None, *, now: float) -> Limiter:
        """The limiter under a new rateLimit (the auth file changed): a bucket that
        stays keeps what it holds (up to its new allowance); a new one starts full."""

        def bucket(old: Bucket | None, per_minute: int | None) -> Bucket | None:
            if per_minute is None:
                return None
            if old is None:
                return Bucket.full(per_minute, now=now)
            return old.resized(per_minute, now=now)

        if limit is None:
            return Limiter()
        return Limiter(
            bucket(self.requests, limit.requests_per_minute),
            bucket(self.tokens, limit.tokens_per_minute),
        )

    def admit(self, *, now: float) -> tuple[Limiter, Refusal | None]:
        """Take one request, or refuse it (nothing taken) with the longer of the waits."""
        refusals = []
        if self.requests is not None:
            wait = self.requests.wait_s(1.0, now=now)
            if wait > 0:
                refusals.append(Refusal(REQUESTS_PER_MINUTE, self.requests.per_minute, wait))
        if self.tokens is not None:
            wait = self.tokens.wait_s(1.0, now=now)
            if wait > 0:
                refusals.append(Refusal(TOKENS_PER_MINUTE, self.tokens.per_minute, wait))
        if refusals:
            return self, max(refusals, key=lambda r: r.retry_after_s)
        if self.requests is None:
            return self, None
        return replace(self, requests=self.requests.take(1.0, now=now)), None

    def refund(self, *, now: float) -> Limiter:
        """Give back the request `admit` took: it was refused for the server's state
        (never past the bucket's allowance: `Bucket.level_at` caps what it holds)."""
        if self.requests is None:
            return self
        return replace(self, requests=self.requests.take(-1.0, now=now))

    def charge(self, tokens: int, *, now: float) -> Limiter:
        """The tokens a request used, once known."""
        if self.tokens is None or tokens <= 0:
            return self
        return replace(self, tokens=self.tokens.take(float(tokens), now=now))
