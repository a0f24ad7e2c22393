"""The one exception tree of Blazar, and what each error means on the wire.

    BlazarError                       any failure Blazar reports to a caller
    ├── InvalidRequest                the request itself is wrong        INVALID_ARGUMENT
    │   ├── ContextLengthExceeded     prompt + max_tokens > context      INVALID_ARGUMENT
    │   ├── RequestTooLarge           more bytes than the server takes   INVALID_ARGUMENT
    │   └── UnsupportedMediaType      an HTTP body that is not JSON      INVALID_ARGUMENT
    ├── ManifestInvalid               a manifest failed validation       INVALID_ARGUMENT
    ├── ModelNotFound                 no Lane serves that name           NOT_FOUND
    ├── ObjectNotFound                no such resource in the store      NOT_FOUND
    ├── RequestNotFound               no such request on the engine      NOT_FOUND
    ├── RequestStateConflict          not in a state that allows it      FAILED_PRECONDITION
    ├── Conflict                      an apply's stale resourceVersion   ABORTED
    ├── Overloaded                    admission refused, retry later     RESOURCE_EXHAUSTED
    │   ├── QueueFull                 its policy's queue is at its depth RESOURCE_EXHAUSTED
    │   ├── QueueTimeout              waited its policy's longest wait   RESOURCE_EXHAUSTED
    │   ├── SloUnattainable           predicted to miss its TTFT target  RESOURCE_EXHAUSTED
    │   └── RateLimited               the tenant's rate limit is spent   RESOURCE_EXHAUSTED
    ├── Unavailable                   no ready replica / shutting down   UNAVAILABLE
    │   └── ReplicaFailed             its replica failed, then its bound UNAVAILABLE
    │                                 passed (a 503, not admission's 429)
    ├── Unauthenticated               missing or wrong API key           UNAUTHENTICATED
    ├── PermissionDenied              key without access                 PERMISSION_DENIED
    │   ├── ModelNotPermitted         a Lane the tenant may not use      PERMISSION_DENIED
    │   │                             (told as ModelNotFound to a tenant that is not admin)
    │   ├── PolicyNotPermitted        an SLOPolicy the tenant may not name
    │   ├── AdminRequired             Control without an admin key       PERMISSION_DENIED
    │   └── OriginNotAllowed          a browser page of another origin   PERMISSION_DENIED
    └── DeadlineExceeded              the caller's deadline passed       DEADLINE_EXCEEDED

Every error carries a gRPC status code name (`code`), a machine-readable `reason`
(UPPER_SNAKE, as in google.rpc.ErrorInfo) and string `metadata` with the numbers
behind it. Each boundary translates: the engine and data plane raise these, gRPC
carries them as a status with google.rpc.ErrorInfo details (`blazar.rpc.status`), and
each HTTP dialect renders them in its own envelope. This module is pure: no gRPC import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from blazar.api import clip


def json_type(value: object) -> str:
    """What a JSON value that is not an object is, for messages that say what was sent
    instead ("expected a JSON object, got an array")."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"


