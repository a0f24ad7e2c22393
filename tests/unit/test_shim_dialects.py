"""What every dialect's routes guarantee alike, against the fake daemon: the headers a
generation carries whether it streams or not, and the SLOPolicy header reaching the
data plane (which checks it) on every route that calls it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from blazar._proto.v1 import inference_pb2
from tests.unit.fake_inference import Daemon, asgi_client, delta, fake_daemon, final

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]

# (path, body) of every generation route, not streaming; `stream` is added per dialect.
GENERATIONS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "tiny", "messages": HI}),
    ("/v1/completions", {"model": "tiny", "prompt": "Once"}),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "store": False}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HI}),
    ("/api/chat", {"model": "tiny", "messages": HI}),
    ("/api/generate", {"model": "tiny", "prompt": "Once"}),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with fake_daemon() as d:
        yield d


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(daemon.target) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), GENERATIONS, ids=[p for p, _ in GENERATIONS])
async def test_every_generation_carries_the_daemons_routing_headers_streamed_or_not(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool
) -> None:
    """When its first token was expected, where it ran, and the reused prompt tokens:
    the daemon names them with its first chunk, so a stream's headers carry them as a
    whole answer's do (for Ollama, the only way to tell reused tokens)."""
    daemon.fake.scripts["tiny"] = [delta("Hi"), final()]
    daemon.fake.replica = 0
    daemon.fake.predicted_ttft_ms = 42
    daemon.fake.prefix_reused = 37
    response = await client.post(path, json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    assert response.headers["x-blazar-predicted-ttft-ms"] == "42"
    assert response.headers["x-blazar-replica"] == "0"
    assert response.headers["x-blazar-prefix-reused"] == "37"


@pytest.mark.parametrize("stream", [False, True])
async def test_no_prediction_no_header(
    daemon: Daemon, client: httpx.AsyncClient, stream: bool
) -> None:
    daemon.fake.scripts["tiny"] = [delta("Hi"), final()]
    daemon.fake.replica = 0
    response = await client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": HI, "stream": stream}
    )
    assert response.status_code == 200, response.text
    assert "x-blazar-predicted-ttft-ms" not in response.headers


# Every route that reaches Embed or Tokenize, which have no `slo` field of their own.
NOT_ADMITTED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/embeddings", {"model": "tiny", "input": "a"}),
    ("/api/embed", {"model": "tiny", "input": "a"}),
    ("/api/embeddings", {"model": "tiny", "prompt": "a"}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": HI}),
]


@pytest.mark.parametrize(("path", "body"), NOT_ADMITTED, ids=[p for p, _ in NOT_ADMITTED])
async def test_the_policy_header_reaches_the_data_plane_on_every_route(
    daemon: Daemon, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.embeddings = inference_pb2.EmbedResponse(
        embeddings=[inference_pb2.Embedding(values=[1.0, 0.0], tokens=2)], prompt_tokens=2
    )
    response = await client.post(
        path, json=body, headers={"x-blazar-slo": "batch\u00e9".encode("latin-1")}
    )
    assert response.status_code == 200, response.text
    # Printable ASCII, as gRPC metadata must be; the data plane refuses such a name.
    assert daemon.fake.metadata[-1]["x-blazar-slo"] == "batch\\xe9"


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
@pytest.mark.parametrize("key", ["\u00fcnused", "un\x7fused"], ids=["latin-1", "control"])
async def test_a_placeholder_key_grpc_metadata_cannot_carry_is_ignored(
    daemon: Daemon, client: httpx.AsyncClient, header: str, key: str
) -> None:
    """Without an auth file any placeholder key is accepted and ignored (docs/keys.md,
    "Keys and tenants"): one with a byte outside printable ASCII too, not a 500."""
    daemon.fake.scripts["tiny"] = [delta("Hi"), final()]
    value = (key if header == "x-api-key" else f"Bearer {key}").encode("latin-1")
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": HI}),
    ):
        response = await client.request(method, path, json=body, headers={header: value})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings"])
async def test_an_embedding_says_where_it_ran_as_a_generation_does(
    daemon: Daemon, client: httpx.AsyncClient, path: str
) -> None:
    daemon.fake.scripts["tiny"] = []
    daemon.fake.embeddings = inference_pb2.EmbedResponse(
        embeddings=[inference_pb2.Embedding(values=[1.0, 0.0], tokens=2)],
        prompt_tokens=2,
        routing=inference_pb2.Routing(lane="tiny", replica=3),
    )
    body = {"model": "tiny", "prompt" if path == "/api/embeddings" else "input": "Hi"}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-blazar-lane"] == "tiny"
    assert response.headers["x-blazar-replica"] == "3"
