"""Constrained generation on a real engine worker: JSON schemas, JSON objects, GBNF
grammars and logit bias, with the bundled Gemma 3 270M (a weak base model, so every
guarantee here comes from the grammar, not from the model's manners)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import schema as schemas
from blazar.rpc import status
from tests.integration import pinning
from tests.integration.engine_harness import Worker, greedy, rpc_error

pytestmark = pytest.mark.slow

# The budget of a constraint whose documents have no longest one (see `budget`).
MAX_TOKENS = 64
GENERATE_DEADLINE_S = 300
SEEDS = (1, 2, 3)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOURS = {
    "type": "array",
    "items": {"type": "string", "enum": ["red", "green", "blue"]},
    "minItems": 1,
    "maxItems": 3,
}
SHAPE = {
    "type": "object",
    "properties": {
        "visible": {"type": "boolean"},
        "origin": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
    },
    "required": ["visible", "origin"],
}
# String patterns: "tag"'s '.' may be a quote or a backslash, which the JSON text must
# escape, and the pattern then holds for the decoded value.
RECORD = {
    "type": "object",
    "properties": {
        "zip": {"type": "string", "pattern": "^\\d{5}$"},
        "tag": {"type": "string", "pattern": "^a.{2}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\w+\\.x$"},
    },
    "required": ["zip", "tag", "code"],
    "additionalProperties": False,
}
# What Pydantic writes for `tags: list[Any]` and `extra: Any` (an annotation-only schema).
NOTE = {
    "properties": {
        "tags": {"items": {}, "title": "Tags", "type": "array"},
        "extra": {"title": "Extra"},
    },
    "required": ["tags", "extra"],
    "title": "Note",
    "type": "object",
}
# Few-shot prompts keep a base model's numbers and strings short; the grammar does the rest.
SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (
        PERSON,
        'Person: {"name": "Ada", "age": 36}\nPerson: {"name": "Bo", "age": 7}\nPerson:',
    ),
    "colours": (COLOURS, 'Colours: ["red"]\nColours: ["green", "blue"]\nColours:'),
    "note": (
        NOTE,
        'Note: {"tags": ["a", 1], "extra": null}\nNote: {"tags": [], "extra": "x"}\nNote:',
    ),
    "record": (
        RECORD,
        'Record: {"zip": "90210", "tag": "a\\"\\\\", "code": "AB-7.x"}\n'
        'Record: {"zip": "10001", "tag": "a\\\\\\"", "code": "QZ-ok_1.x"}\nRecord:',
    ),
    "shape": (
        SHAPE,
        'Shape: {"visible": true, "origin": {"x": 1.5, "y": -2}}\n'
        'Shape: {"visible": false, "origin": {"x": 0, "y": 3.25}}\nShape:',
    ),
}


def grammar_of(constraint: inference_pb2.Constraint) -> str:
    """The GBNF the engine enforces for a constraint."""
    kind = constraint.WhichOneof("kind")
    if kind == "grammar":
        return constraint.grammar
    document = {"type": "object"} if kind == "json_object" else json.loads(constraint.json_schema)
    return schemas.grammar(document)


def budget(constraint: inference_pb2.Constraint) -> int:
    """max_tokens for a constrained request: room for the longest document the grammar
    allows, so that the grammar (never the budget) ends it, when there is a longest one.
    Otherwise (any JSON value, a pattern with `+`) what a sample writes decides whether
    it ends in time, and that differs by CPU: MAX_TOKENS, and the test accepts a cut
    output that is a prefix of a document (`assert_keeps_to`)."""
    return pinning.budget(grammar_of(constraint)) or MAX_TOKENS


def constrained(
    worker: Worker,
    prompt: str,
    constraint: inference_pb2.Constraint,
    *,
    deadline: float = GENERATE_DEADLINE_S,
    **sampling: Any,
) -> tuple[str, inference_pb2.Final]:
    """Text and final part of one constrained generation (max_tokens: `budget`).

    The deadline is generous: the grammar stage scans the whole 262k vocabulary every
    step, and the machine running the tests is shared.
    """
    sampling.setdefault("max_tokens", budget(constraint))
    request = engine_pb2.GenerateRequest(
        prompt=prompt,
        sampling=inference_pb2.Sampling(**sampling),
        constraint=constraint,
    )
    text, finals = [], []
    for chunk in worker.stub.Generate(request, timeout=deadline):
        if chunk.HasField("delta"):
            text.append(chunk.delta.text)
        else:
            finals.append(chunk.final)
    assert len(finals) == 1
    return "".join(text), finals[0]


def sampling_cases() -> list[dict[str, Any]]:
    return [{"temperature": 0.0}] + [{"temperature": 0.9, "seed": s} for s in SEEDS]


def assert_keeps_to(
    model_path: Path,
    constraint: inference_pb2.Constraint,
    text: str,
    final: inference_pb2.Final,
    *,
    max_tokens: int,
) -> Any:
    """What the engine guarantees of a constrained output, whatever the model wrote.

    It ends by the grammar (STOP: the end-of-generation token is allowed only once the
    document is complete) and is then a whole document, which parses and validates
    (checked here with `jsonschema`, not with the grammar); or it ends by the budget
    (LENGTH: exactly max_tokens) and is then the start of a document. A budget from
    `budget` leaves no room for LENGTH when the grammar has a longest document.
    Returns the parsed document, or None for a cut one.
    """
    grammar = grammar_of(constraint)
    state = pinning.grammar_state(model_path, grammar, text)
    if final.finish_reason == inference_pb2.FINISH_REASON_STOP:
        assert state is pinning.GrammarState.COMPLETE, text
        document = json.loads(text)
        if constraint.WhichOneof("kind") == "json_schema":
            jsonschema.validate(document, json.loads(constraint.json_schema))
        return document
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH, final
    # A cut document may happen to be complete already (its end token did not fit).
    assert state is not pinning.GrammarState.INVALID, text
    assert final.usage.completion_tokens == max_tokens
    assert pinning.budget(grammar) is None, ("a bounded grammar ran out of budget", text)
    return None


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_always_validates(worker: Worker, model_path: Path, name: str) -> None:
    """Every document the grammar ends validates; one the budget cuts is a prefix of one.

    `person`, `colours` and `shape` have a longest document and get a budget it fits,
    so the grammar ends each of their outputs on every CPU. `note` (any JSON values)
    and `record` (a `\\w+` pattern) allow documents without end: which seeded sample
    closes its document within MAX_TOKENS depends on the CPU's arithmetic (issue 15).
    """
    schema, prompt = SCHEMAS[name]
    constraint = inference_pb2.Constraint(json_schema=json.dumps(schema))
    for sampling in sampling_cases():
        text, final = constrained(worker, prompt, constraint, **sampling)
        assert_keeps_to(model_path, constraint, text, final, max_tokens=budget(constraint))


def test_bounded_schemas_get_a_budget_their_longest_document_fits() -> None:
    """The split `test_json_schema_output_always_validates` relies on."""
    bounded = {
        name
        for name, (schema, _) in SCHEMAS.items()
        if pinning.budget(schemas.grammar(schema)) is not None
    }
    assert bounded == {"person", "colours", "shape"}
    # 16 name characters of at most 6 bytes each (\uXXXX) and a 17-character integer.
    assert pinning.longest_document(schemas.grammar(PERSON)) == 140
    # A literal, up to 3 of a 1-byte class or a 2-byte "é", an optional space.
    assert pinning.longest_document('root ::= "a" ([b-c] | "\\u00e9"){2,3} " "?') == 8
    assert pinning.longest_document('root ::= "a" [b-c]+') is None
    assert pinning.longest_document('root ::= "(" x ")"\nx ::= root | "a"') is None


def test_seeds_vary_a_constrained_sample(worker: Worker) -> None:
    """The seed and temperature reach the sampler behind a grammar. Pinned: at a
    temperature of 10,000 with no top-k, top-p or min-p, every token the grammar allows
    is about as likely as any other whatever the model's numbers, so three seeds write
    the same 8 letters twice about as rarely as three dice of 26**8 faces."""
    constraint = inference_pb2.Constraint(
        json_schema=json.dumps({"type": "string", "pattern": "^[a-z]{8}$"})
    )
    uniform = {"temperature": 1e4, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    values = []
    for seed in SEEDS:
        text, final = constrained(worker, "Letters:", constraint, seed=seed, **uniform)
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
        values.append(json.loads(text))
        assert re.fullmatch("[a-z]{8}", values[-1]), text
    assert len(set(values)) == len(SEEDS), values


# Constants, enum values and property names whose JSON text needs escapes (a backslash,
# a quote, a line break) or holds characters outside the BMP: each must come out as
# itself, and the only document each schema allows is then fully determined.
AWKWARD_LITERALS: list[tuple[dict[str, Any], Any]] = [
    ({"const": "é😀"}, "é😀"),
    ({"enum": ["a\\b"]}, "a\\b"),
    ({"const": 'he said "hi"'}, 'he said "hi"'),
    (
        {
            "type": "object",
            "properties": {"a\nb": {"const": 1}, 'q"\\': {"const": "\t"}},
            "required": ["a\nb", 'q"\\'],
            "additionalProperties": False,
        },
        {"a\nb": 1, 'q"\\': "\t"},
    ),
]


@pytest.mark.parametrize(("schema", "document"), AWKWARD_LITERALS)
def test_literals_in_a_schema_come_out_as_themselves(
    worker: Worker, schema: dict[str, Any], document: Any
) -> None:
    constraint = inference_pb2.Constraint(json_schema=json.dumps(schema))
    text, final = constrained(worker, "JSON:", constraint, temperature=0.0)
    # The budget fits the longest text of the only document (spaces are optional).
    assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
    assert json.loads(text) == document
    jsonschema.validate(json.loads(text), schema)


def test_a_large_enum_is_sampled_in_bounded_time(worker: Worker) -> None:
    """20,000 values: one grammar alternative each used to cost about a minute per token on
    the decode thread (stalling every slot); written as a trie it costs what a small
    enum does. The deadline is a liveness bound, not a benchmark."""
    values = [f"item-{i}" for i in range(20_000)]
    constraint = inference_pb2.Constraint(json_schema=json.dumps({"enum": values}))
    for sampling in sampling_cases()[:2]:
        text, final = constrained(worker, "Pick one:", constraint, deadline=30.0, **sampling)
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
        assert json.loads(text) in values, text


def test_constraints_with_penalties_and_concurrent_requests(worker: Worker) -> None:
    """Two constrained requests decode side by side (two slots), one with penalties.
    Both schemas have a longest document, and the budget fits it."""
    requests = [
        (
            "person",
            {"temperature": 0.9, "seed": 11, "repeat_penalty": 1.3, "presence_penalty": 0.5},
        ),
        ("colours", {"temperature": 0.9, "seed": 12}),
    ]

    def run(case: tuple[str, dict[str, Any]]) -> tuple[str, str, inference_pb2.Final]:
        name, sampling = case
        schema, prompt = SCHEMAS[name]
        text, final = constrained(
            worker, prompt, inference_pb2.Constraint(json_schema=json.dumps(schema)), **sampling
        )
        return name, text, final

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, text, final in pool.map(run, requests):
            assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
            jsonschema.validate(json.loads(text), SCHEMAS[name][0])


def test_json_object_mode_gives_an_object(worker: Worker, model_path: Path) -> None:
    """Any object: no longest one, so a cut output is a prefix of an object."""
    prompt = 'JSON: {"a": 1}\nJSON: {"b": true}\nJSON: {"c": "x"}\nJSON:'
    constraint = inference_pb2.Constraint(json_object=True)
    for sampling in sampling_cases()[:2]:
        text, final = constrained(worker, prompt, constraint, **sampling)
        document = assert_keeps_to(model_path, constraint, text, final, max_tokens=MAX_TOKENS)
        assert text.startswith("{"), text
        assert document is None or isinstance(document, dict), text


def test_gbnf_grammar_limits_the_output(worker: Worker) -> None:
    constraint = inference_pb2.Constraint(grammar='root ::= ("yes" | "no")')
    answers = set()
    for sampling in [{"temperature": 0.0}] + [{"temperature": 1.5, "seed": s} for s in range(6)]:
        text, final = constrained(worker, "Is the sea wet? Answer:", constraint, **sampling)
        assert text in ("yes", "no"), text
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
        answers.add(text)
    assert answers  # at least one answer came back


def assert_serves(worker: Worker) -> None:
    """The worker answers the next request (its text is the model's business)."""
    _, final = worker.generate(prompt="Hello", sampling=greedy(2))
    assert final.usage.completion_tokens in (1, 2), final


@pytest.mark.parametrize(
    "constraint",
    [
        inference_pb2.Constraint(grammar='root ::= "unterminated'),
        inference_pb2.Constraint(grammar="root ::= undefined-rule"),
        inference_pb2.Constraint(grammar='start ::= "no root rule"'),
        inference_pb2.Constraint(grammar='root ::= root "x"'),  # left recursion
        inference_pb2.Constraint(json_schema="{not json"),
        inference_pb2.Constraint(json_schema='["not", "an", "object"]'),
        inference_pb2.Constraint(json_schema='{"type": "no-such-type"}'),
        inference_pb2.Constraint(json_schema='{"type": "integer", "minimum": 0}'),
        inference_pb2.Constraint(json_schema='{"type": "string", "pattern": "^(?=a)b$"}'),
        # Translated, but llama.cpp refuses the repetition of a group that can be empty.
        inference_pb2.Constraint(json_schema='{"type": "string", "pattern": "^(a|)*$"}'),
        # Past the bounds llama.cpp's recursive parser survives (`engine.gbnf`): 60,000
        # nested groups killed the engine with SIGSEGV; a chain of rules past the size.
        inference_pb2.Constraint(grammar="root ::= " + "(" * 60_000 + '"a"' + ")" * 60_000),
        inference_pb2.Constraint(
            grammar="root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(20_000))
        ),
    ],
)
def test_invalid_constraint_is_invalid_argument_and_worker_survives(
    worker: Worker, constraint: inference_pb2.Constraint
) -> None:
    err = rpc_error(
        lambda: worker.generate(prompt="Hello", sampling=greedy(4), constraint=constraint)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar" in (err.details() or "").lower() or "schema" in (err.details() or "").lower()
    assert worker.proc.poll() is None, "the engine process died"
    assert_serves(worker)
    health = worker.health()
    assert health is not None and health.state == engine_pb2.ENGINE_STATE_READY


def test_a_schema_llama_cpp_refuses_is_explained_as_a_schema(worker: Worker) -> None:
    constraint = inference_pb2.Constraint(json_schema='{"type": "string", "pattern": "^(a|)*$"}')
    err = rpc_error(
        lambda: worker.generate(prompt="Hello", sampling=greedy(4), constraint=constraint)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "JSON schema" in (err.details() or "") and "GBNF" not in (err.details() or "")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_the_logit_bias_leaves_no_token_for_fails_only_that_request(
    worker: Worker, model_path: Path, temperature: float
) -> None:
    """The grammar allows only "a" and the bias bans every token spelling it: the
    request fails, and the worker (which llama.cpp's grammar used to abort when handed
    a token outside its language) stays up for the next one."""
    banned = pinning.spellings(model_path, b"a")
    assert banned
    pid = worker.health().pid  # type: ignore[union-attr]
    sampling = inference_pb2.Sampling(
        temperature=temperature, seed=1, max_tokens=4, logit_bias=dict.fromkeys(banned, -100.0)
    )
    err = rpc_error(
        lambda: worker.generate(
            prompt="Say a:",
            sampling=sampling,
            constraint=inference_pb2.Constraint(grammar='root ::= "a"'),
        )
    )
    # The request's own contradiction: INVALID_ARGUMENT, blaming the logit bias.
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "grammar" in (err.details() or "")
    assert status.from_rpc_error(err).metadata.get(errors.FIELD_KEY) == "sampling.logit_bias"
    assert_serves(worker)
    health = worker.health()
    assert health is not None and health.state == engine_pb2.ENGINE_STATE_READY
    assert health.pid == pid


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_the_vocabulary_cannot_write_blames_the_grammar(
    worker: Worker, temperature: float
) -> None:
    """No token spells a NUL character: with no logit bias in the request, the
    grammar is what leaves no output, and the error says so."""
    sampling = inference_pb2.Sampling(temperature=temperature, seed=1, max_tokens=4)
    err = rpc_error(
        lambda: worker.generate(
            prompt="Hello",
            sampling=sampling,
            constraint=inference_pb2.Constraint(grammar='root ::= "\\x00"'),
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "bias" not in (err.details() or "") and "grammar" in (err.details() or "")
    assert status.from_rpc_error(err).metadata.get(errors.FIELD_KEY) == "constraint"
    assert_serves(worker)


def first_token(worker: Worker, prompt: str, bias: dict[int, float]) -> int:
    """The one token greedy decoding picks after prompt under a logit bias, by id."""
    deltas, _ = worker.generate(prompt=prompt, sampling=greedy(1, logprobs=True, logit_bias=bias))
    (entry,) = [lp for d in deltas for lp in d.logprobs]
    return int(entry.id)


def token_id(worker: Worker, piece: str) -> int:
    tokens = worker.stub.Tokenize(inference_pb2.TokenizeRequest(text=piece), timeout=10).tokens
    assert len(tokens) == 1, (piece, list(tokens))
    return int(tokens[0])


def test_logit_bias_bans_and_forces_tokens(worker: Worker, model_path: Path) -> None:
    """By token id (not by re-tokenizing the text of whatever the model picked), and with
    end-of-generation banned, so that the pick has a logprobs entry on every CPU."""
    prompt = "The capital of France is"
    no_eog = pinning.no_end_of_generation(model_path)
    favourite = first_token(worker, prompt, no_eog)
    assert first_token(worker, prompt, {**no_eog, favourite: -100}) != favourite
    forced = token_id(worker, " banana")
    assert first_token(worker, prompt, {**no_eog, forced: 100}) == forced


def test_logit_bias_outside_the_vocabulary_is_invalid(worker: Worker) -> None:
    err = rpc_error(lambda: worker.generate(prompt="Hi", sampling=greedy(2, logit_bias={10**8: 5})))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in (err.details() or "")
