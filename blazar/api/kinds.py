"""The four resource kinds of `blazar.dev/v1alpha1` and their spec and status schemas.

Spec models reject unknown fields (a typo in a manifest is an error, not a silent
default); status models ignore them, because status is written by the daemon and a
newer daemon may know more fields than this code. Also here: kind-name resolution for
the CLI (`get lanes`, `get slo`), the references each kind makes to others, and the
duration format used by `idle.sleepAfter`.
"""

from __future__ import annotations

import re
import urllib.parse
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from blazar.api import errors
from blazar.api.meta import (
    API_VERSION,
    ApiVersion,
    CamelModel,
    Condition,
    ObjectMeta,
    invalid,
    invalid_at,
    invalid_each,
)


class Kind(StrEnum):
    MODEL = "Model"
    LANE = "Lane"
    SLO_POLICY = "SLOPolicy"
    SPEC_PAIR = "SpecPair"


# --- durations -------------------------------------------------------------------

_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ms|s|m|h))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> timedelta:
    """Parse a Go-style duration such as "30s", "10m", "1h30m" or "250ms"."""
    if text != "0" and not _DURATION.match(text):
        raise ValueError(f'"{text}" is not a duration: use e.g. "30s", "10m", "1h30m"')
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))
    return timedelta(seconds=seconds)


def _check_duration(text: str) -> str:
    try:
        parse_duration(text)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    return text


Duration = Annotated[str, AfterValidator(_check_duration)]


# --- sizes -----------------------------------------------------------------------

_SIZE = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
_UNIT_BYTES = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from a Kubernetes-style quantity: "1073741824", "512Mi", "8Gi"."""
    found = _SIZE.match(text.strip())
    if found is None:
        raise ValueError(f'"{text}" is not a size: use bytes or Ki, Mi, Gi, Ti, e.g. "8Gi"')
    return int(found.group(1)) * _UNIT_BYTES[found.group(2)]


# --- common status ---------------------------------------------------------------


class ObjectStatus(CamelModel):
    """What every status has; written only by the controller through the store's
    status path."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)


# --- Model -----------------------------------------------------------------------


class ModelSource(CamelModel):
    # Empty names no file (it would resolve to the daemon's working directory).
    path: str | None = Field(default=None, min_length=1)
    package: str | None = Field(default=None, min_length=1)
    url: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [v for v in (self.path, self.package, self.url) if v is not None]
        if len(given) != 1:
            raise invalid("set exactly one of path, package or url")
        if self.url is not None:
            # Nothing is downloaded at run time yet: refused here, not stored and failed.
            raise invalid(
                "url sources are not supported yet: download the file and name it with "
                "path (under a model root), or use package"
            )
        return self


def _check_sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise invalid("must be 64 lowercase hexadecimal characters")
    return value


# The turn formats a Model's `chatTemplate` can name (the engine renders each); any
# other value must be an inline Jinja template.
CHAT_TEMPLATE_NAMES = ("gemma", "chatml", "llama3")


def fallback_template(architecture: str) -> str:
    """The named turn format for a GGUF without a chat template, by architecture:
    Gemma's own for the Gemma family, Llama 3's headers for "llama", ChatML (the most
    widely shared format: Qwen, Phi-3, Yi, ...) for everything else."""
    if architecture.startswith("gemma"):
        return "gemma"
    if architecture == "llama":
        return "llama3"
    return "chatml"


def _check_chat_template(value: str, info: ValidationInfo) -> str:
    """A named turn format, or a Jinja template that compiles and reads `messages`.

    Objects read back from the store are not checked again (`manifests.from_dict`):
    a rule added later must not make a stored Model unreadable.
    """
    if value in CHAT_TEMPLATE_NAMES or _stored(info):
        return value
    names = ", ".join(CHAT_TEMPLATE_NAMES)
    if "{{" not in value and "{%" not in value:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise invalid(
            f"'{shown}' is not a template name ({names}) and has no Jinja markup; "
            "give a name or an inline Jinja template"
        )
    # Imported here: only an inline template needs Jinja, and every CLI command and the
    # daemon's start import this module (jinja2 was a sixth of its import time).
    import jinja2
    import jinja2.meta
    import jinja2.sandbox

    # The engine's environment (transformers' apply_chat_template uses the same).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        # Compiling also checks what parsing does not: unknown filters and tests.
        env.compile(value)
        undeclared = jinja2.meta.find_undeclared_variables(env.parse(value))
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise invalid(f"is not a valid Jinja template: {exc.message}{where}") from None
    if "messages" not in undeclared:
        raise invalid("never reads 'messages', so every conversation would render the same prompt")
    return value


