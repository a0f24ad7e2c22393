"""Which SLOPolicy admits a request."""

from __future__ import annotations

import pytest

from blazar.api import errors
from blazar.api.kinds import SLOPolicySpec
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
