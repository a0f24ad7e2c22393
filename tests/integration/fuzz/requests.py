"""Generated requests for the public Inference API (`test_engine_requests.py`): every
field that reaches the engine, at and past its bounds.

- Unicode: combining marks, right-to-left text and overrides, NUL, the BOM, the last
  code point, the model's own turn markers. Lone surrogates are not here: protobuf
  strings are UTF-8, so no client library can send one (the shim's fuzz run sends them
  over HTTP, where the body is bytes).
- Grammars: valid GBNF, then cut, spliced or salted with GBNF's own punctuation; and
  shapes made to hurt: deep nesting, long chains of rules, wide alternations, left
  recursion, megabytes of text, each on both sides of `blazar.engine.gbnf`'s bounds.
- JSON schemas: nested, recursive `$ref`, enormous enums, odd formats and patterns,
  then mutated as JSON (`mutation.mutated`), NaN and deep nesting included.
- Stops (empty, Unicode, very long, many), logit biases (ids outside the vocabulary,
  NaN, infinities, huge values), sampling parameters at their bounds and past them.

Generation stays short: `max_tokens` is 1, or a value that is refused.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from blazar._proto.v1 import inference_pb2
from tests.integration.fuzz import serving
from tests.integration.fuzz.mutation import dump, mutated

# Gemma 3's vocabulary has 262,144 tokens.
VOCAB = 262_144
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.one_of(
    st.floats(width=32),
    st.sampled_from([0.0, -0.0, 1e-7, 1.0, 2.0, -1.0, 100.0, 3.4e38, math.inf, -math.inf]),
    st.just(math.nan),
)


def mostly(
    valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """`valid` nine times in ten: a request with one hostile field in a dozen still
    gets past the others' checks to show what that one does."""
    # Hypothesis draws the ends of a range (and of a sampled list) far more often than
    # their share; a seeded Random's draw is uniform.
    return st.randoms(use_true_random=False).flatmap(
        lambda r: hostile if r.random() > 0.9 else valid
    )


UNICODE = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=24),
    st.sampled_from(
        [
            "",
            "e\u0301\u0302\u0303" * 6,  # combining marks piled on one letter
            "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # Hebrew, Arabic
            "abc\u202edef\u202c\u2066x\u2069",  # bidirectional overrides and isolates
            "a\x00b",
            "\x00",
            "\ufeffHi",
            "\U0010ffff\U000e0001",
            "\U0001f469\u200d\U0001f469\u200d\U0001f467",  # one grapheme, five code points
            "<start_of_turn>model\n",
            "<end_of_turn>",
            "<bos><eos><pad>",
            "\r\n\t\x0b\x0c\x1b[31m",
        ]
    ),
)
LONG_TEXT = st.sampled_from(["word " * 2_000, "\U0001f642" * 3_000, "x" * 100_000])


# ---------------------------------------------------------------- grammars

GRAMMARS = [
    'root ::= "a" | "b"',
    "root ::= [a-z]+",
    'root ::= item ("," item)*\nitem ::= [0-9]+',
    'root ::= "{" ws pair (ws "," ws pair)* ws "}"\npair ::= "\\"k\\"" ws ":" ws [0-9]\n'
    "ws ::= [ \\t\\n]*",
    'root ::= "\\u00e9" | "\\U0001F642" | [\\u0300-\\u036f]  # a comment (with parens',
    'root ::= ("ab" | [^"\\\\])? "c"{2,5}',
    'root ::= x\nx ::= "(" x ")" | "."',
]
GBNF_PUNCTUATION = st.sampled_from([*'()[]{}"\\|*+?#:=-^.\n ', "::=", "\\u", "{9999999999}"])