# The validation context key `manifests.from_dict` sets for trusted, stored data.
STORED = "stored"


def _stored(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and bool(info.context.get(STORED))


class ModelSpec(CamelModel):
    source: ModelSource
    sha256: Annotated[str, AfterValidator(_check_sha256)] | None = None
    chat_template: Annotated[str, AfterValidator(_check_chat_template)] | None = None
    # Accepted by the schema so that objects stored before keep loading; refused at
    # apply (`_context_length_not_acted_on`): nothing reads it.
    context_length: int | None = Field(default=None, gt=0)

    @field_validator("context_length")
    @classmethod
    def _context_length_not_acted_on(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not _stored(info):
            raise invalid(
                "contextLength is not acted on: a Lane's contextPerSlot sets each "
                "sequence's context (within what the model was trained on, which the "
                "Model's status shows as contextLength); remove it"
            )
        return value


class ModelStatus(ObjectStatus):
    path: str | None = None
    size_bytes: int | None = None
    # The file's modification time when it was inspected: with the size, it tells a
    # controller (a restarted one too) that the file needs no new hashing and parsing.
    mtime_ns: int | None = None
    # Its inode: a file renamed over it with the same size and modification time (`cp
    # -p`, `rsync -a`, `touch -r`) is another file, hashed and parsed again.
    inode: int | None = None
    sha256: str | None = None
    architecture: str | None = None
    context_length: int | None = None
    parameters: dict[str, str] = Field(default_factory=dict)


# --- Lane ------------------------------------------------------------------------

# The KV cache types llama.cpp accepts (`--cache-type-k/v`).
KV_CACHE_TYPES = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})


def _check_cache_type(value: str) -> str:
    if value not in KV_CACHE_TYPES:
        raise invalid(
            f'"{value}" is not a KV cache type; use one of {", ".join(sorted(KV_CACHE_TYPES))}'
        )
    return value


CacheType = Annotated[str, AfterValidator(_check_cache_type)]
# Block-quantized types: a V cache of these needs flash attention.
_QUANTIZED = KV_CACHE_TYPES - {"f32", "f16", "bf16"}


# Host memory one engine may hold for the KV caches of parked (preempted) generations.
# A 2,048-token slot of an 8B model with an f16 cache is 256 MiB, so this banks four
# such slots; past it a parked generation keeps only its tokens and is prefilled again.
DEFAULT_MAX_PARKED_MIB = 1024


class KVCache(CamelModel):
    type_k: CacheType = "f16"
    type_v: CacheType = "f16"
    persist: bool = False
    # Host memory per replica for the KV caches of generations parked for more urgent
    # work (SLO preemption). Admission parks only what fits; 0 turns preemption off.
    # An engine asked to park past it keeps only the tokens and prefills them again.
    max_parked_mib: int = Field(default=DEFAULT_MAX_PARKED_MIB, ge=0, alias="maxParkedMiB")


class Idle(CamelModel):
    # After this long without a request in flight, the Lane's replicas stop (it
    # sleeps); the next request wakes it and waits for it (scale to zero).
    sleep_after: Duration | None = None

    @property
    def sleep_after_s(self) -> float | None:
        return (
            None if self.sleep_after is None else parse_duration(self.sleep_after).total_seconds()
        )


class Health(CamelModel):
    """How the daemon checks a Lane's engine replicas, as a kubelet's startup and
    liveness probes check a pod's containers (`blazar.enginehost.supervisor`). A replica
    must be Ready within `startupSeconds` of its spawn: loading the weights, from a cold
    disk for a large model, is most of it. A Ready one is asked every `periodSeconds`
    and must answer within `timeoutSeconds`; `failureThreshold` misses in a row (or a
    decode step stuck that long) and it is killed and restarted. Read at each check,
    so a change applies to running replicas without restarting them."""

    startup_seconds: int = Field(default=180, ge=1, le=86_400)
    period_seconds: int = Field(default=5, ge=1, le=3_600)
    timeout_seconds: int = Field(default=5, ge=1, le=3_600)
    failure_threshold: int = Field(default=3, ge=1, le=100)


