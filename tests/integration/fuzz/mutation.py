"""What every fuzz run shares: JSON with raw parts (`Raw`, `dump`) and mutations of a
valid document a few fields at a time (`mutated`), then of its bytes (`damaged`).

Mutating a valid document rather than generating noise is what gets past parsing into
validation and conversion, and on to the engine. A mutation replaces a value with one
of the wrong type, a huge or negative number, NaN or infinity, a deeply nested array, a
huge string or a lone surrogate; deletes a field; adds an unknown one; or wraps a value
in a list.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# ---------------------------------------------------------------- JSON with raw parts


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is: what `json.dumps` will not write (NaN,
    1e999, a lone surrogate escape, nesting deeper than its recursion limit)."""

    text: str


def dump(value: Any) -> str:
    """`value` as JSON text, each `Raw` as it is. The encoding is json's own (C, fast
    on bodies with 20,000-element lists): each Raw goes in as a placeholder string."""
    raws: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(node, dict):
            return {swap(k): swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    # ensure_ascii: a surrogate hypothesis drew becomes an escape, as a client would send it.
    text = json.dumps(swap(value))
    return _PLACEHOLDER.sub(lambda found: raws[int(found[1])], text) if raws else text


_PLACEHOLDER = re.compile(r'"\\u0000raw(\d+)\\u0000"')


Path_ = tuple[str | int, ...]


def walk(body: Any, path: Path_) -> Any:
    """The node at `path` in `body`, or None where the path leads nowhere."""
    node = body
    for key in path:
        if isinstance(node, dict) and isinstance(key, str):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
    return node


# ---------------------------------------------------------------- mutations

INTERESTING_NUMBERS = st.sampled_from(
    [
        *(0, -1, 1, 2, -2, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63, -(2**63)),
        *(2**64, 10**30, 0.5, -0.0, 1e-320, 1.7976931348623157e308, -1e308, 2.5),
    ]
)
RAW_VALUES = st.sampled_from(
    [
        Raw("NaN"),
        Raw("Infinity"),
        Raw("-Infinity"),
        Raw("1e999"),
        Raw("-1e999"),
        Raw("1E400"),
        Raw("1e-400"),
        Raw("-0"),
        Raw("1" + "0" * 5000),  # past CPython's 4,300-digit int conversion limit
        Raw("12345678901234567890123456789012345678901234567890"),
        Raw('"\\ud800"'),  # a lone high surrogate
        Raw('"x\\udfffy"'),  # a lone low surrogate
        Raw('"\\udbff\\udfff"'),  # a valid pair: U+10FFFF
        Raw('"a\\u0000b"'),
        Raw('"\\u202e\\u2028\\ufeff"'),
    ]
)


def _nested(depth: int, *, obj: bool) -> Raw:
    if obj:
        return Raw('{"a":' * depth + "1" + "}" * depth)
    return Raw("[" * depth + "]" * depth)


NESTED = st.builds(
    _nested, st.sampled_from([20, 100, 500, 900, 990, 1100, 5000, 100_000]), obj=st.booleans()
)
HUGE = st.sampled_from(
    [
        "x" * 100_000,
        "word " * 40_000,
        "\U0001f642" * 50_000,
        "<start_of_turn>user\n" * 2_000,
    ]
)
HUGE_LISTS = st.sampled_from([["x"] * 5_000, [1] * 20_000, [[1, 2]] * 3_000, [{}] * 5_000])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    INTERESTING_NUMBERS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            *("", " ", "null", "0", "-1", "1e999", "auto", "none", "required", "json", "function"),
            *(
                "user",
                "assistant",
                "tool",
                "system",
                "text",
                "base64",
                "5m",
                "-1h",
                "\x00",
                "\u2028",
            ),
        ]
    ),
)
CONTAINERS = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
WEIRD = st.one_of(SCALARS, CONTAINERS, RAW_VALUES, NESTED)
# Large values: up to 600 kB of JSON each, one per body (see `mutated`).
LARGE = st.one_of(HUGE, HUGE_LISTS)
UNKNOWN_KEYS = st.one_of(
    st.text(max_size=10),
    st.sampled_from(
        ["__proto__", "constructor", "model ", "MODEL", "", "$ref", "$schema", "options"]
    ),
    st.just(Raw('"\\ud800key"')),
)


def paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every position in a body (not the root)."""
    found: list[Path_] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                found.append((*prefix, key))
                found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.append((*prefix, i))
            found += paths(value, (*prefix, i))
    return found


def containers(node: Any, prefix: Path_ = ()) -> list[Path_]:
    found = [prefix] if isinstance(node, dict | list) else []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                found += containers(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += containers(value, (*prefix, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """`body` after 0 to 3 mutations, and what they were. A large value (`LARGE`) ends
    the mutations: mutating inside it, or adding more, makes bodies of many MB that
    only test the size limit, slowly."""
    done: list[str] = []
    large = False

    def weird() -> Any:
        nonlocal large
        large = draw(st.integers(0, 9)) == 0
        return copy.deepcopy(draw(LARGE if large else WEIRD))

    # Strategies hand out shared objects (st.just, sampled_from): mutate copies only.
    current: Any = copy.deepcopy(body)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "wrap"]))
        if kind == "add":
            spots = containers(current)
            if not spots:
                continue
            spot = draw(st.sampled_from(spots))
            node = walk(current, spot) if spot else current
            value = weird()
            if isinstance(node, dict):
                key = draw(UNKNOWN_KEYS)
                node[key] = value
                done.append(f"add {spot}+{key!r}")
            elif isinstance(node, list):
                node.insert(draw(st.integers(0, len(node))), value)
                done.append(f"insert into {spot}")
        else:
            places = paths(current)
            if not places:
                continue
            path = draw(st.sampled_from(places))
            parent = walk(current, path[:-1]) if path[:-1] else current
            key = path[-1]
            if kind == "delete":
                if isinstance(parent, dict):
                    parent.pop(key, None)
                elif isinstance(parent, list) and isinstance(key, int):
                    del parent[key]
                done.append(f"delete {path}")
            else:
                old = parent[key]
                new = [old] if kind == "wrap" else weird()
                parent[key] = new
                done.append(f"{kind} {path}")
        # A large value's lists share their elements (`[[1, 2]] * 3_000`): a mutation
        # inside one changes every copy at once (a 72 MB body once).
        if large:
            break
    return current, done


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> tuple[bytes, str]:
    """The encoded body, most often as it is, else damaged as bytes."""
    kind = draw(
        st.sampled_from(["none"] * 16 + ["truncate", "bad-utf8", "utf16", "bom", "replace"])
    )
    if kind == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))], kind
    if kind == "bad-utf8":
        at = draw(st.integers(0, len(data)))
        junk = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])
        )
        return data[:at] + junk + data[at:], kind
    if kind == "utf16":
        return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"), kind
    if kind == "bom":
        return b"\xef\xbb\xbf" + data, kind
    if kind == "replace":
        other = draw(
            st.one_of(
                st.sampled_from([b"", b"null", b"[]", b'"x"', b"1", b"{", b"a=b&c=d", b"{}" * 3]),
                st.binary(max_size=64),
            )
        )
        return other, kind
    return data, kind
