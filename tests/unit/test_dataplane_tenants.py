"""What a tenant is told over gRPC when it asks for a Lane it may not use: exactly what
it is told for a name no Lane serves, on every Inference method that takes a model
(else it could probe which Lane names exist, which its model lists hide). An admin
tenant, which can list every Lane anyway, is told the truth; the operator's metrics
say what happened either way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import prometheus_client
import pytest

from blazar._proto.v1 import inference_pb2, inference_pb2_grpc
from blazar.api import tenants
from blazar.api.kinds import Lane, LaneSpec
from blazar.api.meta import ObjectMeta
from blazar.dataplane import access, server
from blazar.store.memory import MemoryStore
from tests.unit import fake_inference

AUTH = tenants.parse(
    f"""
tenants:
  - {{name: narrow, keys: ["{tenants.digest("bz-narrow")}"], lanes: [mine]}}
  - {{name: boss, keys: ["{tenants.digest("bz-boss")}"], lanes: [mine], admin: true}}
  - {{name: once, keys: ["{tenants.digest("bz-once")}"], lanes: ["*"], rateLimit: {{requestsPerMinute: 1}},
      sloPolicies: ["*"], keepAlive: true}}
  - {{name: plain, keys: ["{tenants.digest("bz-plain")}"], lanes: ["*"], rateLimit: {{requestsPerMinute: 1}},
      keepAlive: true}}
  - {{name: guest, keys: ["{tenants.digest("bz-guest")}"], lanes: ["*"], rateLimit: {{requestsPerMinute: 1}}}}