def _check_upstream_url(value: str, info: ValidationInfo) -> str:
    """An http(s) base URL as OpenAI clients take it (`/v1` included), kept without its
    trailing slash so that `{url}/chat/completions` is the route."""
    if _stored(info):
        return value
    if any(c.isspace() or not c.isprintable() for c in value):
        # urlsplit strips leading blanks and httpx does not: the url would never work.
        raise invalid(f"{value!r} holds a space or a control character")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid(
            f'"{value}" is not an http or https URL with a host; give the upstream\'s '
            'OpenAI base URL, e.g. "http://vllm.internal:8000/v1"'
        )
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise invalid(f'"{value}" has no valid port: give one from 1 to 65535, or none')
    if parts.query or parts.fragment or parts.username or parts.password:
        raise invalid("must have no query, fragment or credentials: the key comes from apiKeyFrom")
    return value.rstrip("/")


# Where an upstream key may come from: an environment variable named for Blazar, or a
# file in the daemon's keys directory ($BLAZAR_HOME/keys), by name. Not any variable or
# file: whoever applies a manifest names the url the key is sent to, and would otherwise
# have the daemon send them any secret it can read (AWS_SECRET_ACCESS_KEY, ~/.ssh/...).
_KEY_SOURCE = re.compile(r"^(env:BLAZAR_[A-Za-z0-9_]+|file:[A-Za-z0-9_-][A-Za-z0-9._-]*)$")


def _check_key_source(value: str) -> str:
    if not _KEY_SOURCE.match(value):
        raise invalid(
            "must be env:BLAZAR_NAME (an environment variable of the daemon whose name "
            "starts with BLAZAR_) or file:NAME (a file in the daemon's keys directory, "
            "$BLAZAR_HOME/keys); the key itself never goes in a manifest, and no other "
            "variable or file is sent to an upstream"
        )
    return value


class UpstreamTimeouts(CamelModel):
    # Opening the TCP (and TLS) connection, and the longest wait for a byte of an
    # answer: the first above all (the upstream's queue and prefill).
    connect: Duration = "5s"
    first_byte: Duration = "60s"

    @field_validator("connect", "first_byte")
    @classmethod
    def _positive(cls, value: str, info: ValidationInfo) -> str:
        # httpx reads 0 as "time out at once": no request would ever be sent.
        if not _stored(info) and parse_duration(value).total_seconds() <= 0:
            raise invalid("must be longer than 0, e.g. 5s")
        return value

    @property
    def connect_s(self) -> float:
        return parse_duration(self.connect).total_seconds()

    @property
    def first_byte_s(self) -> float:
        return parse_duration(self.first_byte).total_seconds()


class UpstreamTLS(CamelModel):
    # PEM file of the certificate authorities to trust, instead of the system's.
    ca_file: str | None = None

    @field_validator("ca_file")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise invalid("must be an absolute path on the daemon's host")
        return value


MAX_UPSTREAM_CONCURRENCY = 4096


class Upstream(CamelModel):
    """An OpenAI-compatible server a Lane sends its requests to (`engine: upstream`)."""

    url: Annotated[str, AfterValidator(_check_upstream_url)]
    # The name the upstream knows the model by (its `model` field). Empty only in
    # objects stored by an earlier version, whose spec.model holds it.
    model: str = ""
    api_key_from: Annotated[str, AfterValidator(_check_key_source)] | None = None
    # The upstream's parallel requests: admission treats them as a local Lane's slots.
    max_concurrency: int = Field(default=4, ge=1, le=MAX_UPSTREAM_CONCURRENCY)
    timeouts: UpstreamTimeouts = Field(default_factory=UpstreamTimeouts)
    tls: UpstreamTLS | None = None

    @model_validator(mode="after")
    def _tls_needs_https(self) -> Upstream:
        if self.tls is not None and self.tls.ca_file and not self.url.startswith("https:"):
            raise invalid("tls.caFile needs an https url")
        return self


# What a local Lane runs that an upstream Lane cannot honour: the upstream decides
# them. Refused at apply (camelCase, as manifests spell them).
UPSTREAM_REFUSED = (
    "replicas",
    "slots",
    "contextPerSlot",
    "threads",
    "gpuLayers",
    "kvCache",
    "flashAttention",
    "speculation",
    "idle",
    "preload",
    "health",
)


