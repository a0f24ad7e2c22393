"""Which parts of a GBNF grammar can match nothing, and where such a part is repeated.

llama.cpp keeps one stack per way the grammar can go on, without merging equal ones,
and checks every stack against the whole vocabulary at each step (see `gbnf`). A part
that can match the empty string, repeated, multiplies those ways: measured with the
llama.cpp that llama-cpp-python 0.3.36 vendors, 4 tokens of Gemma 3 270M on one thread
under `("a"?){0,N}` took 0.5 s at N = 25, 1.1 s at 50, 6.3 s at 100 and 129 s at 200;
`("a"?){200}` 75 s; `x{0,100}` with `x ::= "a"?` 6.1 s; while `("a" "b"?){0,200}`, whose
part cannot be empty, took 0.5 s. `gbnf.check_bounds` refuses a repetition of an
emptiable part more than `MAX_EMPTIABLE_REPEAT` times.

A small parser of GBNF's structure (rules, alternatives, sequences, groups, postfix
operators) and the usual fixed point for which rules can be empty. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

MAX_EMPTIABLE_REPEAT = 32

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


@dataclass
class _Item:
    # "lit" (with `empty`), "class" (any terminal that is one character or token), or
    # "ref" (a rule; a parenthesised group is a rule of its own, named `rule#n`).
    kind: str
    name: str = ""
    empty: bool = False
    # Postfix operator: (least, most) repetitions, most None for unbounded.
    repeat: tuple[int, int | None] = (1, 1)


def _tokens(grammar: str) -> Iterator[tuple[str, str]]:
    """(kind, text) of each token outside comments."""
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == "#":
            end = grammar.find("\n", i)
            i = n if end < 0 else end
        elif c in " \t\r\n":
            i += 1
        elif c == '"' or c == "[":
            j = skip_quoted(grammar, i + 1, '"' if c == '"' else "]")
            yield ("lit" if c == '"' else "class"), grammar[i:j]
            i = j
        elif grammar.startswith("::=", i):
            yield "def", "::="
            i += 3
        elif c in "()|":
            yield c, c
            i += 1
        elif c in "*+?":
            yield "op", c
            i += 1
        elif c == "{":
            found = _REPEAT.match(grammar, i)
            if found is None:
                yield "bad", c
                i += 1
            else:
                yield "rep", found.group(0)
                i = found.end()
        elif c == "<":  # a token reference: one token
            end = grammar.find(">", i)
            i = n if end < 0 else end + 1
            yield "class", "<>"
        elif c == "!":
            i += 1  # the negation of a token reference that follows
        elif c == ".":
            yield "class", "."
            i += 1
        elif (found := _NAME.match(grammar, i)) is not None:
            yield "name", found.group(0)
            i = found.end()
        else:
            yield "bad", c
            i += 1


def skip_quoted(text: str, i: int, close: str) -> int:
    """The index after the `close` that ends a literal or class begun before `i`; a
    backslash escapes the next character. An unterminated one runs to the end (the
    parser refuses it)."""
    n = len(text)
    while i < n:
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == close:
            return i + 1
        i += 1
    return n


def _repeat(op: str, text: str) -> tuple[int, int | None]:
    if op == "op":
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
    found = _REPEAT.fullmatch(text)
    assert found is not None
    least = int(found.group(1))
    if found.group(2) is None:
        return least, least
    return least, int(found.group(3)) if found.group(3) else None


class _Parser:
    """Rules as alternatives of sequences of items; each group becomes a rule of its own,
    so that nothing here recurses per level of nesting (a grammar may nest 1,000 deep)."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.i = 0
        self.rules: dict[str, list[list[_Item]]] = {}

    def parse(self) -> dict[str, list[list[_Item]]]:
        while self.i < len(self.tokens):
            if self._at("name") and self._at("def", 1):
                name = self.tokens[self.i][1]
                self.i += 2
                self._body(name)
            else:
                self.i += 1  # not GBNF llama.cpp reads: its parser refuses it
        return self.rules

    def _at(self, kind: str, ahead: int = 0) -> bool:
        j = self.i + ahead
        return j < len(self.tokens) and self.tokens[j][0] == kind

    def _rule(self, owner: str) -> tuple[str, list[list[_Item]]]:
        name = f"{owner}#{len(self.rules)}"
        body: list[list[_Item]] = [[]]
        self.rules[name] = body
        return name, body

    def _body(self, name: str) -> None:
        body: list[list[_Item]] = [[]]
        self.rules[name] = body
        open_groups = [body]
        while self.i < len(self.tokens):
            kind, text = self.tokens[self.i]
            if len(open_groups) == 1 and kind == "name" and self._at("def", 1):
                return
            self.i += 1
            alternatives = open_groups[-1]
            items = alternatives[-1]
            if kind == "|":
                alternatives.append([])
            elif kind == ")":
                if len(open_groups) > 1:
                    open_groups.pop()
            elif kind == "(":
                group, inner = self._rule(name)
                items.append(_Item("ref", name=group))
                open_groups.append(inner)
            elif kind == "lit":
                items.append(_Item("lit", empty=text == '""'))
            elif kind == "class":
                items.append(_Item("class"))
            elif kind == "name":
                items.append(_Item("ref", name=text))
            elif kind in ("op", "rep") and items:
                if items[-1].repeat != (1, 1):  # x?* and the like: a group of the first
                    group, inner = self._rule(name)
                    inner[0].append(items[-1])
                    items[-1] = _Item("ref", name=group)
                items[-1].repeat = _repeat(kind, text)


