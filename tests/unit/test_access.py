"""`blazar.dataplane.access`: who may call which method, by the state of the auth file,
the transport (Unix socket or TCP) and the key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from blazar.api import errors, tenants
from blazar.dataplane import access

KEYS = {"admin": "bz-admin", "user": "bz-user", "limited": "bz-limited"}
FILE = tenants.parse(
    f"""
tenants:
  - {{name: admin, keys: ["{tenants.digest(KEYS["admin"])}"], lanes: ["*"], admin: true}}
  - {{name: user, keys: ["{tenants.digest(KEYS["user"])}"], lanes: [gemma3], weight: 3}}
  - name: limited
    keys: ["{tenants.digest(KEYS["limited"])}"]
    lanes: ["*"]
    rateLimit: {{requestsPerMinute: 1, tokensPerMinute: 100}}
""",
    source="test",
)
CHAT = "/blazar.v1.Inference/Chat"
LIST_MODELS = "/blazar.v1.Inference/ListModels"
APPLY = "/blazar.v1.Control/Apply"
HEALTH = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
UNKNOWN = "/blazar.v1.Other/Call"
TCP = "ipv4:127.0.0.1:5555"
UNIX = "unix:"
NONE = "none"
WRONG = "bz-wrong"
# What a call's outcome is: a tenant's name ("" for the owner / anyone), or the reason
# of its refusal.
Outcome = str


def outcome(gate: access.Access, method: str, key: str, peer: str) -> Outcome:
    metadata = [] if key == NONE else [("authorization", f"Bearer {key}")]
    try:
        return gate.caller(method, metadata, peer=peer).name
    except errors.BlazarError as err:
        return err.reason


@pytest.mark.parametrize(
    ("method", "key", "peer", "expected"),
    [
        # No auth file: Inference is anyone's (the daemon listens on loopback only then);
        # a key unlocks nothing but is no error (clients send placeholders).
        (CHAT, NONE, TCP, ""),
        (CHAT, "unused", TCP, ""),
        # Control only on the socket.
        (APPLY, NONE, UNIX, ""),
        (APPLY, NONE, TCP, "ADMIN_REQUIRED"),
        (APPLY, "unused", TCP, "ADMIN_REQUIRED"),
        (UNKNOWN, NONE, TCP, "ADMIN_REQUIRED"),
        (HEALTH, NONE, TCP, ""),
        (REFLECTION, NONE, TCP, ""),
    ],
)
def test_without_an_auth_file(method: str, key: str, peer: str, expected: Outcome) -> None:
    assert outcome(access.Access(), method, key, peer) == expected


@pytest.mark.parametrize(
    ("method", "key", "peer", "expected"),
    [
        (CHAT, NONE, TCP, "UNAUTHENTICATED"),
        (CHAT, WRONG, TCP, "UNAUTHENTICATED"),
        (CHAT, KEYS["user"], TCP, "user"),
        (CHAT, KEYS["admin"], TCP, "admin"),
        (LIST_MODELS, NONE, TCP, "UNAUTHENTICATED"),
        # On the owner's socket no key is needed; a key given names its tenant.
        (CHAT, NONE, UNIX, ""),
        (CHAT, KEYS["user"], UNIX, "user"),
        (CHAT, WRONG, UNIX, "UNAUTHENTICATED"),
        (APPLY, NONE, TCP, "UNAUTHENTICATED"),
        (APPLY, WRONG, TCP, "UNAUTHENTICATED"),
        (APPLY, KEYS["user"], TCP, "ADMIN_REQUIRED"),
        (APPLY, KEYS["admin"], TCP, "admin"),
        (APPLY, NONE, UNIX, ""),
        (UNKNOWN, KEYS["user"], TCP, "ADMIN_REQUIRED"),
        (HEALTH, NONE, TCP, ""),
        (HEALTH, WRONG, TCP, ""),
    ],
)
def test_with_an_auth_file(method: str, key: str, peer: str, expected: Outcome) -> None:
    assert outcome(access.Access(tenants=FILE), method, key, peer) == expected


def test_a_malformed_authorization_is_a_wrong_key() -> None:
    gate = access.Access(tenants=FILE)
    with pytest.raises(errors.Unauthenticated):
        gate.caller(CHAT, [("authorization", "Basic YWxhZGRpbjo=")], peer=TCP)


def test_the_probe_key_lists_models_and_nothing_else() -> None:
    gate = access.Access(tenants=FILE, probe_key="probe")
    caller = gate.caller(LIST_MODELS, [("authorization", "Bearer probe")], peer=TCP)
    assert caller.probe and caller.may_use(["gemma3"])
    for method in (CHAT, APPLY):
        assert outcome(gate, method, "probe", TCP) == "PERMISSION_DENIED"
    with pytest.raises(errors.PermissionDenied):
        gate.permit(caller, model="gemma3", names=["gemma3"])


def test_permit_checks_the_lane_and_count_the_rate_limit() -> None:
    now = [0.0]
    gate = access.Access(tenants=FILE, clock=lambda: now[0])
    user = access.Caller(FILE.by_name("user"))
    gate.permit(user, model="default", names=["gemma3", "default"])
    with pytest.raises(errors.ModelNotPermitted) as info:
        gate.permit(user, model="other", names=["other"])
    assert info.value.metadata == {"tenant": "user", "model": "other"}
    limited = access.Caller(FILE.by_name("limited"))
    # Permitting counts nothing: a request refused after it (its policy, say) is free.
    for _ in range(3):
        gate.permit(limited, model="x", names=["x"])
    gate.count(limited)
    with pytest.raises(errors.RateLimited) as refused:
        gate.count(limited)
    assert refused.value.metadata["limit"] == "requestsPerMinute"
    assert refused.value.metadata[errors.RETRY_AFTER_KEY] == "60000"
    now[0] = 60.0
    gate.count(limited)
    # 100 tokens a minute: a request that used 250 holds the next one back.
    gate.charge(limited, prompt_tokens=200, output_tokens=50)
    now[0] = 120.0
    with pytest.raises(errors.RateLimited) as refused:
        gate.count(limited)
    assert refused.value.metadata["limit"] == "tokensPerMinute"
    # The owner (no tenant) is never limited.
    for _ in range(10):
        gate.permit(access.OWNER, model="x", names=["x"])
        gate.count(access.OWNER)


@pytest.mark.parametrize(
    ("err", "refunded"),
    [
        (errors.Unavailable("no ready replica"), True),
        (errors.QueueFull.of(lane="l", policy="p", max_queue_depth=1, retry_after_s=1), True),
        (errors.QueueTimeout("waited"), True),
        (errors.SloUnattainable("late"), True),
        (errors.DeadlineExceeded.of(lane="l", deadline_s=1, waited_s=0, predicted_ttft_s=3), True),
        (errors.DeadlineExceeded.of(lane="l", deadline_s=1, waited_s=1), True),
        (errors.RateLimited("spent"), False),
        (errors.InvalidRequest("prompt over the context"), False),
        (errors.ContextLengthExceeded("too long"), False),
    ],
)
def test_a_refusal_for_the_servers_state_gives_the_request_back(
    err: errors.BlazarError, refunded: bool
) -> None:
    gate = access.Access(tenants=FILE, clock=lambda: 0.0)
    limited = access.Caller(FILE.by_name("limited"))
    gate.count(limited)
    gate.refund(limited, err)
    if refunded:
        gate.count(limited)
    else:
        with pytest.raises(errors.RateLimited):
            gate.count(limited)
    # The owner has nothing to give back.
    gate.refund(access.OWNER, err)


def test_a_new_auth_file_takes_effect_and_keeps_spent_buckets() -> None:
    now = [0.0]
    gate = access.Access(tenants=FILE, clock=lambda: now[0])
    limited = access.Caller(FILE.by_name("limited"))
    gate.count(limited)
    assert outcome(gate, CHAT, "bz-new", TCP) == "UNAUTHENTICATED"
    fresh = tenants.parse(
        f"""