MAX_REPLICAS = 64
# The longest context of released models (2^20 tokens).
MAX_CONTEXT_PER_SLOT = 2**20
MAX_THREADS = 1024
MAX_GPU_LAYERS = 9999


class LaneSpec(CamelModel):
    # Required for llama-cpp; an upstream Lane's is its upstream.model.
    model: str
    aliases: list[str] = Field(default_factory=list)
    engine: Literal["llama-cpp", "upstream"] = "llama-cpp"
    # Upper bounds: one host; past them a manifest is a typo or an attempt to exhaust it
    # (the memory fit of what is asked for is the controller's to check).
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    slots: int = Field(default=4, ge=1, le=64)
    context_per_slot: int = Field(default=2048, ge=64, le=MAX_CONTEXT_PER_SLOT)
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    # llama.cpp's convention for "every layer" is a large number (999).
    gpu_layers: int = Field(default=0, ge=0, le=MAX_GPU_LAYERS)
    kv_cache: KVCache = Field(default_factory=KVCache)
    # llama.cpp's flash attention (its `-fa`): auto lets llama.cpp decide per device.
    flash_attention: Literal["auto", "on", "off"] = "auto"
    speculation: str | None = None
    slo_policy: str | None = None
    # Another Lane that takes, under the same SLOPolicy, the requests this one predicts
    # would miss their time-to-first-token target (`dataplane.admission`). Named as a
    # reference that may dangle: a Lane missing at request time means no spill.
    spillover: str | None = Field(default=None, min_length=1)
    idle: Idle | None = None
    # Keep the Lane resident: the memory budget never puts it to sleep to make room for
    # another, nor does a request's keep_alive. Not with idle.sleepAfter (refused).
    preload: bool = False
    # How the daemon checks the replicas' engines (an upstream's server is probed by
    # its own readiness checks instead).
    health: Health = Field(default_factory=Health)
    # validate_default so the check below also runs when `upstream` is absent.
    upstream: Upstream | None = Field(default=None, validate_default=True)

    @field_validator("aliases")
    @classmethod
    def _distinct_aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not alias or alias != alias.strip() or " " in alias:
                raise invalid(
                    f'"{alias}" is not a valid alias: use a non-empty name without spaces'
                )
        if len(set(value)) != len(value):
            raise invalid("aliases must be distinct")
        return value

    @field_validator("flash_attention")
    @classmethod
    def _quantized_v_needs_flash_attention(cls, value: str, info: ValidationInfo) -> str:
        # llama.cpp refuses to create such a context, so every replica would crash-loop.
        kv_cache = info.data.get("kv_cache")
        if value == "off" and isinstance(kv_cache, KVCache) and kv_cache.type_v in _QUANTIZED:
            raise invalid(
                f"kvCache.typeV {kv_cache.type_v} is quantized, which llama.cpp allows only "
                "with flash attention: set flashAttention to auto or on, or typeV to f16"
            )
        return value

    @field_validator("preload")
    @classmethod
    def _preload_never_sleeps(cls, value: bool, info: ValidationInfo) -> bool:
        idle = info.data.get("idle")
        if value and isinstance(idle, Idle) and idle.sleep_after is not None:
            raise invalid(
                "preload: true keeps the Lane resident, and idle.sleepAfter would put it "
                "to sleep: set one or the other (remove idle.sleepAfter to keep it loaded, "
                "or preload to let it sleep when idle)"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _upstream_lane(cls, data: Any, info: ValidationInfo) -> Any:
        """An upstream Lane names its model in upstream.model, which becomes spec.model
        (the name routing and ListModels show); a spec.model of its own is refused
        unless it is that same name (what `get -o yaml` prints applies again)."""
        if not isinstance(data, dict) or data.get("engine") != "upstream" or _stored(info):
            return data
        upstream = data.get("upstream")
        name = upstream.get("model") if isinstance(upstream, dict) else None
        if not isinstance(name, str) or not name:
            # Reported on the field (spec.upstream) by the validator below.
            return data
        if data.get("model", name) != name:
            raise invalid_at(
                "model",
                f"an upstream Lane's model is upstream.model ({name}); remove spec.model",
                data.get("model"),
            )
        return {**data, "model": name}

    @model_validator(mode="after")
    def _no_local_settings(self, info: ValidationInfo) -> LaneSpec:
        """What only a local engine does is refused on an upstream Lane. A value equal
        to the field's default changes nothing and passes, so that what `get -o yaml`
        prints (every default included) applies again."""
        if self.engine != "upstream" or _stored(info):
            return self
        fields = type(self).model_fields
        given = sorted(
            (to_camel(name), getattr(self, name))
            for name in self.model_fields_set
            if to_camel(name) in UPSTREAM_REFUSED
            and getattr(self, name) != fields[name].get_default(call_default_factory=True)
        )
        # Each at its own path (spec.slots), as every other field's error.
        refused = "not used by an upstream Lane (the upstream server decides it); remove it"
        concurrency = ", and give the upstream's parallel requests as upstream.maxConcurrency"
        if given:
            raise invalid_each(
                [
                    (field, refused + (concurrency if field == "slots" else ""), value)
                    for field, value in given
                ]
            )
        return self

    @field_validator("upstream")
    @classmethod
    def _upstream_given(cls, value: Upstream | None, info: ValidationInfo) -> Upstream | None:
        # Checked on the field rather than the model so the error points at spec.upstream.
        engine = info.data.get("engine")
        if engine == "upstream" and value is None:
            raise invalid("engine upstream requires upstream.url and upstream.model")
        if engine == "upstream" and value is not None and not value.model and not _stored(info):
            raise invalid("engine upstream requires upstream.model (the name the upstream knows)")
        if engine != "upstream" and value is not None and not _stored(info):
            raise invalid("is only for engine upstream; remove it, or set engine: upstream")
        return value


class ReplicaStatus(CamelModel):
    model_config = ConfigDict(extra="ignore")

    index: int
    pid: int | None = None
    state: str  # Starting, Ready, Draining, Stopping or Failed
    socket: str | None = None
    restarts: int = 0
    started_at: datetime | None = None
    last_exit_code: int | None = None
    # Why the last run exited (a crash's reason), shown while its replacement runs, as
    # a Pod's lastState: a first crash is restarted at once, so its Failed message
    # would otherwise be gone by the next look.
    last_exit_reason: str = ""
    # A Failed replica's restart, once its crash back-off ends: until then requests for
    # a Lane with no other replica are refused with a Retry-After that says so.
    restart_at: datetime | None = None
    message: str = ""
    # The slots its engine runs with (None: not known, the Lane's `slots`): an old
    # replica of a rollout that changes `slots` still runs the old number.
    slots: int | None = None
    # The same of the context per slot its engine holds (None: the Lane's
    # `contextPerSlot`): an old replica of a `contextPerSlot` rollout holds the old size.
    context_per_slot: int | None = None
    # Health checks a Ready replica has missed in a row: while above 0 no request is
    # routed to it, and those sent to it that have no first token yet go back to the
    # queue (`ReplicaObservation.missed_probes`).
    missed_probes: int = 0


class LaneMemory(CamelModel):
    """The fit ledger's figures for a Lane (`blazar.controller.fit`): what one replica
    needs, by part, and what the host had free for more at the last check."""

    model_config = ConfigDict(extra="ignore")

    estimate_bytes: int
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    draft_bytes: int = 0
    runtime_bytes: int = 0
    # MemAvailable less what running replicas hold beyond it (this Lane's included),
    # when the Lane's `Schedulable` verdict was reached: not refreshed while it holds.
    free_bytes: int = 0
    available_bytes: int = 0
    # The daemon's memory budget (`serve --memory-budget`), when it has one.
    budget_bytes: int | None = None
    # The waiting replica needs more than the host has in all, or than the whole
    # budget: no freeing of memory can start it (requests for it are refused).
    never_fits: bool = False
    # The replica waiting for memory, when one is.
    waiting_replica: int | None = None


class LaneStatus(ObjectStatus):
    replicas: int = 0
    ready_replicas: int = 0
    # idle.sleepAfter stopped the Lane's replicas; the next request wakes it.
    sleeping: bool = False
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list)
    memory: LaneMemory | None = None