def emptiable_repeats(grammar: str) -> Iterator[tuple[str, int]]:
    """(rule, count) of each repetition, in each rule, of a part that can match the
    empty string: count is the most times it may repeat (the least when unbounded),
    times the repetitions of emptiable parts nested inside it (capped just past
    `MAX_EMPTIABLE_REPEAT`)."""
    rules = _Parser(list(_tokens(grammar))).parse()
    empty: dict[str, bool] = dict.fromkeys(rules, False)

    def inner_empty(item: _Item) -> bool:
        if item.kind == "lit":
            return item.empty
        if item.kind == "ref":
            return empty.get(item.name, False)
        return False

    def item_empty(item: _Item) -> bool:
        return item.repeat[0] == 0 or inner_empty(item)

    # The least fixed point, by a worklist: a rule is looked at again only when a rule
    # it refers to turns out emptiable (a chain of 10,000 rules is one pass, not 10,000).
    referrers: dict[str, set[str]] = {}
    for name, body in rules.items():
        for seq in body:
            for item in seq:
                if item.kind == "ref":
                    referrers.setdefault(item.name, set()).add(name)
    pending = list(rules)
    while pending:
        name = pending.pop()
        if empty[name] or not any(all(item_empty(x) for x in seq) for seq in rules[name]):
            continue
        empty[name] = True
        pending.extend(referrers.get(name, ()))

    def count(item: _Item) -> int:
        """How many times an emptiable part may repeat (1 for anything else)."""
        least, most = item.repeat
        if (least, most) == (1, 1) or not inner_empty(item):
            return 1
        return max(1, least if most is None else most)

    # Repetitions of emptiable parts nested in one another multiply: ((x?){0,32}){0,32}
    # is 1,024 ways. weight[rule]: the largest such product inside the rule, capped
    # just past what is refused, so the worklist ends (each rule rises at most CAP times).
    cap = MAX_EMPTIABLE_REPEAT + 1
    weight: dict[str, int] = dict.fromkeys(rules, 1)

    def item_weight(item: _Item) -> int:
        inner = weight.get(item.name, 1) if item.kind == "ref" else 1
        return min(cap, count(item) * inner)

    pending = list(rules)
    while pending:
        name = pending.pop()
        heaviest = max((item_weight(x) for seq in rules[name] for x in seq), default=1)
        if heaviest > weight[name]:
            weight[name] = heaviest
            pending.extend(referrers.get(name, ()))

    for name, body in rules.items():
        for seq in body:
            for item in seq:
                if count(item) > 1 or (item.repeat != (1, 1) and inner_empty(item)):
                    yield name.partition("#")[0], max(count(item), item_weight(item))