@st.composite
def grammar(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from(["valid"] * 4 + ["spliced", "nested", "chain", "wide", "odd"]))
    if shape == "nested":
        depth = draw(st.sampled_from([10, 999, 1_001, 5_000, 60_000]))
        return "root ::= " + "(" * depth + '"a"' + ")" * depth
    if shape == "chain":
        rules = draw(st.sampled_from([100, 9_999, 10_001, 50_000]))
        return (
            "root ::= r0\n"
            + "".join(f"r{i} ::= r{i + 1}\n" for i in range(rules))
            + (f'r{rules} ::= "a"')
        )
    if shape == "wide":
        n = draw(st.sampled_from([30, 257, 60_000]))
        return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))
    if shape == "odd":
        return draw(
            st.sampled_from(
                [
                    "",
                    "root ::=",
                    "item ::= [a-z]",  # no root
                    "root ::= root",  # left recursion
                    "root ::= a\na ::= root",
                    'root ::= "' + "x" * (1024 * 1024 + 1) + '"',  # past the size bound
                    'root ::= "' + "\U0001f642" * 100_000 + '"',
                    "root ::= [z-a]",
                    'root ::= "a"{1000000}',
                    "root ::= [\\x00-\\U0010FFFF]*",
                    "root ::= \x00",
                ]
            )
        )
    text = draw(st.sampled_from(GRAMMARS))
    if shape == "spliced":
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(text)))
            cut = draw(st.integers(0, 4))
            text = text[:at] + draw(st.one_of(GBNF_PUNCTUATION, UNICODE)) + text[at + cut :]
    return text


# ---------------------------------------------------------------- schemas

SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "nope"},
    {"type": "string", "pattern": "^(a+)+$"},
    {"type": "string", "pattern": "["},
    {"type": "string", "pattern": "\\p{L}+"},
    {"type": "string", "minLength": 10**9},
    {"type": "integer", "minimum": 5},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},
    {"$ref": "#/$defs/missing"},
    {"$ref": "https://example.com/schema.json"},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"enum": [f"v{i}" for i in range(20_000)]},
    {"enum": [f"v{i}" for i in range(100_000)]},
    {"const": "\U0001f642\\\"\n"},
    True,
    False,
    {},
]  # fmt: skip


def _nested_schema(depth: int) -> Any:
    schema: Any = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@st.composite
def schema(draw: st.DrawFn) -> str:
    base = draw(
        st.one_of(
            st.sampled_from(SCHEMAS),
            st.sampled_from([5, 31, 33, 200]).map(_nested_schema),
        )
    )
    if isinstance(base, dict) and draw(st.integers(0, 3)) == 0:
        base, _ = draw(mutated(base))
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from(["", "{", "[]", "null", "NaN", "{" * 10_000]))
    return dump(base)


# ---------------------------------------------------------------- requests


def _set(message: Any, draw: st.DrawFn, **fields: st.SearchStrategy[Any]) -> None:
    for name, values in fields.items():
        if draw(st.booleans()):
            setattr(message, name, draw(values))


@st.composite
def sampling(draw: st.DrawFn) -> inference_pb2.Sampling:
    s = inference_pb2.Sampling()
    # Held short; sometimes a budget that is refused.
    # One token: what reaches the engine is checked and set up in full for the first
    # (a grammar is parsed, the sampler chain built); more would only cost time.
    s.max_tokens = draw(mostly(st.just(1), st.sampled_from([0, -1, -(2**31)])))
    _set(
        s, draw,
        temperature=mostly(st.floats(0, 2, width=32), FLOAT32),
        top_p=mostly(st.floats(0, 1, width=32), FLOAT32),
        min_p=mostly(st.floats(0, 1, width=32), FLOAT32),
        repeat_penalty=mostly(st.floats(0.5, 2, width=32), FLOAT32),
        presence_penalty=mostly(st.floats(-2, 2, width=32), FLOAT32),
        frequency_penalty=mostly(st.floats(-2, 2, width=32), FLOAT32),
        top_k=mostly(st.integers(0, 100), INT32), seed=st.integers(0, 2**32 - 1),
        logprobs=st.booleans(), top_logprobs=mostly(st.integers(0, 20), INT32),
        # Rarer than the rest (one request in twenty, about 50 a run): scoring a
        # prompt costs a logits row per token, about 6 ms each (1 s for a tool
        # prompt); at one request in four it was half of this run's time.
        prompt_logprobs=mostly(st.just(False), st.just(True)), ignore_eos=st.booleans(),
        max_tokens_up_to_context=st.booleans(),
    )  # fmt: skip
    if s.top_logprobs and draw(mostly(st.just(True), st.just(False))):
        s.logprobs = True
    stops = draw(
        mostly(
            st.lists(UNICODE.filter(bool), max_size=4),
            st.one_of(
                st.lists(st.sampled_from(["", "x" * 10_000, "\x00", "\n"]), max_size=3),
                st.integers(60, 70).map(lambda n: [f"s{i}" for i in range(n)]),
            ),
        )
    )
    s.stop.extend(stops)
    ids = mostly(
        st.integers(0, VOCAB - 1),
        st.sampled_from([-1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, -(2**31)]),
    )
    bias = draw(
        mostly(
            st.dictionaries(ids, mostly(st.floats(-100, 100, width=32), FLOAT32), max_size=4),
            st.just({i: -100.0 for i in range(5_000)}),
        )
    )
    for token, value in bias.items():
        s.logit_bias[token] = value
    return s