class BlazarError(Exception):
    """Base of every error Blazar reports to a caller."""

    code: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, metadata: Mapping[str, str] | None = None) -> None:
        # Messages and metadata quote what callers sent: bounded, whatever they sent.
        message = clip.clip(message, clip.MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = {
            k: clip.clip(v, clip.FIELD_CHARS) for k, v in (metadata or {}).items()
        }


# The metadata key under which an InvalidRequest names the field of the gRPC request at
# fault ("constraint", ...), so each HTTP dialect can blame its own parameter for it.
FIELD_KEY = "field"


class InvalidRequest(BlazarError):
    code = "INVALID_ARGUMENT"
    reason = "INVALID_REQUEST"


class ContextLengthExceeded(InvalidRequest):
    reason = "CONTEXT_LENGTH_EXCEEDED"

    @classmethod
    def of(
        cls,
        *,
        prompt_tokens: int,
        max_tokens: int,
        context_length: int,
        at_least: bool = False,
        requested: bool = False,
    ) -> ContextLengthExceeded:
        """`at_least`: prompt_tokens is a lower bound, the prompt being refused by its
        length in bytes without tokenizing it. `requested`: context_length is the
        smaller context the request asked for (Sampling.context_limit), not a slot's."""
        sizes = ContextSizes(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            context_length=context_length,
            at_least=at_least,
            requested=requested,
        )
        metadata = {
            "prompt_tokens": str(prompt_tokens),
            "max_tokens": str(max_tokens),
            "context_length": str(context_length),
        }
        if at_least:
            metadata[PROMPT_TOKENS_AT_LEAST_KEY] = "true"
        if requested:
            metadata[CONTEXT_LIMIT_KEY] = str(context_length)
        return cls(
            sizes.refusal(prompt="prompt", advice="Shorten the prompt or lower max_tokens."),
            metadata=metadata,
        )

    def sizes(self) -> ContextSizes | None:
        """The numbers `of` put in the metadata, for a dialect that words the refusal in
        its own terms; None when the error did not come from `of`."""
        numbers = [
            self.metadata.get(k, "") for k in ("prompt_tokens", "max_tokens", "context_length")
        ]
        if not all(n.isdigit() for n in numbers):
            return None
        prompt_tokens, max_tokens, context_length = map(int, numbers)
        return ContextSizes(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            context_length=context_length,
            at_least=self.metadata.get(PROMPT_TOKENS_AT_LEAST_KEY) == "true",
            requested=CONTEXT_LIMIT_KEY in self.metadata,
        )


# Metadata of a ContextLengthExceeded whose prompt_tokens is a lower bound (a prompt
# refused by its length in bytes, untokenized); absent when the count is exact.
PROMPT_TOKENS_AT_LEAST_KEY = "prompt_tokens_at_least"
# Metadata of a ContextLengthExceeded whose context is the smaller one the request asked
# for (Sampling.context_limit, Ollama's num_ctx); absent when it is a slot's context.
CONTEXT_LIMIT_KEY = "context_limit"


@dataclass(frozen=True)
class ContextSizes:
    """Why a request does not fit: its prompt, what it may generate, the context."""

    prompt_tokens: int
    max_tokens: int
    context_length: int
    # prompt_tokens is a lower bound, not a count.
    at_least: bool
    # context_length is what the request asked for (Sampling.context_limit), less than
    # a slot holds.
    requested: bool = False

    def refusal(self, *, prompt: str, advice: str) -> str:
        """The sentence every dialect but Anthropic's refuses with, in its own terms for
        the prompt and for what to lower (`advice`). It opens with OpenAI's (and vLLM's)
        words, by which clients such as LiteLLM tell a context overflow from other bad
        requests."""
        if self.requested:
            return (
                f"The request asked for a context of {self.context_length} tokens "
                f"(context_limit), but it {self.needs(prompt=prompt)}. {advice}"
            )
        return (
            f"This model's maximum context length is {self.context_length} tokens per "
            f"request, but the request {self.needs(prompt=prompt)}. {advice}"
        )

    def needs(self, *, prompt: str) -> str:
        """Says "needs N (P in the <prompt> and M to generate)", "at least" on a bound."""
        some = "at least " if self.at_least else ""
        return (
            f"needs {some}{self.prompt_tokens + self.max_tokens} ({some}{self.prompt_tokens} "
            f"in the {prompt} and {self.max_tokens} to generate)"
        )


class RequestTooLarge(InvalidRequest):
    """The request's size in bytes is over a limit (HTTP 413); retrying cannot help."""

    reason = "REQUEST_TOO_LARGE"


class UnsupportedMediaType(InvalidRequest):
    """An HTTP body sent as something other than JSON (HTTP 415). Refused so that a web
    page cannot send one as a form or plain text, which a browser does without asking."""

    reason = "UNSUPPORTED_MEDIA_TYPE"


@dataclass(frozen=True)
class FieldError:
    """One validation problem, located by a dotted path such as `Lane/x: spec.replicas`."""

    path: str
    message: str

    def __post_init__(self) -> None:
        path = clip.one_line(clip.clip(self.path, clip.FIELD_CHARS))
        message = clip.one_line(clip.clip(self.message, clip.FIELD_CHARS))
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "message", message)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ManifestInvalid(BlazarError):
    """Every problem found in a batch of manifests, one `FieldError` a line.

    One received over the wire (`from_reason`) carries its errors only in its message:
    its `errors` is empty.
    """

    code = "INVALID_ARGUMENT"
    reason = "INVALID_MANIFEST"
    errors: tuple[FieldError, ...] = ()

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors = tuple(errors)
        lines = "\n".join(str(e) for e in self.errors)
        super().__init__(f"{len(self.errors)} error(s) in manifest:\n{lines}")


