"""`blazar.api.selectors`: kubectl's equality-based label selectors, and nothing else."""

from __future__ import annotations

import pytest

from blazar.api import errors, selectors
from blazar.api.selectors import Operator, Requirement

EQ, NE, EXISTS, ABSENT = (
    Operator.EQUALS,
    Operator.NOT_EQUALS,
    Operator.EXISTS,
    Operator.DOES_NOT_EXIST,
)


@pytest.mark.parametrize(
    ("text", "requirements"),
    [
        ("", ()),
        ("   ", ()),
        ("a=b", (Requirement("a", EQ, "b"),)),
        ("a==b", (Requirement("a", EQ, "b"),)),
        ("a!=b", (Requirement("a", NE, "b"),)),
        ("a", (Requirement("a", EXISTS),)),
        ("!a", (Requirement("a", ABSENT),)),
        ("! a", (Requirement("a", ABSENT),)),
        ("a=", (Requirement("a", EQ, ""),)),
        ("a!=", (Requirement("a", NE, ""),)),
        (" a = b , c != d ", (Requirement("a", EQ, "b"), Requirement("c", NE, "d"))),
        (
            "a=b,c,!d",
            (Requirement("a", EQ, "b"), Requirement("c", EXISTS), Requirement("d", ABSENT)),
        ),
        ("blazar.dev/tier=small", (Requirement("blazar.dev/tier", EQ, "small"),)),
        ("app.kubernetes.io/name=x-1_2.3", (Requirement("app.kubernetes.io/name", EQ, "x-1_2.3"),)),
        ("Family=Gemma3", (Requirement("Family", EQ, "Gemma3"),)),
    ],
)
def test_parse(text: str, requirements: tuple[Requirement, ...]) -> None:
    assert selectors.parse(text) == selectors.Selector(requirements)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("family in (gemma,llama)", "set-based requirements"),
        ("family notin (gemma)", "set-based requirements"),
        ("family!", "cannot read 'family!'"),
        ("=b", "cannot read '=b'"),
        ("a=b=c", "cannot read 'a=b=c'"),
        ("a=b,", "empty requirement"),
        ("a=b,,c", "empty requirement"),
        ("!a=b", "cannot read '!a=b'"),
        ("!!a", "cannot read '!!a'"),
        ("a b", "cannot read 'a b'"),
        ("a=b c", "cannot read 'a=b c'"),
        ("-a=b", "cannot read '-a=b'"),
        ("a=b-", "cannot read 'a=b-'"),
        ("a>1", "cannot read 'a>1'"),
        ("a/=b", "cannot read 'a/=b'"),
        ("x" * 64 + "=b", "cannot read"),
        ("a=" + "x" * 64, "cannot read"),
    ],
)
def test_parse_refuses(text: str, why: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        selectors.parse(text)
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith(f"Bad label selector '{text}': {why}")


@pytest.mark.parametrize(
    ("text", "labels", "matches"),
    [
        ("", {}, True),
        ("a=b", {"a": "b"}, True),
        ("a=b", {"a": "c"}, False),
        ("a=b", {}, False),
        ("a!=b", {"a": "c"}, True),
        ("a!=b", {}, True),  # Kubernetes: an object without the key is "not b"
        ("a!=b", {"a": "b"}, False),
        ("a", {"a": ""}, True),
        ("a", {"b": "a"}, False),
        ("!a", {}, True),
        ("!a", {"a": "b"}, False),
        ("a=", {"a": ""}, True),
        ("a=", {}, False),
        ("a=b,c", {"a": "b", "c": "x"}, True),
        ("a=b,c", {"a": "b"}, False),
        ("a=b,!c", {"a": "b", "c": "x"}, False),
    ],
)
def test_matches(text: str, labels: dict[str, str], matches: bool) -> None:
    assert selectors.parse(text).matches(labels) is matches