@st.composite
def constraint(draw: st.DrawFn) -> inference_pb2.Constraint | None:
    kind = draw(st.sampled_from(["none"] * 3 + ["json_object", "grammar", "json_schema"]))
    if kind == "grammar":
        return inference_pb2.Constraint(grammar=draw(grammar()))
    if kind == "json_schema":
        return inference_pb2.Constraint(json_schema=draw(schema()))
    if kind == "json_object":
        return inference_pb2.Constraint(json_object=True)
    return None


MODEL = mostly(st.just(serving.LANE), st.sampled_from(["", "no-such-lane"]))
ROLES = mostly(
    st.sampled_from(["user", "user", "system", "assistant"]),
    st.sampled_from(["tool", "developer", "", "ROOT"]),
)
TOOL_NAMES = mostly(
    st.sampled_from(["get_weather", "f", "x.y-z_1"]),
    st.sampled_from(["", "a" * 65, "bad name!", "\u00fc"]),
)


@st.composite
def complete_request(draw: st.DrawFn) -> inference_pb2.CompleteRequest:
    request = inference_pb2.CompleteRequest(
        model=draw(MODEL),
        prompt=draw(mostly(UNICODE.filter(bool), LONG_TEXT)),
        sampling=draw(sampling()),
    )
    if (c := draw(constraint())) is not None:
        request.constraint.CopyFrom(c)
    return request


@st.composite
def chat_request(draw: st.DrawFn) -> inference_pb2.ChatRequest:
    request = inference_pb2.ChatRequest(model=draw(MODEL), sampling=draw(sampling()))
    for _ in range(draw(mostly(st.integers(1, 4), st.just(0)))):
        message = request.messages.add(role=draw(ROLES), content=draw(UNICODE))
        _set(message, draw, name=UNICODE, tool_call_id=UNICODE)
        if message.role == "assistant" and draw(st.booleans()):
            message.tool_calls.add(
                id="call_1", name=draw(TOOL_NAMES), arguments=draw(st.sampled_from(
                    ['{"city": "Paris"}', "{", "[]", "", '{"a": NaN}']
                ))
            )  # fmt: skip
    if draw(mostly(st.just(False), st.just(True))):
        request.messages.add(role="user", content=draw(LONG_TEXT))
    if draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            request.tools.add(
                name=draw(TOOL_NAMES) + str(len(request.tools)),
                description=draw(UNICODE),
                parameters=draw(st.one_of(st.just(""), schema())),
            )
        request.tool_choice.mode = draw(st.sampled_from([0, 1, 2, 3, 4, 99]))
        if request.tool_choice.mode == 4:
            request.tool_choice.name = draw(TOOL_NAMES)
        if draw(st.booleans()):
            request.parallel_tool_calls = draw(st.booleans())
    if (c := draw(constraint())) is not None:
        request.constraint.CopyFrom(c)
    return request


def describe(request: Any) -> str:
    """The request, short enough to read in a failure."""
    text = str(request)
    return text if len(text) <= 3_000 else text[:3_000] + f"... ({len(text):,} characters)"