class ModelNotFound(BlazarError):
    code = "NOT_FOUND"
    reason = "MODEL_NOT_FOUND"

    # A name is echoed back at most this long: gRPC refuses trailers past 16 KiB, and
    # an absurd name would turn a NOT_FOUND into a transport error.
    ECHO_MAX_CHARS = 200

    @classmethod
    def of(cls, name: str) -> ModelNotFound:
        if len(name) > cls.ECHO_MAX_CHARS:
            name = name[: cls.ECHO_MAX_CHARS] + "..."
        return cls(f"The model '{name}' does not exist.", metadata={"model": name})


class ObjectNotFound(BlazarError):
    code = "NOT_FOUND"
    reason = "NOT_FOUND"


class RequestNotFound(BlazarError):
    """An engine order (Park, Resume) names a request the engine does not hold: it
    ended, or never ran there."""

    code = "NOT_FOUND"
    reason = "REQUEST_NOT_FOUND"

    @classmethod
    def of(cls, request_id: str) -> RequestNotFound:
        return cls(
            f"No request '{request_id}' is running or parked on this engine.",
            metadata={"request_id": request_id},
        )


class RequestStateConflict(BlazarError):
    """An engine order that the request's state does not allow: parking one that waits
    for a slot or is parked already, resuming one that is not parked. `state` in the
    metadata says which it is (waiting, running, parked)."""

    code = "FAILED_PRECONDITION"
    reason = "REQUEST_STATE_CONFLICT"

    @classmethod
    def of(cls, request_id: str, *, state: str, wanted: str) -> RequestStateConflict:
        return cls(
            f"The request '{request_id}' is {state}; only a {wanted} request can be "
            f"{'parked' if wanted == 'running' else 'resumed'}.",
            metadata={"request_id": request_id, "state": state},
        )


class Conflict(BlazarError):
    """An apply whose `metadata.resourceVersion` (its precondition, as Kubernetes'
    optimistic concurrency has it) is not the stored object's: someone changed the
    object since it was read, or it is gone. ABORTED, as gRPC says of a
    read-modify-write that lost a race: read again and retry. The metadata names the
    object, the version the caller sent and (when the object exists) the current one."""

    code = "ABORTED"
    reason = "CONFLICT"

    @classmethod
    def stale(cls, *, kind: str, name: str, expected: int, current: int) -> Conflict:
        return cls(
            f"{kind}/{name} has been modified since resourceVersion {expected} (now "
            f"{current}); get it again, apply your change to it, and apply that.",
            metadata={
                "kind": kind,
                "name": name,
                "resource_version": str(expected),
                "current_resource_version": str(current),
            },
        )

    @classmethod
    def gone(cls, *, kind: str, name: str, expected: int) -> Conflict:
        return cls(
            f"{kind}/{name} does not exist, so it cannot be at resourceVersion {expected} "
            "(it was deleted since it was read, or never created); remove "
            "metadata.resourceVersion to create it.",
            metadata={"kind": kind, "name": name, "resource_version": str(expected)},
        )


class Overloaded(BlazarError):
    code = "RESOURCE_EXHAUSTED"
    reason = "OVERLOADED"


# The metadata key of an Overloaded error's hint: milliseconds until a retry may succeed.
RETRY_AFTER_KEY = "retry_after_ms"
# The metadata key, set to "false", of an Overloaded error that no wait cures: the
# same request is refused again however long its caller waits (HTTP: no Retry-After,
# and `x-should-retry: false`, which the OpenAI and Anthropic clients obey).
RETRYABLE_KEY = "retryable"


def _millis(seconds: float) -> str:
    return str(round(seconds * 1000))


def _retry_millis(seconds: float) -> str:
    """Never 0: "retry after 0 ms" reads as "retry at once", which a refusal never means."""
    return str(max(1, math.ceil(seconds * 1000)))


class QueueFull(Overloaded):
    """Admission refused a request at once: its policy's queue on the Lane is full."""

    reason = "QUEUE_FULL"

    @classmethod
    def of(cls, *, lane: str, policy: str, max_queue_depth: int, retry_after_s: float) -> QueueFull:
        requests = "request" if max_queue_depth == 1 else "requests"
        return cls(
            f"Lane '{lane}' already has {max_queue_depth} {requests} waiting under SLOPolicy "
            f"'{policy}' (its maxQueueDepth); retry in {retry_after_s:.1f} s.",
            metadata={
                "lane": lane,
                "policy": policy,
                "max_queue_depth": str(max_queue_depth),
                RETRY_AFTER_KEY: _retry_millis(retry_after_s),
            },
        )


