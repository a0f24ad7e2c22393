"""Which SLOPolicy admits a request."""

from __future__ import annotations

import pytest

from blazar.api import errors
from blazar.api.kinds import SLOPolicySpec
from blazar.api.tenants import Tenant
from blazar.dataplane import admission, policies

STORED = {
    "interactive": SLOPolicySpec(priority=100, ttft_target_ms=2000),
    "batch": SLOPolicySpec(priority=0, on_overload="queue"),
}


@pytest.mark.parametrize(
    ("named", "lane_policy", "expected"),
    [
        ("interactive", "batch", "interactive"),
        ("", "batch", "batch"),
        ("", None, admission.FIFO_POLICY.name),
        # A Lane whose policy was deleted serves FIFO (the Lane reports the reference).
        ("", "gone", admission.FIFO_POLICY.name),
    ],
)
def test_the_request_then_the_lane_then_fifo(
    named: str, lane_policy: str | None, expected: str
) -> None:
    policy = policies.resolve(named, lane_policy=lane_policy, lookup=STORED.get)
    assert policy.name == expected
    if expected in STORED:
        assert policy == admission.Policy.of(expected, STORED[expected])


def test_an_unknown_policy_the_request_names_is_invalid_and_named() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        policies.resolve("nosuch", lane_policy="batch", lookup=STORED.get)
    assert "'nosuch'" in info.value.message
    assert info.value.metadata == {errors.FIELD_KEY: "slo", "policy": "nosuch"}


DIGEST = "sha256:" + "0" * 64


@pytest.mark.parametrize(
    ("allowed", "named", "lane_policy", "expected"),
    [
        # Its Lane's own, by name or not, needs nothing.
        ([], "batch", "batch", "batch"),
        ([], "", "batch", "batch"),
        (["interactive"], "interactive", "batch", "interactive"),
        (["*"], "interactive", "batch", "interactive"),
        (["*"], "interactive", None, "interactive"),
    ],
)
def test_a_tenant_names_the_policies_it_lists_and_its_lanes(
    allowed: list[str], named: str, lane_policy: str | None, expected: str
) -> None:
    tenant = Tenant(name="ci", keys=[DIGEST], slo_policies=allowed)
    policy = policies.resolve(named, lane_policy=lane_policy, lookup=STORED.get, tenant=tenant)
    assert policy.name == expected


@pytest.mark.parametrize(
    ("allowed", "named", "lane_policy"),
    [
        ([], "interactive", "batch"),
        (["batch"], "interactive", "batch"),
        ([], "interactive", None),  # a Lane under the built-in FIFO
        # Refused before it is looked up: the answer says nothing of which names exist.
        ([], "nosuch", "batch"),
    ],
)
def test_a_tenant_naming_a_policy_it_does_not_list_is_refused_and_told_why(
    allowed: list[str], named: str, lane_policy: str | None
) -> None:
    tenant = Tenant(name="ci", keys=[DIGEST], slo_policies=allowed)
    with pytest.raises(errors.PolicyNotPermitted) as info:
        policies.resolve(named, lane_policy=lane_policy, lookup=STORED.get, tenant=tenant)
    assert info.value.code == "PERMISSION_DENIED"
    assert f"'{named}'" in info.value.message and "'ci'" in info.value.message
    assert "sloPolicies" in info.value.message
    assert info.value.metadata == {errors.FIELD_KEY: "slo", "tenant": "ci", "policy": named}


@pytest.mark.parametrize(
    ("field", "metadata", "expected"),
    [
        ("batch", [("x-blazar-slo", "interactive")], "batch"),
        ("", [("x-request-id", "r"), ("x-blazar-slo", "interactive")], "interactive"),
        ("", [("x-blazar-slo", b"interactive")], "interactive"),
        ("", [], ""),
    ],
)
def test_the_field_wins_over_metadata(
    field: str, metadata: list[tuple[str, str | bytes]], expected: str
) -> None:
    assert policies.requested(field, metadata) == expected
