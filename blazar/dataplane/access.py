"""Who calls the daemon's gRPC API and what they may do: the one owner of API keys,
tenants and their rate limits. The HTTP shim only forwards the caller's key (gRPC
metadata `authorization: Bearer <key>`) and renders the refusals.

Every RPC passes `AccessInterceptor` first, which sorts methods into three kinds:

- Open: `grpc.health.v1.Health` and server reflection (what the API looks like is
  public; the shim's `/healthz` reads health), and `Inference.WatchAdmission`, which
  lists no gate while an auth file is in force.
- Inference (`blazar.v1.Inference`): with no auth file, anyone who reaches the port;
  the daemon then binds loopback only (`blazar.cli.daemon`). With one, a key that one
  of its tenants holds, else UNAUTHENTICATED. The tenant uses the Lanes it lists
  (`InferenceService` asks `permit`) within its rate limits (RESOURCE_EXHAUSTED,
  RATE_LIMITED, with retry_after_ms; `count`, once the request's own checks passed),
  and ListModels shows it only those Lanes. A Lane
  it may not use is refused as a model that does not exist (NOT_FOUND,
  MODEL_NOT_FOUND, word for word; `shown`), unless it is an admin tenant, which can
  list every Lane anyway (PERMISSION_DENIED, MODEL_NOT_PERMITTED); metrics and logs
  say MODEL_NOT_PERMITTED either way. Over the Unix socket a call without a key is
  the owner's, unrestricted.
- Control (`blazar.v1.Control`, and any method not named above): over the daemon's
  Unix socket (0600, in the private `$BLAZAR_HOME`, so its owner's alone) always;
  over TCP only with an admin tenant's key (ADMIN_REQUIRED otherwise, or
  UNAUTHENTICATED for a key no tenant holds). Without an auth file there is no admin
  key, so Control is the socket's alone.

The daemon's own HTTP readiness probe (`/readyz`) lists models with `probe_key`, a key
made at start and held in memory only, which may call ListModels and nothing else.

The interceptor puts the `Caller` in a context variable for the handler (`current`).
The auth file can be replaced while serving (`use`); rate-limit buckets are kept for
tenants that stay.
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeAlias

import grpc
import structlog

from blazar.api import errors, tenants
from blazar.api.tenants import Tenant, Tenants
from blazar.dataplane import metrics, ratelimit
from blazar.rpc import status

AUTHORIZATION_KEY = "authorization"
INFERENCE_PREFIX = "/blazar.v1.Inference/"
CONTROL_PREFIX = "/blazar.v1.Control/"
LIST_MODELS = INFERENCE_PREFIX + "ListModels"
# Open to every caller: it lists no gate while keys are in force (the HTTP shim
# follows it with no key of its own).
WATCH_ADMISSION = INFERENCE_PREFIX + "WatchAdmission"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# A peer that came through a Unix socket, as gRPC names it.
_UNIX_PEER = "unix:"
# The tenant label of refusals before any tenant is known.
UNKNOWN_TENANT = "unknown"

log = structlog.get_logger("blazar.access")


class Kind(StrEnum):
    OPEN = "open"
    INFERENCE = "inference"
    CONTROL = "control"


def kind_of(method: str) -> Kind:
    if method.startswith(_OPEN_PREFIXES) or method == WATCH_ADMISSION:
        return Kind.OPEN
    if method.startswith(INFERENCE_PREFIX):
        return Kind.INFERENCE
    return Kind.CONTROL


@dataclass(frozen=True)
class Caller:
    """Who makes a call: a tenant, or nobody in particular (no auth file, or the owner
    on the Unix socket), who may use every Lane."""

    tenant: Tenant | None = None
    # The daemon's readiness probe: ListModels only.
    probe: bool = False

    @property
    def name(self) -> str:
        return self.tenant.name if self.tenant is not None else ""

    def may_use(self, names: Iterable[str]) -> bool:
        return self.tenant is None or self.tenant.may_use(names)

    def may_keep_alive(self) -> bool:
        """Whether the caller may say how long a Lane stays loaded (`keep_alive`)."""
        return self.tenant is None or self.tenant.keep_alive

    @property
    def weight(self) -> float:
        return self.tenant.weight if self.tenant is not None else 1.0

    @property
    def cache_scope(self) -> str:
        """Whose cached prompts this caller's requests may reuse (prefix caching in the
        engines, prefix routing): its tenant's; "" for the owner and without an auth
        file, one trust domain."""
        return self.tenant.name if self.tenant is not None else ""


OWNER = Caller()
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("blazar_caller", default=OWNER)


def current() -> Caller:
    """The caller of the RPC being handled (set by `AccessInterceptor`)."""
    return _CALLER.get()


def _key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The bearer key in the call's metadata; '' when `authorization` holds no bearer
    key; None when there is no `authorization` at all."""
    for key, value in metadata:
        if key == AUTHORIZATION_KEY:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            return tenants.bearer(text) or ""
    return None