class QueueTimeout(Overloaded):
    """A queued request waited its policy's maxQueueWaitMs without starting."""

    reason = "QUEUE_TIMEOUT"

    @classmethod
    def of(
        cls,
        *,
        lane: str,
        policy: str,
        waited_s: float,
        max_queue_wait_s: float,
        retry_after_s: float,
    ) -> QueueTimeout:
        return cls(
            f"The request waited {waited_s:.1f} s on Lane '{lane}' without starting; "
            f"SLOPolicy '{policy}' lets a request wait {max_queue_wait_s:.1f} s "
            f"(its maxQueueWaitMs). Retry in {retry_after_s:.1f} s.",
            metadata={
                "lane": lane,
                "policy": policy,
                "waited_ms": _millis(waited_s),
                "max_queue_wait_ms": _millis(max_queue_wait_s),
                RETRY_AFTER_KEY: _retry_millis(retry_after_s),
            },
        )


class SloUnattainable(Overloaded):
    """Admission predicted that a request would miss its time-to-first-token target, and
    its policy says to refuse rather than queue (onOverload: reject)."""

    reason = "SLO_UNATTAINABLE"

    @classmethod
    def of(
        cls,
        *,
        lane: str,
        policy: str,
        predicted_ttft_s: float,
        ttft_target_s: float,
        retry_after_s: float,
    ) -> SloUnattainable:
        return cls(
            f"The first token would come after {predicted_ttft_s:.2f} s on Lane '{lane}', "
            f"past the {ttft_target_s:.2f} s that SLOPolicy '{policy}' sets (its ttftTargetMs). "
            f"Retry in {retry_after_s:.1f} s.",
            metadata={
                "lane": lane,
                "policy": policy,
                "predicted_ttft_ms": _millis(predicted_ttft_s),
                "ttft_target_ms": _millis(ttft_target_s),
                RETRY_AFTER_KEY: _retry_millis(retry_after_s),
            },
        )

    @classmethod
    def too_long(
        cls,
        *,
        lane: str,
        policy: str,
        prefill_s: float,
        predicted_ttft_s: float,
        ttft_target_s: float,
    ) -> SloUnattainable:
        """Refused because its prompt alone misses the target: waiting for the work ahead
        to drain would not make it meet it, so the error carries no retry hint."""
        return cls(
            f"The prompt alone takes about {prefill_s:.2f} s to prefill on Lane '{lane}' "
            f"(at its measured rate, with nothing else running), past the "
            f"{ttft_target_s:.2f} s that SLOPolicy '{policy}' sets (its ttftTargetMs), "
            "so no wait makes its first token meet the target. Send a shorter prompt, or "
            "send it under an SLOPolicy with a larger ttftTargetMs or onOverload: queue.",
            metadata={
                "lane": lane,
                "policy": policy,
                "prefill_ms": _millis(prefill_s),
                "predicted_ttft_ms": _millis(predicted_ttft_s),
                "ttft_target_ms": _millis(ttft_target_s),
                RETRYABLE_KEY: "false",
            },
        )


class RateLimited(Overloaded):
    """The tenant spent its requests or tokens per minute (its `rateLimit`)."""

    reason = "RATE_LIMITED"

    @classmethod
    def of(cls, *, tenant: str, limit: str, per_minute: int, retry_after_s: float) -> RateLimited:
        what = "requests" if limit == "requestsPerMinute" else "tokens"
        return cls(
            f"Tenant '{tenant}' has used its {per_minute} {what} per minute (its "
            f"rateLimit.{limit}); retry in {retry_after_s:.1f} s.",
            metadata={
                "tenant": tenant,
                "limit": limit,
                "per_minute": str(per_minute),
                RETRY_AFTER_KEY: _retry_millis(retry_after_s),
            },
        )


