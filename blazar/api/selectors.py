"""Label selectors: kubectl's equality-based grammar, parsed in one place (pure).

    key=value, key==value   the label `key` is `value`
    key!=value              `key` is not `value`, or the object has no `key`
    key                     the object has a label `key`
    !key                    the object has no label `key`

Requirements are comma-separated and must all hold; the empty selector matches every
object. Keys and values follow Kubernetes' label syntax (an optional DNS-subdomain
prefix and `/`, then up to 63 of `[A-Za-z0-9_.-]` starting and ending alphanumeric).
Anything else, set-based requirements (`key in (a,b)`, `notin`) included, is refused
with an InvalidRequest that names the selector, rather than read as some other key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from blazar.api import errors

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/"
_KEY = rf"(?:{_PREFIX})?{_NAME}"
_EXISTS = re.compile(rf"(?P<not>!?)\s*(?P<key>{_KEY})")
_EQUALITY = re.compile(rf"(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>(?:{_NAME})?)")
_SET_BASED = re.compile(r"\s(?:not)?in\s*\(")


class Operator(StrEnum):
    EQUALS = "="
    NOT_EQUALS = "!="
    EXISTS = "exists"
    DOES_NOT_EXIST = "!"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    value: str = ""

    def matches(self, labels: Mapping[str, str]) -> bool:
        match self.operator:
            case Operator.EQUALS:
                return labels.get(self.key) == self.value
            case Operator.NOT_EQUALS:
                return labels.get(self.key) != self.value
            case Operator.EXISTS:
                return self.key in labels
            case Operator.DOES_NOT_EXIST:
                return self.key not in labels


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def parse(text: str) -> Selector:
    """The selector `text` says; InvalidRequest naming it when it says nothing valid."""
    if not text.strip():
        return Selector()
    if _SET_BASED.search(text):
        raise _bad(text, "set-based requirements (in, notin) are not supported")
    return Selector(tuple(_requirement(text, part.strip()) for part in text.split(",")))


def _requirement(text: str, part: str) -> Requirement:
    if found := _EQUALITY.fullmatch(part):
        op = Operator.NOT_EQUALS if found["op"] == "!=" else Operator.EQUALS
        return Requirement(found["key"], op, found["value"])
    if found := _EXISTS.fullmatch(part):
        op = Operator.DOES_NOT_EXIST if found["not"] else Operator.EXISTS
        return Requirement(found["key"], op)
    raise _bad(text, f"cannot read '{part}'" if part else "empty requirement")


def _bad(text: str, why: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"Bad label selector '{text}': {why}; expected comma-separated key=value, "
        "key==value, key!=value, key or !key."
    )