tenants:
  - {{name: new, keys: ["{tenants.digest("bz-new")}"]}}
  - {{name: limited, keys: ["{tenants.digest(KEYS["limited"])}"], lanes: ["*"], rateLimit: {{requestsPerMinute: 5}}}}
""",
        source="test",
    )
    gate.use(fresh)
    assert outcome(gate, CHAT, "bz-new", TCP) == "new"
    assert outcome(gate, CHAT, KEYS["user"], TCP) == "UNAUTHENTICATED"
    limited = access.Caller(fresh.by_name("limited"))
    # Spent under the old file, and a larger allowance does not refill it: it refills
    # at the new rate, one every 12 s.
    with pytest.raises(errors.RateLimited) as refused:
        gate.count(limited)
    assert refused.value.metadata[errors.RETRY_AFTER_KEY] == "12000"
    now[0] = 12.0
    gate.count(limited)
    gate.use(None)
    assert outcome(gate, CHAT, NONE, TCP) == ""


def test_the_callers_weight_is_its_tenants() -> None:
    assert access.Caller(FILE.by_name("user")).weight == 3
    assert access.OWNER.weight == 1


@pytest.mark.parametrize(
    ("keyed", "authorization", "expected"),
    [
        # No auth file: the shim asks nothing of anyone.
        (False, None, ""),
        (False, "Bearer unused", ""),
        (True, f"Bearer {KEYS['user']}", ""),
        (True, f"Bearer {KEYS['admin']}", ""),
        (True, None, "UNAUTHENTICATED"),
        (True, f"Bearer {WRONG}", "UNAUTHENTICATED"),
        (True, "Basic dXNlcjpwYXNz", "UNAUTHENTICATED"),
        (True, "", "UNAUTHENTICATED"),
    ],
)
def test_require_key_refuses_a_caller_without_a_key_in_force(
    keyed: bool, authorization: str | None, expected: Outcome
) -> None:
    gate = access.Access(tenants=FILE if keyed else None, probe_key="probe")
    try:
        gate.require_key(authorization)
        got = ""
    except errors.Unauthenticated as err:
        got = err.reason
    assert got == expected


def test_require_key_follows_the_auth_file_in_force() -> None:
    gate = access.Access(tenants=FILE)
    gate.require_key(f"Bearer {KEYS['user']}")
    others = f'tenants: [{{name: other, keys: ["{tenants.digest("bz-other")}"], lanes: ["*"]}}]'
    gate.use(tenants.parse(others, source="test"))
    gate.require_key("Bearer bz-other")
    with pytest.raises(errors.Unauthenticated):
        gate.require_key(f"Bearer {KEYS['user']}")


NOT_PERMITTED = errors.ModelNotPermitted("Tenant 'user' may not use the model 'other'.")
LIMITED = errors.RateLimited("spent")


@pytest.mark.parametrize(
    ("tenant", "refusal", "told"),
    [
        # A Lane it may not use reads as one that does not exist, word for word.
        ("user", NOT_PERMITTED, errors.ModelNotFound.of("other")),
        # An admin tenant can list every Lane through Control: it is told the truth.
        ("admin", NOT_PERMITTED, NOT_PERMITTED),
        ("user", LIMITED, LIMITED),
    ],
)
def test_what_a_tenant_is_told_of_a_refusal(
    tenant: str, refusal: errors.BlazarError, told: errors.BlazarError
) -> None:
    shown = access.shown(access.Caller(FILE.by_name(tenant)), refusal, model="other")
    assert (type(shown), shown.message, shown.metadata) == (type(told), told.message, told.metadata)


class _Context:
    """What the interceptor reads of a call: its metadata and its peer."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


