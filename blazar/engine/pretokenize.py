"""llama.cpp's special-token partition, reproduced in time close to linear in the text.

Before it tokenizes, llama.cpp (`tokenizer_st_partition` in `llama-vocab.cpp`) splits a
text at the special tokens written in it: for each special token, longest text first,
it scans every raw fragment left to right and splits it into [left][token][right];
a token marked LSTRIP drops the whitespace (C `isspace`) ending its left remainder,
one marked RSTRIP the whitespace starting its right remainder; without parse_special,
control and unknown tokens are skipped and only user-defined ones split. That is one
scan of the text per special token (6,414 for Gemma 3), and each match walks the
fragment list from its head: seconds for 64 KB of `<`, hours for 4 MB of "a\\n".

`Partition` gives the same fragments by scanning the text once. A regex over a trie of
the special texts finds the leftmost-longest occurrences; every occurrence of any
special starts inside one of them. Most matches are then their own token (nothing that
starts inside one reaches past it); the others open small zones (spanning the matches
whose occurrences overlap) where llama.cpp's ordered passes run, each only for the
specials that can occur there. A text of a million matches costs about a million
steps, not a million times the number of specials.

The order of two special texts of equal length is unknown (llama.cpp sorts with
`std::sort`, which is not stable). It matters only when their occurrences can
interact: when one's end can be the other's start, or when one strips whitespace
the other starts or ends with. `Partition.of` refuses such a vocabulary (None), and
the caller keeps the native tokenizer.

Pure: no ctypes, no IO.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

# C `isspace` in the "C" locale.
WHITESPACE = b" \t\n\v\f\r"
_WS = frozenset(WHITESPACE)


@dataclasses.dataclass(frozen=True)
class Special:
    """A token llama.cpp splits text at: CONTROL, USER_DEFINED or UNKNOWN."""

    token: int
    text: bytes
    control: bool  # CONTROL or UNKNOWN: only parsed with parse_special
    lstrip: bool = False
    rstrip: bool = False


# A partition: raw byte fragments (to tokenize as plain text) and special tokens (an
# int), in text order. Two raw fragments are never adjacent.
Fragment = bytes | int


def ambiguous(specials: Sequence[Special]) -> bool:
    """Whether llama.cpp's unstable sort leaves the partition undetermined: two
    specials of equal length whose occurrences can interact, or an empty one."""
    by_length: dict[int, list[Special]] = {}
    for s in specials:
        if not s.text:
            return True
        by_length.setdefault(len(s.text), []).append(s)
    for group in by_length.values():
        if len(group) < 2:
            continue
        if len({s.text for s in group}) < len(group):
            return True
        # An overlap of a and b (a's proper suffix is b's proper prefix) or of b and a.
        suffixes: dict[bytes, list[Special]] = {}
        for s in group:
            for i in range(1, len(s.text)):
                suffixes.setdefault(s.text[i:], []).append(s)
        for s in group:
            for i in range(1, len(s.text)):
                if any(o is not s for o in suffixes.get(s.text[:i], ())):
                    return True
        stripping = [s for s in group if s.lstrip or s.rstrip]
        for a in stripping:
            for b in group:
                if b is a:
                    continue
                if (a.rstrip and b.text[0] in _WS) or (a.lstrip and b.text[-1] in _WS):
                    return True
    return False


class _Table:
    """The specials that take part in one kind of partition (with or without
    parse_special), and what the zones need to know about them."""

    def __init__(self, specials: Sequence[Special]) -> None:
        # llama.cpp's pass order: longest first (ties cannot matter: see `ambiguous`).
        ordered = sorted(specials, key=lambda s: -len(s.text))
        self.rank = {s.text: k for k, s in enumerate(ordered)}
        self.by_text = {s.text: s for s in ordered}
        self.strips = any(s.lstrip or s.rstrip for s in ordered)
        # Every proper prefix of a special text, with the specials it begins.
        self._begins: dict[bytes, list[bytes]] = {}
        for s in ordered:
            for i in range(1, len(s.text)):
                self._begins.setdefault(s.text[:i], []).append(s.text)
        self.pattern = (
            re.compile(b"(" + _trie_pattern(s.text for s in ordered) + b")") if ordered else None
        )
        self._around: dict[bytes, tuple[frozenset[bytes], re.Pattern[bytes] | None]] = {}
        self._ordered: dict[frozenset[bytes], tuple[Special, ...]] = {}

    def ordered(self, names: frozenset[bytes]) -> tuple[Special, ...]:
        """The specials `names`, in llama.cpp's pass order."""
        known = self._ordered.get(names)
        if known is None:
            known = tuple(self.by_text[n] for n in sorted(names, key=self.rank.__getitem__))
            self._ordered[names] = known
        return known

    def around(self, text: bytes) -> tuple[frozenset[bytes], re.Pattern[bytes] | None]:
        """For a leftmost-longest match of special `text`: the specials that may occur
        starting inside it, and a regex of what they need past its end (None: no
        special starting inside it reaches past it)."""
        known = self._around.get(text)
        if known is not None:
            return known
        inside = {
            text[i:j] for i in range(len(text)) for j in range(i + 1, len(text) + 1)
        } & self.by_text.keys()
        tails: set[bytes] = set()
        for i in range(1, len(text)):
            for longer in self._begins.get(text[i:], ()):
                inside.add(longer)
                tails.add(longer[len(text) - i :])
        known = (frozenset(inside), re.compile(_trie_pattern(tails)) if tails else None)
        self._around[text] = known
        return known

    def reach(self, name: bytes, text: bytes, end: int) -> int:
        """How far past `end`, the end of a match of `name`, the specials that start
        inside that match reach in `text`."""
        tails = self.around(name)[1]
        if tails is None:
            return 0
        tail = tails.match(text, end)
        return 0 if tail is None else tail.end() - end