class Unavailable(BlazarError):
    code = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class ReplicaFailed(Unavailable):
    """A request handed back to the queue when its replica failed before its first
    token (its engine exited or stopped answering), whose policy's bound passed while
    it waited for another: its target or wait bound is missed because a replica
    failed, not because the Lane is loaded, so it is UNAVAILABLE (a 503), not a 429."""

    reason = "REPLICA_FAILED"

    @classmethod
    def of(cls, *, lane: str, policy: str, bound: str, retry_after_s: float) -> ReplicaFailed:
        return cls(
            f"The replica of Lane '{lane}' this request was sent to failed before its "
            f"first token (its engine exited or stopped answering), and the "
            f"{bound} of SLOPolicy '{policy}' passed while it waited for another. "
            f"Retry in {retry_after_s:.1f} s.",
            metadata={
                "lane": lane,
                "policy": policy,
                RETRY_AFTER_KEY: _retry_millis(retry_after_s),
            },
        )


class Unauthenticated(BlazarError):
    """No API key, or one no tenant holds."""

    code = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(BlazarError):
    code = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class ModelNotPermitted(PermissionDenied):
    """The caller's tenant may not use the Lane a model name resolves to."""

    reason = "MODEL_NOT_PERMITTED"


class PolicyNotPermitted(PermissionDenied):
    """A request names an SLOPolicy its tenant's `sloPolicies` do not list."""

    reason = "SLO_POLICY_NOT_PERMITTED"


class KeepAliveNotPermitted(PermissionDenied):
    """A request sets keep_alive, which its tenant's `keepAlive` does not allow."""

    reason = "KEEP_ALIVE_NOT_PERMITTED"


class AdminRequired(PermissionDenied):
    """Control called by a tenant without `admin`, or over TCP without an admin key."""

    reason = "ADMIN_REQUIRED"


class OriginNotAllowed(PermissionDenied):
    """A browser request from a page whose origin `serve --allow-origin` does not name."""

    reason = "ORIGIN_NOT_ALLOWED"


class DeadlineExceeded(BlazarError):
    """The caller's deadline (gRPC's) passed while the request waited, or admission
    predicted its first token after it."""

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"

    @classmethod
    def of(
        cls,
        *,
        lane: str,
        deadline_s: float,
        waited_s: float,
        predicted_ttft_s: float | None = None,
    ) -> DeadlineExceeded:
        """`predicted_ttft_s` set: refused at arrival, its first token being predicted
        that long after it; else its deadline passed after `waited_s` in the queue."""
        metadata = {"lane": lane, "deadline_ms": _millis(deadline_s)}
        if predicted_ttft_s is not None:
            metadata["predicted_ttft_ms"] = _millis(predicted_ttft_s)
            return cls(
                f"The first token would come after {predicted_ttft_s:.2f} s on Lane '{lane}' "
                f"(the work ahead of it), past the caller's deadline of {deadline_s:.2f} s; "
                "the request was not started.",
                metadata=metadata,
            )
        metadata["waited_ms"] = _millis(waited_s)
        return cls(
            f"The caller's deadline of {deadline_s:.2f} s passed while the request waited "
            f"{waited_s:.2f} s in Lane '{lane}''s queue; it was not started.",
            metadata=metadata,
        )


_BY_REASON: dict[str, type[BlazarError]] = {
    cls.reason: cls
    for cls in (
        InvalidRequest,
        ContextLengthExceeded,
        RequestTooLarge,
        UnsupportedMediaType,
        ManifestInvalid,
        ModelNotFound,
        ObjectNotFound,
        RequestNotFound,
        RequestStateConflict,
        Conflict,
        Overloaded,
        QueueFull,
        QueueTimeout,
        SloUnattainable,
        RateLimited,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        ModelNotPermitted,
        PolicyNotPermitted,
        KeepAliveNotPermitted,
        AdminRequired,
        OriginNotAllowed,
        DeadlineExceeded,
    )
}


def from_reason(
    reason: str, message: str, metadata: Mapping[str, str], *, code: str = "INTERNAL"
) -> BlazarError:
    """Rebuild an error received over the wire, message and metadata as sent.

    An unknown reason (from a newer peer, say) becomes a BlazarError that keeps it and
    the status `code` it came with, so a caller still shows and branches on what the
    peer meant rather than INTERNAL.
    """
    cls = _BY_REASON.get(reason)
    # Around each class's own constructor: some build their message from parts
    # (ManifestInvalid from FieldErrors), and the message received is already built.
    err = BlazarError.__new__(cls or BlazarError)
    BlazarError.__init__(err, message, metadata=metadata)
    if cls is None:
        # This one error's, not its class's.
        err.reason = reason  # type: ignore[misc]  # a ClassVar, shadowed on this instance only
        err.code = code  # type: ignore[misc]  # likewise
    return err