# --- SLOPolicy -------------------------------------------------------------------


class Tenant(CamelModel):
    name: str
    weight: int = Field(default=1, ge=1)


class RateLimit(CamelModel):
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)


class SLOPolicySpec(CamelModel):
    priority: int = 0
    ttft_target_ms: int | None = Field(default=None, gt=0)
    tpot_target_ms: int | None = Field(default=None, gt=0)
    max_queue_depth: int = Field(default=64, ge=0)
    max_queue_wait_ms: int | None = Field(default=None, ge=0)
    # What a request predicted to miss ttftTargetMs gets: a refusal at once (`reject`,
    # the default when a target is set) or a wait within its bounds (`queue`). Without
    # a target nothing is predicted and every request queues, so an explicit `reject`
    # there is refused at apply (`_reject_needs_a_target`).
    on_overload: Literal["reject", "queue"] | None = None
    # The most slots of one replica that this policy's requests hold at once, so that
    # the others stay free for other policies' (urgent) requests; None: no cap. A cap
    # at or above a Lane's slots does nothing there (policies are shared by Lanes).
    max_slots_per_replica: int | None = Field(default=None, ge=1)
    # Not acted on, so refused at apply in any form (`_tenants_not_acted_on`) and shown
    # nowhere; only objects stored before the refusal still hold them.
    tenants: list[Tenant] | None = None
    rate_limit: RateLimit | None = None

    @model_validator(mode="after")
    def _reject_needs_a_target(self, info: ValidationInfo) -> SLOPolicySpec:
        if self.on_overload == "reject" and self.ttft_target_ms is None and not _stored(info):
            raise invalid(
                "onOverload: reject refuses a request predicted to miss ttftTargetMs, "
                "and this policy sets none, so every request would queue; set "
                "ttftTargetMs, or remove onOverload"
            )
        return self

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants_not_acted_on(cls, value: Any, info: ValidationInfo) -> Any:
        # Before the type check, so that a list of names or a mapping is told what a
        # list of tenants is told, not how a tenant is written. Empty sets nothing
        # (`get -o yaml` of an older daemon printed `tenants: []`).
        if value is None or value == []:
            return None
        if not _stored(info):
            raise invalid(
                _NOT_ACTED_ON.format(field="tenants", what="weighted fair sharing between tenants")
            )
        return value

    @field_validator("tenants")
    @classmethod
    def _distinct_tenants(cls, value: list[Tenant] | None) -> list[Tenant] | None:
        names = [t.name for t in value or ()]
        if len(set(names)) != len(names):
            raise invalid("tenant names must be distinct")
        return value

    @field_validator("rate_limit", mode="before")
    @classmethod
    def _rate_limit_not_acted_on(cls, value: Any, info: ValidationInfo) -> Any:
        # Before the type check, as for tenants.
        if value is not None and not _stored(info):
            raise invalid(_NOT_ACTED_ON.format(field="rateLimit", what="rate limiting per tenant"))
        return value