def _missing_key() -> errors.Unauthenticated:
    return errors.Unauthenticated(
        "No API key: send `Authorization: Bearer <key>` (HTTP), `x-api-key` (Anthropic's "
        "clients) or gRPC metadata `authorization: Bearer <key>`.",
        metadata={"credential": "missing"},
    )


class Access:
    """The keys, tenants and rate limits in force (see the module docstring)."""

    def __init__(
        self,
        *,
        tenants: Tenants | None = None,
        control_over_tcp: bool = False,
        probe_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tenants = tenants
        self._control_over_tcp = control_over_tcp
        self._probe_key = probe_key
        self._clock = clock
        self._limiters: dict[str, ratelimit.Limiter] = {}
        self.use(tenants)

    @classmethod
    def open(cls) -> Access:
        """Everything to everyone: Control over TCP too. For tests and tools that run a
        data plane of their own; `blazar serve` never uses it."""
        return cls(control_over_tcp=True)

    @property
    def tenants(self) -> Tenants | None:
        return self._tenants

    def use(self, new: Tenants | None) -> None:
        """Put an auth file's tenants in force (None: no keys). Called on the data
        plane's event loop, between calls."""
        self._tenants = new
        now = self._clock()
        limiters = {}
        for tenant in new.tenants if new is not None else ():
            old = self._limiters.get(tenant.name, ratelimit.Limiter())
            limiters[tenant.name] = old.updated(tenant.rate_limit, now=now)
        self._limiters = limiters

    def caller(
        self, method: str, metadata: Iterable[tuple[str, str | bytes]], *, peer: str
    ) -> Caller:
        """Who calls `method`; Unauthenticated or PermissionDenied when they may not."""
        kind = kind_of(method)
        if kind == Kind.OPEN:
            return OWNER
        local = peer.startswith(_UNIX_PEER)
        key = _key(metadata)
        if key and self._probe_key and hmac.compare_digest(key.encode(), self._probe_key.encode()):
            if method != LIST_MODELS:
                raise errors.PermissionDenied("The readiness probe's key may only list models.")
            return Caller(probe=True)
        tenant = self._authenticate(key)
        if kind == Kind.INFERENCE:
            if tenant is None and self.keyed and not local:
                raise _missing_key()
            return Caller(tenant)
        if local:
            return Caller(tenant)
        if tenant is None:
            if self.keyed:
                raise _missing_key()
            if self._control_over_tcp:
                return OWNER
            raise errors.AdminRequired(
                "Control is served over TCP only to an admin key, and this server has no "
                "keys (no --auth-file); on this host, use the daemon's Unix socket "
                "($BLAZAR_HOME/control.sock, the CLI's default).",
                metadata={"method": method},
            )
        if not tenant.admin:
            raise errors.AdminRequired(
                f"Tenant '{tenant.name}' may not call Control (its `admin` is false).",
                metadata={"tenant": tenant.name, "method": method},
            )
        return Caller(tenant)

    def require_key(self, authorization: str | None) -> None:
        """For a front end that refuses a caller without a key before it does any work
        (the HTTP shim's `keys.KeyGuard`): with an auth file in force, Unauthenticated
        (counted as the interceptor counts its refusals) unless `authorization` (an
        `Authorization` header's value) holds a key one of its tenants holds. Nothing
        without an auth file. What the key may use is still checked call by call."""
        if not self.keyed:
            return
        try:
            metadata = () if authorization is None else ((AUTHORIZATION_KEY, authorization),)
            if self._authenticate(_key(metadata)) is None:
                raise _missing_key()
        except errors.BlazarError as err:
            metrics.observe_tenant_refusal(UNKNOWN_TENANT, err.reason)
            raise

    @property
    def keyed(self) -> bool:
        """Whether an auth file is in force."""
        return self._tenants is not None

    def _authenticate(self, key: str | None) -> Tenant | None:
        """The tenant holding `key`. None without a key, and without an auth file: a
        key sent then unlocks nothing (clients send placeholders: `api_key="unused"`)."""
        if key is None or self._tenants is None:
            return None
        found = self._tenants.authenticate(key) if key else None
        if found is None:
            raise errors.Unauthenticated(
                "The API key is not one this server knows.", metadata={"credential": "unknown"}
            )
        return found

    def permit(self, caller: Caller, *, model: str, names: Iterable[str]) -> None:
        """Whether `caller` may use the Lane known by `names` (asked for as `model`):
        ModelNotPermitted when not. Nothing is counted: see `count`."""
        tenant = caller.tenant
        if caller.probe:
            raise errors.PermissionDenied("The readiness probe's key may only list models.")
        if tenant is None:
            return
        if not tenant.may_use(names):
            metrics.observe_tenant_refusal(tenant.name, errors.ModelNotPermitted.reason)
            raise errors.ModelNotPermitted(
                f"Tenant '{tenant.name}' may not use the model '{model}' (its `lanes` do "
                "not name that Lane or any of its aliases).",
                metadata={"tenant": tenant.name, "model": model},
            )

    def count(self, caller: Caller) -> None:
        """Count a request of `caller` that passed every check of its own (`permit`, its
        policy, its session key) against the tenant's rate limit: RateLimited when the
        limit is reached. A request refused as the caller's mistake is never counted,
        so it costs the tenant nothing."""
        tenant = caller.tenant
        if tenant is None:
            return
        limiter = self._limiters.get(tenant.name)
        if limiter is not None:
            limiter, refusal = limiter.admit(now=self._clock())
            self._limiters[tenant.name] = limiter
            if refusal is not None:
                metrics.observe_tenant_refusal(tenant.name, errors.RateLimited.reason)
                raise errors.RateLimited.of(
                    tenant=tenant.name,
                    limit=refusal.limit,
                    per_minute=refusal.per_minute,
                    retry_after_s=refusal.retry_after_s,
                )
        metrics.TENANT_REQUESTS.labels(tenant.name).inc()

    def refund(self, caller: Caller, err: errors.BlazarError) -> None:
        """`count` took a request of `caller` that the server then refused, before any
        of it was served, with `err`. A refusal for the server's own state (no ready
        replica, admission's QUEUE_FULL, QUEUE_TIMEOUT, SLO_UNATTAINABLE, and its
        DEADLINE_EXCEEDED: the wait ahead is longer than the caller's gRPC deadline)
        gives the request back: the tenant did nothing wrong, a client that retries
        under load would otherwise spend its limit on the server's overload, and the
        HTTP shim's admission gates answer the same refusals without counting them. A
        refusal of the request itself (a prompt over the context, which an engine
        found) stays counted: it cost the engine work."""
        tenant = caller.tenant
        if tenant is None or not server_side(err):
            return
        limiter = self._limiters.get(tenant.name)
        if limiter is not None:
            self._limiters[tenant.name] = limiter.refund(now=self._clock())

    def charge(self, caller: Caller, *, prompt_tokens: int, output_tokens: int) -> None:
        """The tokens a request of `caller` used, once known."""
        tenant = caller.tenant
        if tenant is None:
            return
        metrics.observe_tenant_tokens(tenant.name, prompt=prompt_tokens, output=output_tokens)
        limiter = self._limiters.get(tenant.name)
        if limiter is not None:
            self._limiters[tenant.name] = limiter.charge(
                prompt_tokens + output_tokens, now=self._clock()
            )


def refusal_fields(err: errors.BlazarError) -> dict[str, str]:
    """What a `request.rejected` log line says of a caller refused before any tenant
    was granted: the reason, the tenant when one was named (an admin-only call by a
    tenant that is not admin), and whether the key was missing or unknown. Never the
    key: the line is for an operator watching for probing, not for replaying it."""
    fields = {"reason": err.reason, "tenant": err.metadata.get("tenant", UNKNOWN_TENANT)}
    if credential := err.metadata.get("credential"):
        fields["credential"] = credential
    return fields


def server_side(err: errors.BlazarError) -> bool:
    """Whether `err` refuses a request for the server's state, not for the request or
    its caller: UNAVAILABLE, RESOURCE_EXHAUSTED other than the tenant's own rate limit,
    and DEADLINE_EXCEEDED (admission's: the queue is longer than the caller waits)."""
    if isinstance(err, errors.RateLimited):
        return False
    return isinstance(err, errors.Overloaded | errors.Unavailable | errors.DeadlineExceeded)


def shown(caller: Caller, err: errors.BlazarError, *, model: str) -> errors.BlazarError:
    """What `caller` is told of `err`, a refusal of a request for `model`. A Lane the
    tenant may not use is, to a tenant that is not admin, exactly what a name no Lane
    serves is: a different answer would tell it which Lane names exist, which its model
    lists hide. An admin tenant can list every Lane (Control), so it is told the truth."""
    if isinstance(err, errors.ModelNotPermitted) and not (
        caller.tenant is not None and caller.tenant.admin
    ):
        return errors.ModelNotFound.of(model)
    return err


_Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
_Behaviour: TypeAlias = Callable[..., Any]
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call its caller may not make before its handler runs, and hands the
    handler its `Caller` (`current`)."""

    def __init__(self, access: Access) -> None:
        self._access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or kind_of(method) == Kind.OPEN:
            return handler
        if handler.request_streaming:
            return None  # Blazar's services take one request per call; none streams them
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return None

    async def _admit(self, method: str, context: _Context) -> contextvars.Token[Caller]:
        try:
            caller = self._access.caller(
                method, context.invocation_metadata() or (), peer=context.peer()
            )
        except errors.BlazarError as err:
            metrics.observe_tenant_refusal(UNKNOWN_TENANT, err.reason)
            log.info("request.rejected", rpc=method, peer=context.peer(), **refusal_fields(err))
            await status.abort(context, err)
        return _CALLER.set(caller)

    def _unary(self, method: str, behaviour: _Behaviour) -> _Behaviour:
        async def checked(request: Any, context: _Context) -> Any:
            token = await self._admit(method, context)
            try:
                return await behaviour(request, context)
            finally:
                _CALLER.reset(token)

        return checked

    def _stream(self, method: str, behaviour: _Behaviour) -> _Behaviour:
        # grpc.aio tells a generator handler from a writer one by its function type.
        if inspect.isasyncgenfunction(behaviour):

            async def generate(request: Any, context: _Context) -> AsyncIterator[Any]:
                token = await self._admit(method, context)
                try:
                    async with contextlib.aclosing(behaviour(request, context)) as responses:
                        async for response in responses:
                            yield response
                finally:
                    # grpc.aio drops, unclosed, the generator of a call whose caller
                    # left while it waited at `yield`; the event loop closes it later in
                    # a task of its own, whose Context never held the token and needs
                    # nothing restored (the reset's ValueError was logged as "Task
                    # exception was never retrieved" for such a stream).
                    with contextlib.suppress(ValueError):
                        _CALLER.reset(token)

            return generate

        async def write(request: Any, context: _Context) -> None:
            token = await self._admit(method, context)
            try:
                await behaviour(request, context)
            finally:
                _CALLER.reset(token)

        return write
