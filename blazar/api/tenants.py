"""Tenants and their API keys: the file `blazar serve --auth-file FILE` reads.

    tenants:
      - name: alice
        keys: ["sha256:9f86d08...15b0f00a08"]  # SHA-256 of each key, never a key itself
        lanes: ["*"]                           # Lanes or aliases it may use; "*": all
        admin: true                            # may call Control (apply, get, delete, ...)
        rateLimit: {requestsPerMinute: 60, tokensPerMinute: 100000}
        weight: 2                              # its share of a Lane inside a priority tier
        sloPolicies: ["*"]                     # SLOPolicies it may name; "*": all
        keepAlive: true                        # may say how long a Lane stays loaded
      - name: ci
        keys: ["sha256:..."]
        lanes: [gemma3]
        sloPolicies: [batch]

`blazar auth key` prints a new random key and the line to put in `keys`. A request's
key is hashed and compared with every tenant's digests in constant time, so neither
the file nor the comparison tells anything about a key it does not hold.

A tenant that names a Lane (or any of a Lane's aliases) may use that Lane under all
its names. `admin` only opens Control; it does not widen `lanes` or `sloPolicies`.

A request that names no SLOPolicy runs under its Lane's, and naming the Lane's own is
the same; naming any other (`x-blazar-slo`, the `slo` field) needs the tenant's
`sloPolicies` to list it. Without that, one tenant could mark its work as another's
priority and have it admitted first, parking theirs.

A request's `keep_alive` (Ollama's, the gRPC `keep_alive_s`) says how long its Lane
stays loaded for every tenant: 0 unloads it now, under the others' requests, losing
their cached prompts; a long or negative one keeps it in memory another Lane could
use. So setting it needs the tenant's `keepAlive`; without that a request that sets it
is refused, not served as if it had not.

Pure: parsing, validation and key checks; who calls with which key is the data
plane's (`blazar.dataplane.access`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pydantic
import yaml
from pydantic import Field, field_validator

from blazar.api import clip
from blazar.api.meta import CamelModel, invalid, is_name

DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# What `blazar auth key` makes: 32 random bytes, URL-safe, with a prefix that secret
# scanners and people can recognise.
KEY_PREFIX = "bz-"
ALL_LANES = "*"
ALL_POLICIES = "*"


class AuthFileInvalid(ValueError):
    """The auth file cannot be used; the message is one line naming the problem."""


class RateLimit(CamelModel):
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)


class Tenant(CamelModel):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    keys: list[str] = Field(min_length=1)
    lanes: list[str] = Field(default_factory=list)
    admin: bool = False
    rate_limit: RateLimit | None = None
    weight: float = Field(default=1.0, gt=0, le=1000)
    slo_policies: list[str] = Field(default_factory=list)
    keep_alive: bool = False

    @field_validator("keys")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for i, key in enumerate(value):
            if not _DIGEST.match(key):
                raise invalid(
                    f"keys[{i}] is not a key's digest: write sha256:<64 lowercase hex "
                    "digits>, the SHA-256 of the key, never the key itself "
                    "(`blazar auth key` makes a key and its digest)"
                )
        if len(set(value)) != len(value):
            raise invalid("a digest is listed twice")
        return value

    @field_validator("slo_policies")
    @classmethod
    def _policy_names(cls, value: list[str]) -> list[str]:
        # An entry no SLOPolicy can be named (names are DNS labels: `meta.is_name`) would
        # grant nothing, silently: a typo ("Batch", " batch") is told at load instead.
        for i, name in enumerate(value):
            if not name.strip():
                raise invalid(f'sloPolicies[{i}] is empty: name an SLOPolicy, or "*" for all')
            if name != ALL_POLICIES and not is_name(name):
                raise invalid(
                    f"sloPolicies[{i}] {json.dumps(name, ensure_ascii=False)} is not an "
                    "SLOPolicy name (lowercase letters, digits and '-'); name one, or "
                    '"*" for all'
                )
        return value

    def may_use(self, names: Iterable[str]) -> bool:
        """Whether the tenant may use the Lane known by `names` (its name and aliases)."""
        allowed = set(self.lanes)
        return ALL_LANES in allowed or not allowed.isdisjoint(names)

    def may_name(self, policy: str) -> bool:
        """Whether the tenant may name the SLOPolicy `policy` on a request (its Lane's
        own needs no permission: see `blazar.dataplane.policies.resolve`)."""
        return ALL_POLICIES in self.slo_policies or policy in self.slo_policies


class AuthFile(CamelModel):
    tenants: list[Tenant] = Field(min_length=1)

    @field_validator("tenants")
    @classmethod
    def _distinct(cls, value: list[Tenant]) -> list[Tenant]:
        names = [t.name for t in value]
        for name in names:
            if names.count(name) > 1:
                raise invalid(f"tenant '{name}' is listed twice")
        seen: dict[str, str] = {}
        for tenant in value:
            for key in tenant.keys:
                if key in seen:
                    raise invalid(
                        f"tenants '{seen[key]}' and '{tenant.name}' hold the same key digest"
                    )
                seen[key] = tenant.name
        return value


@dataclass(frozen=True)
class Tenants:
    """The tenants of one auth file, ready to check keys against."""

    tenants: tuple[Tenant, ...]
    _digests: tuple[tuple[bytes, Tenant], ...]

    @classmethod
    def of(cls, auth: AuthFile) -> Tenants:
        digests = tuple(
            (bytes.fromhex(key[len(DIGEST_PREFIX) :]), tenant)
            for tenant in auth.tenants
            for key in tenant.keys
        )
        return cls(tuple(auth.tenants), digests)

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant holding `key`; None when none does. Every digest is compared, in
        constant time, whichever matches."""
        presented = hashlib.sha256(key.encode()).digest()
        found: Tenant | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def by_name(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)


def parse(text: str, *, source: str) -> Tenants:
    """The tenants of an auth file's text; AuthFileInvalid naming the first problems."""
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise AuthFileInvalid(f"auth file {source}: invalid YAML{where}") from None
    if not isinstance(data, dict):
        raise AuthFileInvalid(f"auth file {source}: expected a mapping with `tenants`")
    try:
        auth = AuthFile.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = [
            f"{_dotted(err['loc'])}: {err['msg']}" if err["loc"] else err["msg"]
            for err in exc.errors(include_url=False)
        ]
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise AuthFileInvalid(clip.clip(f"auth file {source}: {shown}", 500)) from None
    return Tenants.of(auth)


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for segment in loc:
        out += f"[{segment}]" if isinstance(segment, int) else (f".{segment}" if out else segment)
    return out


def digest(key: str) -> str:
    """The line for `keys`: `sha256:` and the key's SHA-256 in hex."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer(authorization: str) -> str | None:
    """The key in an `authorization` value (`Bearer <key>`, the scheme in any case);
    None when it holds none."""
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key