def test_a_stream_its_caller_left_closes_cleanly_from_another_task() -> None:
    """A caller that leaves while its stream waits at a `yield` has grpc.aio drop the
    handler's generator unclosed; the event loop then closes it in a task of its own,
    whose Context never held the caller. That close must still run the handler's
    cleanup and end without an error (it was logged as `Task exception was never
    retrieved`, a ValueError from the caller's ContextVar, for such streams)."""
    cleaned: list[str] = []

    async def chat(request: object, context: object) -> AsyncIterator[int]:
        try:
            for n in range(3):
                yield n
        finally:
            cleaned.append("chat")

    async def continuation(details: object) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_stream_rpc_method_handler(chat)

    class Details:
        method = "/blazar.v1.Inference/Chat"

    async def run() -> None:
        interceptor = access.AccessInterceptor(access.Access.open())
        handler = await interceptor.intercept_service(continuation, Details())  # type: ignore[arg-type]
        assert handler is not None and handler.unary_stream is not None
        stream: Any = handler.unary_stream(None, _Context())  # type: ignore[arg-type]

        async def first() -> int:
            return int(await stream.__anext__())

        async def close() -> None:
            await stream.aclose()

        # The call's own task reads a response; then, the caller gone, the loop's
        # finalizer closes the generator in another task (another Context).
        assert await asyncio.get_running_loop().create_task(first()) == 0
        await asyncio.get_running_loop().create_task(close())
        assert access.current() is access.OWNER

    asyncio.run(run())
    assert cleaned == ["chat"]
