"""`blazar.api.tenants`: the auth file, key digests and key checks."""

from __future__ import annotations

import hashlib

import pytest

from blazar.api import tenants

KEY = "bz-test-key"
DIGEST = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
OTHER = tenants.digest("bz-other")


def test_digest_is_the_keys_sha256_and_new_keys_differ() -> None:
    assert tenants.digest(KEY) == DIGEST
    a, b = tenants.new_key(), tenants.new_key()
    assert a != b and a.startswith("bz-") and len(a) > 40


def test_a_file_parses_with_defaults() -> None:
    parsed = tenants.parse(
        f"tenants:\n- name: alice\n  keys: [{DIGEST}]\n  lanes: ['*']\n  admin: true\n"
        f"  rateLimit: {{requestsPerMinute: 60, tokensPerMinute: 1000}}\n  weight: 2\n"
        f"  sloPolicies: [batch]\n"
        f"- name: bob\n  keys: [{OTHER}]\n",
        source="auth.yaml",
    )
    alice, bob = parsed.tenants
    assert alice.admin and alice.weight == 2 and alice.rate_limit is not None
    assert alice.rate_limit.requests_per_minute == 60
    assert alice.slo_policies == ["batch"]
    assert (bob.admin, bob.weight, bob.lanes, bob.rate_limit) == (False, 1.0, [], None)
    assert bob.slo_policies == []


def test_authenticate_finds_the_holder_only() -> None:
    parsed = tenants.parse(
        f"tenants: [{{name: a, keys: [{OTHER}, {DIGEST}]}}, {{name: b, keys: [{tenants.digest('x')}]}}]",
        source="f",
    )
    found = parsed.authenticate(KEY)
    assert found is not None and found.name == "a"
    assert parsed.authenticate("x") is parsed.by_name("b")
    assert parsed.authenticate("bz-wrong") is None
    assert parsed.authenticate("") is None
    # The digest itself is not a key.
    assert parsed.authenticate(DIGEST) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tenants: [", "invalid YAML at line 1"),
        ("- a\n- b\n", "expected a mapping with `tenants`"),
        ("tenants: []", "tenants: List should have at least 1 item"),
        (
            f"tenants: [{{name: a, keys: [{KEY}]}}]",
            "tenants[0].keys: keys[0] is not a key's digest",
        ),
        (f"tenants: [{{name: a, keys: ['{DIGEST.upper()}']}}]", "is not a key's digest"),
        ("tenants: [{name: a, keys: []}]", "tenants[0].keys: List should have at least 1 item"),
        (f"tenants: [{{name: a, keys: [{DIGEST}, {DIGEST}]}}]", "a digest is listed twice"),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}]}}, {{name: a, keys: [{OTHER}]}}]",
            "tenant 'a' is listed twice",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}]}}, {{name: b, keys: [{DIGEST}]}}]",
            "tenants 'a' and 'b' hold the same key digest",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], weight: 0}}]",
            "tenants[0].weight: Input should be greater than 0",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], rateLimit: {{requestsPerMinute: 0}}}}]",
            "tenants[0].rateLimit.requestsPerMinute",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], admn: true}}]",
            "tenants[0].admn: Extra inputs are not permitted",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], sloPolicies: ['']}}]",
            "tenants[0].sloPolicies: sloPolicies[0] is empty",
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], sloPolicies: batch}}]",
            "tenants[0].sloPolicies: Input should be a valid list",
        ),
        # Never a policy's name (names are lowercase DNS labels): a typo granting nothing.
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], sloPolicies: [batch, Interactive]}}]",
            'tenants[0].sloPolicies: sloPolicies[1] "Interactive" is not an SLOPolicy name',
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], sloPolicies: [' batch']}}]",
            'sloPolicies[0] " batch" is not an SLOPolicy name',
        ),
        (
            f"tenants: [{{name: a, keys: [{DIGEST}], sloPolicies: ['batch*']}}]",
            'sloPolicies[0] "batch*" is not an SLOPolicy name',
        ),
        (
            f"tenants: [{{name: 'a b', keys: [{DIGEST}]}}]",
            "tenants[0].name: String should match pattern",
        ),
    ],
)
def test_a_bad_file_is_one_line_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(tenants.AuthFileInvalid) as info:
        tenants.parse(text, source="auth.yaml")
    message = str(info.value)
    assert message.startswith("auth file auth.yaml: ")
    assert problem in message
    assert "\n" not in message
    # A key in clear is never echoed back.
    assert KEY not in message


@pytest.mark.parametrize(
    ("lanes", "names", "allowed"),
    [
        (["*"], ("gemma3", "default"), True),
        (["gemma3"], ("gemma3", "default"), True),
        (["default"], ("gemma3", "default"), True),  # an alias grants its Lane
        (["other"], ("gemma3", "default"), False),
        ([], ("gemma3",), False),
    ],
)
def test_may_use_a_lane_by_any_of_its_names(
    lanes: list[str], names: tuple[str, ...], allowed: bool
) -> None:
    tenant = tenants.Tenant(name="t", keys=[DIGEST], lanes=lanes)
    assert tenant.may_use(names) is allowed


@pytest.mark.parametrize(
    ("allowed", "policy", "may"),
    [(["*"], "interactive", True), (["batch"], "batch", True), (["batch"], "interactive", False),
     ([], "batch", False)],
)  # fmt: skip
def test_may_name_the_policies_it_lists(allowed: list[str], policy: str, may: bool) -> None:
    assert tenants.Tenant(name="t", keys=[DIGEST], slo_policies=allowed).may_name(policy) is may


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("BEARER abc", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("abc", None),
        ("", None),
    ],
)
def test_bearer(value: str, key: str | None) -> None:
    assert tenants.bearer(value) == key
