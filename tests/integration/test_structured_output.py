"""Constrained generation on a real engine worker: JSON schemas, JSON objects, GBNF
grammars and logit bias, with the bundled Gemma 3 270M (a weak base model, so every
guarantee here comes from the grammar, not from the model's manners)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.rpc import status
from tests.integration.engine_harness import Worker, greedy, rpc_error

pytestmark = pytest.mark.slow

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


def constrained(
    worker: Worker,
    prompt: str,
    constraint: inference_pb2.Constraint,
    *,
    deadline: float = GENERATE_DEADLINE_S,
    **sampling: Any,
) -> tuple[str, inference_pb2.Final]:
    """Text and final part of one constrained generation.

    The deadline is generous: the grammar stage scans the whole 262k vocabulary every
    step, and the machine running the tests is shared.
    """
    request = engine_pb2.GenerateRequest(
        prompt=prompt,
        sampling=inference_pb2.Sampling(max_tokens=MAX_TOKENS, **sampling),
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


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_always_validates(worker: Worker, name: str) -> None:
    schema, prompt = SCHEMAS[name]
    constraint = inference_pb2.Constraint(json_schema=json.dumps(schema))
    outputs = []
    for sampling in sampling_cases():
        text, final = constrained(worker, prompt, constraint, **sampling)
        # The grammar ends the generation: it makes end-of-text the only choice once the
        # document is complete, long before max_tokens.
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, (sampling, text)
        document = json.loads(text)
        jsonschema.validate(document, schema)
        outputs.append(text)
    assert len(set(outputs)) > 1, "different seeds should not all give the same document"


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
        text, _ = constrained(worker, "Pick one:", constraint, deadline=30.0, **sampling)
        assert json.loads(text) in values, text


def test_constraints_with_penalties_and_concurrent_requests(worker: Worker) -> None:
    """Two constrained requests decode side by side (two slots), one with penalties."""
    requests = [
        (
            "person",
            {"temperature": 0.9, "seed": 11, "repeat_penalty": 1.3, "presence_penalty": 0.5},
        ),
        ("colours", {"temperature": 0.9, "seed": 12}),
    ]

    def run(case: tuple[str, dict[str, Any]]) -> tuple[str, str]:
        name, sampling = case
        schema, prompt = SCHEMAS[name]
        text, _ = constrained(
            worker, prompt, inference_pb2.Constraint(json_schema=json.dumps(schema)), **sampling
        )
        return name, text

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, text in pool.map(run, requests):
            jsonschema.validate(json.loads(text), SCHEMAS[name][0])


def test_json_object_mode_gives_an_object(worker: Worker) -> None:
    prompt = 'JSON: {"a": 1}\nJSON: {"b": true}\nJSON: {"c": "x"}\nJSON:'
    for sampling in sampling_cases()[:2]:
        text, final = constrained(
            worker, prompt, inference_pb2.Constraint(json_object=True), **sampling
        )
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP, text
        assert isinstance(json.loads(text), dict), text


def test_gbnf_grammar_limits_the_output(worker: Worker) -> None:
    constraint = inference_pb2.Constraint(grammar='root ::= ("yes" | "no")')
    answers = set()
    for sampling in [{"temperature": 0.0}] + [{"temperature": 1.5, "seed": s} for s in range(6)]:
        text, final = constrained(worker, "Is the sea wet? Answer:", constraint, **sampling)
        assert text in ("yes", "no"), text
        assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
        answers.add(text)
    assert answers  # at least one answer came back


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
    assert worker.text(prompt="Hello", sampling=greedy(2))
    health = worker.health()
    assert health is not None and health.state == engine_pb2.ENGINE_STATE_READY


def test_a_schema_llama_cpp_refuses_is_explained_as_a_schema(worker: Worker) -> None:
    constraint = inference_pb2.Constraint(json_schema='{"type": "string", "pattern": "^(a|)*$"}')
    err = rpc_error(
        lambda: worker.generate(prompt="Hello", sampling=greedy(4), constraint=constraint)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "JSON schema" in (err.details() or "") and "GBNF" not in (err.details() or "")


def spelling(model_path: Path, piece: bytes) -> list[int]:
    """Every token id whose text is exactly `piece`."""
    from llama_cpp import Llama

    vocab = Llama(str(model_path), vocab_only=True, verbose=False)
    return [t for t in range(vocab.n_vocab()) if vocab.detokenize([t]) == piece]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_the_logit_bias_leaves_no_token_for_fails_only_that_request(
    worker: Worker, model_path: Path, temperature: float
) -> None:
    """The grammar allows only "a" and the bias bans every token spelling it: the
    request fails, and the worker (which llama.cpp's grammar used to abort when handed
    a token outside its language) stays up for the next one."""
    banned = spelling(model_path, b"a")
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
    assert worker.text(prompt="Hello", sampling=greedy(2))
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
    assert worker.text(prompt="Hello", sampling=greedy(2))


def first_token(worker: Worker, prompt: str, **sampling: Any) -> str:
    """The text of the one token greedy decoding picks after prompt."""
    return worker.text(prompt=prompt, sampling=greedy(1, **sampling))


def token_id(worker: Worker, piece: str) -> int:
    tokens = worker.stub.Tokenize(inference_pb2.TokenizeRequest(text=piece), timeout=10).tokens
    assert len(tokens) == 1, (piece, list(tokens))
    return int(tokens[0])


def test_logit_bias_bans_and_forces_tokens(worker: Worker) -> None:
    prompt = "The capital of France is"
    favourite = first_token(worker, prompt)
    banned = token_id(worker, favourite)
    # One token is generated either way, so different text means a different token.
    assert first_token(worker, prompt, logit_bias={banned: -100}) != favourite
    forced = token_id(worker, " banana")
    assert first_token(worker, prompt, logit_bias={forced: 100}) == " banana"


def test_logit_bias_outside_the_vocabulary_is_invalid(worker: Worker) -> None:
    err = rpc_error(lambda: worker.generate(prompt="Hi", sampling=greedy(2, logit_bias={10**8: 5})))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in (err.details() or "")
