"""Which SLOPolicy admits a request: the one it names, else its Lane's, else the
built-in `admission.FIFO_POLICY`.

Pure: the caller passes a lookup of stored policies. A request names its policy with
the `slo` field of ChatRequest / CompleteRequest, or gRPC metadata `x-blazar-slo` (the
HTTP shim's header of the same name fills the field); the field wins. With an auth file,
a tenant may name only the policies its `sloPolicies` list, and its Lane's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from blazar.api import errors
from blazar.api.kinds import SLOPolicySpec
from blazar.api.tenants import Tenant
from blazar.dataplane import admission

# gRPC metadata naming the policy, for callers that cannot set the field (a proxy).
METADATA_KEY = "x-blazar-slo"

# A name is echoed back at most this long (see errors.ModelNotFound).
_ECHO_MAX_CHARS = 200


def requested(field: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The policy name a request asks for; empty when it names none."""
    if field:
        return field
    for key, value in metadata:
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def resolve(
    named: str,
    *,
    lane_policy: str | None,
    lookup: Callable[[str], SLOPolicySpec | None],
    tenant: Tenant | None = None,
) -> admission.Policy:
    """The request's policy. A name the request gives that no SLOPolicy has is the
    caller's mistake (InvalidRequest, naming it). A Lane whose `sloPolicy` is gone is
    the operator's (the Lane reports it); its requests are served under FIFO meanwhile.

    A `tenant` (None: the owner, or no auth file) that names a policy other than its
    Lane's needs its `sloPolicies` to list it: PolicyNotPermitted. That is asked before
    whether the policy exists, so that the answer says nothing of which names do."""
    if named:
        shown = named if len(named) <= _ECHO_MAX_CHARS else named[:_ECHO_MAX_CHARS] + "..."
        if tenant is not None and named != lane_policy and not tenant.may_name(named):
            raise errors.PolicyNotPermitted(
                f"Tenant '{tenant.name}' may not name the SLOPolicy '{shown}' (its "
                "`sloPolicies` in the auth file do not list it); send no policy to run "
                "under the Lane's own.",
                metadata={errors.FIELD_KEY: "slo", "tenant": tenant.name, "policy": shown},
            )
        spec = lookup(named)
        if spec is None:
            raise errors.InvalidRequest(
                f"The SLOPolicy '{shown}' does not exist (the request names it in `slo` or "
                f"the {METADATA_KEY} header); name an existing SLOPolicy, or none to use "
                "the Lane's.",
                metadata={errors.FIELD_KEY: "slo", "policy": shown},
            )
        return admission.Policy.of(named, spec)
    if lane_policy:
        spec = lookup(lane_policy)
        if spec is not None:
            return admission.Policy.of(lane_policy, spec)
    return admission.FIFO_POLICY
