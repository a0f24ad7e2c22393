"""Fuzzing the shim's request bodies: hypothesis sends at least 1,000 bodies per
dialect to a real daemon over real sockets, and none may be answered with a 5xx.

Bodies start valid, from each route's own fields (`dialects`), and are then mutated a
few fields at a time (`mutation.mutated`). Some are then damaged as bytes (truncated,
invalid UTF-8, another encoding, not JSON at all) or sent with another content type.
Mutating a valid body rather than generating noise is what gets past JSON parsing
into each dialect's validation and conversion, and on to the engine.

Engine work stays small so that the run takes a minute: a body that can still be
valid has its generation budget held at 1 token (`dialects.Budget`), unless the
mutation made the budget itself one the shim must refuse; prompts are short unless
they are huge, and then they are over the context, which is refused before any
prefill. Each hypothesis example sends `serving.IN_FLIGHT` bodies at once, so that
the engine decodes them in one batch (almost all of a run's time is the engine's).

A 5xx is a bug in the shim (or below it), and so is a 429 here (`acceptable`). So is
a streamed error after a 200, which the response's status cannot show: the daemon's
log must hold no error record. After the run the daemon must still serve a plain chat
in each dialect, on the same engine replica (no restart).
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.integration.fuzz import serving
from tests.integration.fuzz.dialects import DIALECTS, Route
from tests.integration.fuzz.mutation import damaged, dump, mutated
from tests.integration.harness import Daemon

pytestmark = pytest.mark.slow

# At least this many per dialect; raise it (BLAZAR_FUZZ_BODIES) for a longer hunt.
BODIES_PER_DIALECT = int(os.environ.get("BLAZAR_FUZZ_BODIES", "1000"))

CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 12
    + ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded"]
    + ["multipart/form-data; boundary=x", "application/octet-stream", "", None]
)


@dataclass(frozen=True)
class Case:
    route: Route
    body: bytes
    content_type: str | None
    description: str


@st.composite
def cases(draw: st.DrawFn, routes: list[Route]) -> Case:
    route = draw(st.sampled_from(routes))
    body, mutations = draw(mutated(draw(route.bodies)))
    if route.budget is not None:
        route.budget.hold(body)
    data, damage = draw(damaged(dump(body).encode("utf-8", "surrogatepass")))
    content_type = draw(CONTENT_TYPES)
    what = f"{route.path} mutations={mutations} damage={damage} content-type={content_type!r}"
    return Case(route, data, content_type, what)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=serving.IN_FLIGHT)
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60, limits=limits) as c:
        yield c


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(serving.IN_FLIGHT) as p:
        yield p


def send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    return client.post(case.route.path, content=case.body, headers=headers)


def acceptable(status: int) -> bool:
    """Not a server failure, nor a refusal to retry: this daemon has no SLOPolicy and
    never more requests in flight than its Lane has slots, so admission never refuses (a
    429 was an error message too long for gRPC's trailers, read as RESOURCE_EXHAUSTED)."""
    return status < 500 and status != 429


SENT: collections.Counter[str] = collections.Counter()
STATUSES: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_no_request_body_gets_a_5xx_and_the_daemon_serves_on(
    name: str,
    client: httpx.Client,
    pool: ThreadPoolExecutor,
    daemon: Daemon,
    record_property: Callable[..., None],
) -> None:
    dialect = DIALECTS[name]
    started = time.monotonic()
    (pid,) = daemon.pids(serving.LANE)
    restarts = serving.restarts(daemon)
    for path, body in dialect.regressions:
        response = client.post(path, json=body)
        assert acceptable(response.status_code), (path, response.status_code, response.text[:500])

    # No shrinking (a failure shows its bodies as sent; shrinking against a live daemon
    # would outlast the test's timeout) and no example database (each run explores anew).
    @settings(
        max_examples=-(-BODIES_PER_DIALECT // serving.IN_FLIGHT),
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        batch=st.lists(
            cases(dialect.routes), min_size=serving.IN_FLIGHT, max_size=serving.IN_FLIGHT
        )
    )
    def run(batch: list[Case]) -> None:
        responses = list(pool.map(lambda case: send(client, case), batch))
        for case, response in zip(batch, responses, strict=True):
            SENT[name] += 1
            STATUSES[name][response.status_code] += 1
            assert acceptable(response.status_code), (
                f"{case.description}\nbody: {case.body[:2000]!r}\n"
                f"-> {response.status_code} {response.text[:2000]}\n"
                # A 503 has been an engine gone after it was Ready: say why.
                f"{daemon.replica_story(serving.LANE)}"
            )

    run()
    seconds = time.monotonic() - started
    record_property("seconds", round(seconds, 1))
    print(f"{name}: {SENT[name]} bodies in {seconds:.0f} s, statuses {dict(STATUSES[name])}")
    assert SENT[name] >= BODIES_PER_DIALECT

    path, body = dialect.plain
    plain = client.post(path, json=body)
    assert plain.status_code == 200, plain.text
    assert client.get("/readyz").status_code == 200
    (replica,) = daemon.get("lane", serving.LANE)["status"]["replicaStatuses"]
    assert replica.get("restarts", 0) == restarts, daemon.replica_story(serving.LANE)
    assert replica["pid"] == pid
    # A stream that failed after its 200 went out says so only in the daemon's log.
    logged = daemon.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in logged if line.startswith("{")]
    failures = [r for r in records if r.get("level") in ("error", "critical")]
    assert not failures, failures[:5]