# A knob the daemon would store and ignore is refused instead (stored objects that
# already have one still load: `manifests.from_dict`).
_NOT_ACTED_ON = (
    "is not supported on an SLOPolicy: {what} is set per tenant in the auth file "
    "(`blazar serve --auth-file`, docs/SECURITY.md); remove {field}"
)


class SLOPolicyStatus(ObjectStatus):
    pass


# --- SpecPair --------------------------------------------------------------------


class NgramDraft(CamelModel):
    kind: Literal["ngram"]
    ngram_size: int = Field(default=3, ge=1, le=8)
    max_draft_tokens: int = Field(default=8, ge=1, le=32)


class ModelDraft(CamelModel):
    kind: Literal["model"]
    model: str
    max_draft_tokens: int = Field(default=8, ge=1, le=32)


class SpecPairSpec(CamelModel):
    target: str
    draft: Annotated[NgramDraft | ModelDraft, Field(discriminator="kind")]
    disable_above_batch: int = Field(default=4, ge=1)
    min_acceptance_rate: float = Field(default=0.3, ge=0.0, le=1.0)


class SpecPairStatus(ObjectStatus):
    pass


# --- the resources ---------------------------------------------------------------


class Model(CamelModel):
    """A GGUF file and where it comes from."""

    api_version: ApiVersion = API_VERSION
    kind: Literal["Model"] = "Model"
    metadata: ObjectMeta
    spec: ModelSpec
    status: ModelStatus = Field(default_factory=ModelStatus)

    @property
    def status_current(self) -> bool:
        """Whether the status was written for the current spec (its generation)."""
        return self.status.observed_generation == (self.metadata.generation or 0)