""",
    source="test",
)
# What the tenant asks for: Lane "theirs" where it exists, a name nothing serves where
# it does not.
ASKED = "theirs"

Stub = inference_pb2_grpc.InferenceStub
# One call of an Inference method for model `ASKED`, read to its end.
Call = Callable[[Stub, tuple[tuple[str, str], ...]], Any]


async def _stream(call: Any) -> None:
    async for _ in call:
        pass


CALLS: dict[str, Call] = {
    "Chat": lambda s, m: _stream(s.Chat(inference_pb2.ChatRequest(model=ASKED), metadata=m)),
    "Complete": lambda s, m: _stream(
        s.Complete(inference_pb2.CompleteRequest(model=ASKED, prompt="Hi"), metadata=m)
    ),
    "Embed": lambda s, m: s.Embed(
        inference_pb2.EmbedRequest(model=ASKED, inputs=["Hi"]), metadata=m
    ),
    "Tokenize": lambda s, m: s.Tokenize(
        inference_pb2.TokenizeRequest(model=ASKED, text="Hi"), metadata=m
    ),
    "KeepAlive": lambda s, m: s.KeepAlive(
        inference_pb2.KeepAliveRequest(model=ASKED, keep_alive_s=0), metadata=m
    ),
}


def lane(name: str) -> Lane:
    return Lane(metadata=ObjectMeta(name=name), spec=LaneSpec(model="m", replicas=1))


@contextlib.asynccontextmanager
async def plane(*lanes: str) -> AsyncIterator[tuple[Stub, str]]:
    """A data plane serving `lanes` (none of them ready) to `AUTH`'s tenants: its
    stub, and its address."""
    store = MemoryStore()
    store.apply_all([lane(name) for name in lanes])
    data_plane = await server.start(
        store=store, address="127.0.0.1:0", access=access.Access(tenants=AUTH)
    )
    try:
        target = f"127.0.0.1:{data_plane.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            yield inference_pb2_grpc.InferenceStub(channel), target
    finally:
        await data_plane.stop(grace=0)


# What a caller can see of a refusal: its code, its message and its trailing metadata.
Answer = tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]


async def answer(stub: Stub, method: str, key: str) -> Answer:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await CALLS[method](stub, (("authorization", f"Bearer {key}"),))
    err = info.value
    trailing = tuple(sorted((k, v) for k, v in (err.trailing_metadata() or ())))
    return err.code(), err.details() or "", trailing


def answers(key: str, *lanes: str) -> dict[str, Answer]:
    async def run() -> dict[str, Answer]:
        async with plane(*lanes) as (stub, _):
            return {method: await answer(stub, method, key) for method in CALLS}

    return asyncio.run(run())


def refusals(tenant: str, reason: str = "MODEL_NOT_PERMITTED") -> float:
    labels = {"tenant": tenant, "reason": reason}
    return prometheus_client.REGISTRY.get_sample_value("blazar_tenant_refusals_total", labels) or 0


def test_a_lane_the_tenant_may_not_use_is_told_as_one_that_does_not_exist() -> None:
    before = refusals("narrow")
    forbidden = answers("bz-narrow", "mine", ASKED)
    missing = answers("bz-narrow", "mine")
    assert forbidden == missing
    assert {code for code, _, _ in missing.values()} == {grpc.StatusCode.NOT_FOUND}
    # The operator still counts what happened.
    assert refusals("narrow") - before == len(CALLS)


def test_an_admin_tenant_which_can_list_every_lane_is_told_the_truth() -> None:
    forbidden = answers("bz-boss", "mine", ASKED)
    assert {code for code, _, _ in forbidden.values()} == {grpc.StatusCode.PERMISSION_DENIED}
    assert all(("blazar-reason", "MODEL_NOT_PERMITTED") in t for _, _, t in forbidden.values())


async def keep_alive(stub: Stub, key: tuple[str, str]) -> grpc.StatusCode:
    """A KeepAlive of the key's tenant: OK while its rate limit has a request left."""
    try:
        await CALLS["KeepAlive"](stub, (key,))
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_request_refused_as_the_callers_mistake_costs_no_rate_limit() -> None:
    """An unknown policy or too long a session key is refused before the request is
    counted: the tenant's one request a minute is still there afterwards."""

    async def run() -> tuple[set[grpc.StatusCode], grpc.StatusCode]:
        async with plane(ASKED) as (stub, _):
            key = ("authorization", "Bearer bz-once")
            codes = set()
            for method in ("Chat", "Complete", "Embed", "Tokenize", "KeepAlive"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await CALLS[method](stub, (key, ("x-blazar-slo", "no-such-policy")))
                codes.add(info.value.code())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                long_session = inference_pb2.ChatRequest(model=ASKED, session="s" * 300)
                await _stream(stub.Chat(long_session, metadata=(key,)))
            codes.add(info.value.code())
            return codes, await keep_alive(stub, key)

    refused, then = asyncio.run(run())
    assert refused == {grpc.StatusCode.INVALID_ARGUMENT}
    assert then == grpc.StatusCode.OK


def test_a_policy_the_tenant_may_not_name_is_refused_on_every_route_and_costs_nothing() -> None:
    """A tenant without `sloPolicies` names a policy (one that exists or not: the
    answer is the same, and says nothing of which do): PERMISSION_DENIED before the
    request is counted, so its one request a minute is still there afterwards."""
    before = refusals("plain", "SLO_POLICY_NOT_PERMITTED")

    async def run() -> tuple[set[tuple[grpc.StatusCode, str]], grpc.StatusCode]:
        async with plane(ASKED) as (stub, _):
            key = ("authorization", "Bearer bz-plain")
            seen = set()
            for method in ("Chat", "Complete", "Embed", "Tokenize", "KeepAlive"):
                for name in ("batch", "no-such-policy"):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await CALLS[method](stub, (key, ("x-blazar-slo", name)))
                    reason = dict(info.value.trailing_metadata() or ())["blazar-reason"]
                    seen.add((info.value.code(), reason))
                    assert "sloPolicies" in (info.value.details() or "")
            return seen, await keep_alive(stub, key)

    seen, then = asyncio.run(run())
    assert seen == {(grpc.StatusCode.PERMISSION_DENIED, "SLO_POLICY_NOT_PERMITTED")}
    assert then == grpc.StatusCode.OK
    assert refusals("plain", "SLO_POLICY_NOT_PERMITTED") - before == 10


def test_keep_alive_from_a_tenant_without_keep_alive_is_refused_and_costs_nothing() -> None:
    """keep_alive decides how long a Lane stays loaded for every tenant (0 unloads it
    under their requests): a tenant needs `keepAlive` to set it, on every route that
    takes it, and the refusal is not counted against its rate limit."""
    before = refusals("guest", "KEEP_ALIVE_NOT_PERMITTED")
    calls: dict[str, Call] = {
        "Chat": lambda s, m: _stream(
            s.Chat(inference_pb2.ChatRequest(model=ASKED, keep_alive_s=300), metadata=m)
        ),
        "Complete": lambda s, m: _stream(
            s.Complete(
                inference_pb2.CompleteRequest(model=ASKED, prompt="Hi", keep_alive_s=-1),
                metadata=m,
            )
        ),
        "Embed": lambda s, m: s.Embed(
            inference_pb2.EmbedRequest(model=ASKED, inputs=["Hi"], keep_alive_s=0), metadata=m
        ),
        "KeepAlive": CALLS["KeepAlive"],
    }

    async def run() -> tuple[set[tuple[grpc.StatusCode, str]], grpc.StatusCode]:
        async with plane(ASKED) as (stub, _):
            key = ("authorization", "Bearer bz-guest")
            seen = set()
            for call in calls.values():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(stub, (key,))
                reason = dict(info.value.trailing_metadata() or ())["blazar-reason"]
                seen.add((info.value.code(), reason))
                assert "keepAlive" in (info.value.details() or "")
            # Its one request a minute is still there: refused for the Lane's state
            # (no ready replica), not for its rate limit.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await CALLS["Tokenize"](stub, (key,))
            return seen, info.value.code()

    seen, then = asyncio.run(run())
    assert seen == {(grpc.StatusCode.PERMISSION_DENIED, "KEEP_ALIVE_NOT_PERMITTED")}
    assert then == grpc.StatusCode.UNAVAILABLE
    assert refusals("guest", "KEEP_ALIVE_NOT_PERMITTED") - before == len(calls)


def test_a_request_refused_for_the_servers_state_costs_no_rate_limit() -> None:
    """The Lane has no ready replica: each call is refused UNAVAILABLE after it was
    counted, and gives its count back, so the tenant's one request a minute is still
    there afterwards."""

    async def run() -> tuple[set[grpc.StatusCode], grpc.StatusCode]:
        async with plane(ASKED) as (stub, _):
            key = ("authorization", "Bearer bz-once")
            codes = set()
            for method in ("Chat", "Complete", "Embed", "Tokenize"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await CALLS[method](stub, (key,))
                codes.add(info.value.code())
            return codes, await keep_alive(stub, key)

    refused, then = asyncio.run(run())
    assert refused == {grpc.StatusCode.UNAVAILABLE}
    assert then == grpc.StatusCode.OK


# (path, body) of every shim route that asks the data plane about one model.
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/embeddings", {"input": "Hi"}),
    ("/v1/responses", {"input": "Hi"}),
    ("/v1/responses/input_tokens", {"input": "Hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
    ("/api/generate", {"prompt": "Hi", "stream": False}),
    ("/api/generate", {"prompt": "Hi", "stream": True}),
    ("/api/embed", {"input": "Hi"}),
    ("/api/embeddings", {"prompt": "Hi"}),
    ("/api/show", {}),
    ("/v1/models/" + ASKED, {}),
]


def without_ids(value: Any) -> Any:
    """A body with the ids each answer makes anew (Anthropic's `request_id`) left out."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "request_id"}
    return value


def http_answers(*lanes: str) -> list[tuple[int, Any]]:
    async def run() -> list[tuple[int, Any]]:
        async with plane(*lanes) as (_, target), fake_inference.asgi_client(target) as client:
            headers = {"authorization": "Bearer bz-narrow", "x-api-key": "bz-narrow"}
            out = []
            for path, body in ROUTES:
                if path.startswith("/v1/models/"):
                    response = await client.get(path, headers=headers)
                else:
                    response = await client.post(
                        path, json={"model": ASKED, **body}, headers=headers
                    )
                out.append((response.status_code, without_ids(response.json())))
            return out

    return asyncio.run(run())


def test_every_dialect_tells_a_lane_the_tenant_may_not_use_as_one_that_does_not_exist() -> None:
    forbidden = http_answers("mine", ASKED)
    assert forbidden == http_answers("mine")
    assert {status for status, _ in forbidden} == {404}


def test_a_keep_alive_that_is_not_a_number_of_seconds_is_invalid_on_every_route() -> None:
    """NaN or an infinite keep_alive_s is no duration (a negative one keeps a Lane
    loaded): refused naming the field rather than read as some other keep, before the
    rate limit counts it."""
    calls: dict[str, Call] = {
        "Chat": lambda s, m: _stream(
            s.Chat(inference_pb2.ChatRequest(model=ASKED, keep_alive_s=float("nan")), metadata=m)
        ),
        "Complete": lambda s, m: _stream(
            s.Complete(
                inference_pb2.CompleteRequest(model=ASKED, prompt="Hi", keep_alive_s=float("inf")),
                metadata=m,
            )
        ),
        "Embed": lambda s, m: s.Embed(
            inference_pb2.EmbedRequest(model=ASKED, inputs=["Hi"], keep_alive_s=float("-inf")),
            metadata=m,
        ),
        "KeepAlive": lambda s, m: s.KeepAlive(
            inference_pb2.KeepAliveRequest(model=ASKED, keep_alive_s=float("nan")), metadata=m
        ),
    }

    async def run() -> list[tuple[grpc.StatusCode, str]]:
        async with plane(ASKED) as (stub, _):
            key = (("authorization", "Bearer bz-plain"),)
            seen = []
            for call in calls.values():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(stub, key)
                seen.append((info.value.code(), info.value.details() or ""))
            return seen

    seen = asyncio.run(run())
    assert [code for code, _ in seen] == [grpc.StatusCode.INVALID_ARGUMENT] * len(calls)
    assert all("keep_alive_s" in details for _, details in seen), seen