def _trie_pattern(texts: Iterable[bytes]) -> bytes:
    """A regex matching the longest of `texts` at a position (greedy optional tails
    over a trie, whose branches start with distinct bytes)."""
    trie: dict[int, object] = {}
    end = -1  # a key no byte uses: a text ends here
    for t in texts:
        node = trie
        for b in t:
            node = node.setdefault(b, {})  # type: ignore[assignment]
        node[end] = {}

    def render(node: dict[int, object]) -> bytes:
        branches = [
            re.escape(bytes([b])) + render(child)  # type: ignore[arg-type]
            for b, child in sorted(node.items())
            if b != end
        ]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        if end in node:
            return b"(?:" + body + b")?"
        return body

    return render(trie)


class Partition:
    """llama.cpp's special-token partition for one vocabulary."""

    def __init__(self, specials: Sequence[Special]) -> None:
        self._all = list(specials)
        self._controls = frozenset(s.token for s in specials if s.control)
        self._tables: dict[bool, _Table] = {}

    @classmethod
    def of(cls, specials: Sequence[Special]) -> Partition | None:
        """The partition of a vocabulary, or None when it is not determined (see
        `ambiguous`): then only the native tokenizer says how a text splits."""
        return None if ambiguous(specials) else cls(specials)

    def _table(self, parse_special: bool) -> _Table:
        table = self._tables.get(parse_special)
        if table is None:
            table = _Table([s for s in self._all if parse_special or not s.control])
            self._tables[parse_special] = table
        return table

    def finds_control(self, text: bytes) -> bool:
        """Whether the partition with parse_special holds a control or unknown token:
        without one, it is the partition without parse_special."""
        controls = self._controls
        return any(
            isinstance(f, int) and f in controls for f in self.split(text, parse_special=True)
        )

    def split(self, text: bytes, *, parse_special: bool) -> list[Fragment]:
        """The fragments llama.cpp's `tokenizer_st_partition` makes of `text`."""
        table = self._table(parse_special)
        if not text or table.pattern is None:
            return [text] if text else []
        if table.strips:
            taken: list[tuple[int, int, int]] = []
            for names, spans in _zones(table, text).items():
                _passes(table, text, names, spans, taken)
            out: list[Fragment] = []
            _assemble(text, 0, len(text), taken, out)
            return out
        return _split_plain(table, text)