class Lane(CamelModel):
    """A served model: engine processes and how requests reach them."""

    api_version: ApiVersion = API_VERSION
    kind: Literal["Lane"] = "Lane"
    metadata: ObjectMeta
    spec: LaneSpec
    status: LaneStatus = Field(default_factory=LaneStatus)

    @field_validator("spec")
    @classmethod
    def _spillover_elsewhere(cls, value: LaneSpec, info: ValidationInfo) -> LaneSpec:
        metadata = info.data.get("metadata")
        if (
            value.spillover is not None
            and isinstance(metadata, ObjectMeta)
            and value.spillover == metadata.name
            and not _stored(info)
        ):
            raise invalid_at(
                "spillover",
                f"names this Lane itself ({metadata.name}); name another Lane, or remove spillover",
                value.spillover,
            )
        return value


class SLOPolicy(CamelModel):
    """How requests are admitted and ordered."""

    api_version: ApiVersion = API_VERSION
    kind: Literal["SLOPolicy"] = "SLOPolicy"
    metadata: ObjectMeta
    spec: SLOPolicySpec
    status: SLOPolicyStatus = Field(default_factory=SLOPolicyStatus)


class SpecPair(CamelModel):
    """Speculative decoding for a target model."""

    api_version: ApiVersion = API_VERSION
    kind: Literal["SpecPair"] = "SpecPair"
    metadata: ObjectMeta
    spec: SpecPairSpec
    status: SpecPairStatus = Field(default_factory=SpecPairStatus)


Resource = Annotated[Model | Lane | SLOPolicy | SpecPair, Field(discriminator="kind")]

KIND_CLASSES: dict[Kind, type[Model | Lane | SLOPolicy | SpecPair]] = {
    Kind.MODEL: Model,
    Kind.LANE: Lane,
    Kind.SLO_POLICY: SLOPolicy,
    Kind.SPEC_PAIR: SpecPair,
}

_STATUS_CLASSES: dict[Kind, type[ObjectStatus]] = {
    Kind.MODEL: ModelStatus,
    Kind.LANE: LaneStatus,
    Kind.SLO_POLICY: SLOPolicyStatus,
    Kind.SPEC_PAIR: SpecPairStatus,
}

_KIND_NAMES: dict[str, Kind] = {
    "model": Kind.MODEL,
    "models": Kind.MODEL,
    "lane": Kind.LANE,
    "lanes": Kind.LANE,
    "slopolicy": Kind.SLO_POLICY,
    "slopolicies": Kind.SLO_POLICY,
    "slo": Kind.SLO_POLICY,
    "specpair": Kind.SPEC_PAIR,
    "specpairs": Kind.SPEC_PAIR,
    "sp": Kind.SPEC_PAIR,
}


def resolve_kind(text: str) -> Kind:
    """Map what a user types (`lanes`, `SLO`, `sp`) to a Kind, as kubectl does."""
    found = _KIND_NAMES.get(text.strip().lower())
    if found is None:
        raise errors.InvalidRequest(
            f'unknown kind "{text}"; valid kinds are model (models), lane (lanes), '
            "slopolicy (slopolicies, slo), specpair (specpairs, sp)",
            metadata={"kind": text},
        )
    return found


def status_class(kind: Kind) -> type[ObjectStatus]:
    return _STATUS_CLASSES[kind]


def key(resource: Resource) -> tuple[Kind, str]:
    return Kind(resource.kind), resource.metadata.name


def references(resource: Resource) -> list[tuple[str, Kind, str]]:
    """The objects `resource` names, as (spec field path in camelCase, kind, name).

    An upstream Lane's `model` is the name the remote server knows, not a Model
    object, so it is not a reference.
    """
    refs: list[tuple[str, Kind, str]] = []
    if isinstance(resource, Lane):
        spec = resource.spec
        if spec.engine != "upstream":
            refs.append(("spec.model", Kind.MODEL, spec.model))
        if spec.slo_policy is not None:
            refs.append(("spec.sloPolicy", Kind.SLO_POLICY, spec.slo_policy))
        if spec.speculation is not None:
            refs.append(("spec.speculation", Kind.SPEC_PAIR, spec.speculation))
    elif isinstance(resource, SpecPair):
        refs.append(("spec.target", Kind.MODEL, resource.spec.target))
        if isinstance(resource.spec.draft, ModelDraft):
            refs.append(("spec.draft.model", Kind.MODEL, resource.spec.draft.model))
    return refs