def _split_plain(table: _Table, text: bytes) -> list[Fragment]:
    """`split` for specials that strip nothing, in one `re.split`.

    Most matches stand alone: no special that starts inside them reaches past them
    (`_Table.reach`), so they are their own token. The others open a zone that runs as
    far as such occurrences reach, passed as llama.cpp would.
    """
    assert table.pattern is not None
    items = table.pattern.split(text)
    out: list[Fragment] = []
    at = 0  # where items[k] starts
    k = 0
    n = len(items)
    while k < n:
        if k % 2 == 0:
            raw = items[k]
            if raw:
                _add_raw(out, raw)
                at += len(raw)
            k += 1
            continue
        name = items[k]
        end = at + len(name)
        reach = table.reach(name, text, end)
        if not reach:
            out.append(table.by_text[name].token)
            at = end
            k += 1
            continue
        # A zone: from this match while a match starts before the reach ends.
        start, names, stop = at, set(table.around(name)[0]), end + reach
        at, k = end, k + 1
        while k < n:
            piece = items[k]
            if k % 2 == 0:
                if at + len(piece) > stop:
                    # The zone ends inside this raw text; the rest stays raw.
                    items[k] = piece[stop - at :]
                    at = stop
                    break
                at += len(piece)
            else:
                if at >= stop:
                    break
                names |= table.around(piece)[0]
                at += len(piece)
                stop = max(stop, at + table.reach(piece, text, at))
            k += 1
        taken: list[tuple[int, int, int]] = []
        _passes(table, text, frozenset(names), [(start, at)], taken)
        _assemble(text, start, at, taken, out)
    return out


def _add_raw(out: list[Fragment], raw: bytes) -> None:
    if out and isinstance(out[-1], bytes):
        out[-1] += raw
    else:
        out.append(raw)


def _assemble(
    text: bytes, start: int, stop: int, taken: list[tuple[int, int, int]], out: list[Fragment]
) -> None:
    """Append the fragments of text[start:stop] given what the passes took from it."""
    taken.sort()
    at = start
    for first, end, token in taken:
        if first > at:
            _add_raw(out, text[at:first])
        if token >= 0:
            out.append(token)
        at = end
    if at < stop:
        _add_raw(out, text[at:stop])


def _zones(table: _Table, text: bytes) -> dict[frozenset[bytes], list[tuple[int, int]]]:
    """Disjoint spans of `text` that hold every occurrence of every special, grouped
    by the specials that may occur in them.

    Every occurrence starts inside a leftmost-longest match (the scan tried every
    other position), and stays within the match or reaches past its end by
    `_Table.reach`; matches whose reaches overlap share a zone. With stripping
    tokens, a zone also takes in the whitespace around it (a strip runs until a
    non-space byte), and zones with only whitespace between them are one.
    """
    assert table.pattern is not None
    groups: dict[frozenset[bytes], list[tuple[int, int]]] = {}
    start = end = -1
    names: frozenset[bytes] = frozenset()

    before = 0  # where the previous zone ends

    def close() -> None:
        nonlocal start, end, before
        if table.strips:
            while start > before and text[start - 1] in _WS:
                start -= 1
            while end < len(text) and text[end] in _WS:
                end += 1
        groups.setdefault(names, []).append((start, end))
        before = end

    for m in table.pattern.finditer(text):
        a, b = m.span()
        inside = table.around(m.group())[0]
        reach_end = b + table.reach(m.group(), text, b)
        joins = a < end or (table.strips and start >= 0 and not text[end:a].strip(WHITESPACE))
        if start >= 0 and joins:
            end = max(end, reach_end)
            names = names | inside if not inside <= names else names
            continue
        if start >= 0:
            close()
        start, end, names = a, reach_end, inside
    if start >= 0:
        close()
    return groups


def _passes(
    table: _Table,
    text: bytes,
    names: frozenset[bytes],
    spans: list[tuple[int, int]],
    taken: list[tuple[int, int, int]],
) -> None:
    """llama.cpp's ordered passes over the raw fragments `spans`, for the specials
    `names`; what they consume goes to `taken`."""
    raw = spans
    widest = max(stop - start for start, stop in raw)
    for special in table.ordered(names):
        name = special.text
        size = len(name)
        if size > widest:
            continue  # fits in no raw fragment left
        left: list[tuple[int, int]] = []
        for start, stop in raw:
            found = text.find(name, start, stop)
            if found < 0:
                left.append((start, stop))
                continue
            at = start
            while found >= 0:
                cut = found
                if special.lstrip:
                    while cut > at and text[cut - 1] in _WS:
                        cut -= 1
                    if cut < found:
                        taken.append((cut, found, -1))
                if cut > at:
                    left.append((at, cut))
                taken.append((found, found + size, special.token))
                at = found + size
                if special.rstrip:
                    skip = at
                    while skip < stop and text[skip] in _WS:
                        skip += 1
                    if skip > at:
                        taken.append((at, skip, -1))
                    at = skip
                found = text.find(name, at, stop)
            if at < stop:
                left.append((at, stop))
        raw = left
        if not raw:
            return
        widest = max(stop - start for start, stop in raw)
