"""Engine sampling defaults and validation (the pure half of blazar.engine.sampling)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import sampling


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {},
            sampling.SamplingParams(seed=7),
        ),
        (  # zero differs from unset
            {"temperature": 0.0, "top_k": 0, "min_p": 0.0, "seed": 0},
            sampling.SamplingParams(temperature=0.0, top_k=0, min_p=0.0, seed=0),
        ),
        (
            {"max_tokens": 5, "stop": ["\n", "END"], "repeat_penalty": 1.25},
            sampling.SamplingParams(max_tokens=5, stop=("\n", "END"), repeat_penalty=1.25, seed=7),
        ),
        (  # a requested context; 0 is none
            {"context_limit": 16},
            sampling.SamplingParams(context_limit=16, seed=7),
        ),
        ({"context_limit": 0}, sampling.SamplingParams(seed=7)),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_p": 0.5},
            sampling.SamplingParams(
                presence_penalty=0.5, frequency_penalty=0.25, top_p=0.5, seed=7
            ),
        ),
    ],
)
def test_resolve(fields: dict[str, Any], expected: sampling.SamplingParams) -> None:
    assert sampling.resolve(inference_pb2.Sampling(**fields), seed=7) == expected


@pytest.mark.parametrize(
    ("seed", "native"), [(0, 0), (7, 7), (2**32 - 2, 2**32 - 2), (2**32 - 1, 2**32 - 2)]
)
def test_an_explicit_seed_is_never_llamas_random_seed(seed: int, native: int) -> None:
    assert sampling.resolve(inference_pb2.Sampling(seed=seed)).seed == native


def test_unset_seed_is_random() -> None:
    seeds = {sampling.resolve(inference_pb2.Sampling()).seed for _ in range(8)}
    assert len(seeds) > 1


@pytest.mark.parametrize(
    ("params", "greedy", "penalized"),
    [
        (sampling.SamplingParams(), False, False),
        (sampling.SamplingParams(temperature=0.0), True, False),
        (sampling.SamplingParams(temperature=1e-45), True, False),
        (sampling.SamplingParams(temperature=1e-3), False, False),
        (sampling.SamplingParams(repeat_penalty=1.2), False, True),
        (sampling.SamplingParams(presence_penalty=0.1), False, True),
    ],
)
def test_flags(params: sampling.SamplingParams, greedy: bool, penalized: bool) -> None:
    assert (params.greedy, params.penalized) == (greedy, penalized)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        # Not numbers: NaN passes every `<` check, so each bound must be written to fail.
        ({"temperature": math.nan}, "temperature must be a number"),
        ({"temperature": math.inf}, "temperature must be a number"),
        ({"repeat_penalty": math.nan}, "repeat_penalty must be a number"),
        ({"repeat_penalty": math.inf}, "repeat_penalty must be a number"),
        ({"presence_penalty": math.nan}, "presence_penalty must be a number"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty must be a number"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
    ],
)
def test_resolve_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=message):
        sampling.resolve(inference_pb2.Sampling(**fields))


# --- constraints, logit bias, logprobs ---------------------------------------------------


class FakeVocab:
    """Enough of a vocabulary for `resolve`'s id checks (no grammar compiled natively)."""

    n_tokens = 1000
    handle = None
    end_of_generation = frozenset({1, 106})


def test_ignore_eos_bans_every_end_of_generation_token() -> None:
    """Whatever bias the request gave them: llama.cpp's server ignores it too."""
    params = sampling.resolve(
        inference_pb2.Sampling(ignore_eos=True, logit_bias={106: 5.0, 7: 1.0}),
        seed=1,
        vocab=FakeVocab(),
    )
    assert params.logit_bias == ((1, sampling.BAN_BIAS), (7, 1.0), (106, sampling.BAN_BIAS))
    plain = sampling.resolve(inference_pb2.Sampling(logit_bias={106: 5.0}), vocab=FakeVocab())
    assert plain.logit_bias == ((106, 5.0),)


def test_resolve_carries_logit_bias_and_logprobs() -> None:
    params = sampling.resolve(
        inference_pb2.Sampling(
            logit_bias={7: -100.0, 3: 2.5}, logprobs=True, top_logprobs=5, prompt_logprobs=True
        ),
        seed=1,
    )
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert (params.logprobs, params.top_logprobs, params.prompt_logprobs) == (True, 5, True)
    assert params.grammar is None and not params.constrained


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1000: 1.0}}, "outside the vocabulary of 1000 tokens: 1000"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
    ],
)
def test_resolve_rejects_logprobs_and_bias(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=message):
        sampling.resolve(inference_pb2.Sampling(**fields), vocab=FakeVocab())


@pytest.mark.parametrize(
    ("fields", "blamed"),
    [
        ({"logit_bias": {1000: 1.0}}, sampling.LOGIT_BIAS_FIELD),
        ({"logit_bias": {-1: 1.0, 5: float("nan")}}, sampling.LOGIT_BIAS_FIELD),
        # Several fields at fault: none is named alone.
        ({"logit_bias": {1000: 1.0}, "temperature": -1.0}, None),
        ({"temperature": -1.0}, None),
    ],
)
def test_resolve_names_the_logit_bias_when_it_alone_is_at_fault(
    fields: dict[str, Any], blamed: str | None
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        sampling.resolve(inference_pb2.Sampling(**fields), vocab=FakeVocab())
    assert caught.value.metadata.get(errors.FIELD_KEY) == blamed


def test_stop_strings_are_capped() -> None:
    stops = [f"s{i}" for i in range(sampling.MAX_STOPS)]
    assert sampling.resolve(inference_pb2.Sampling(stop=stops), seed=1).stop == tuple(stops)
    with pytest.raises(errors.InvalidRequest, match="at most 64 stop strings") as caught:
        sampling.resolve(inference_pb2.Sampling(stop=[*stops, "one more"]), seed=1)
    assert caught.value.metadata.get(errors.FIELD_KEY) == sampling.STOP_FIELD


def test_grammar_passes_through() -> None:
    constraint = inference_pb2.Constraint(grammar='root ::= "yes" | "no"')
    params = sampling.resolve(inference_pb2.Sampling(), seed=1, constraint=constraint)
    assert params.grammar == 'root ::= "yes" | "no"'
    assert params.constrained


def test_no_constraint_means_no_grammar() -> None:
    assert sampling.grammar_of(inference_pb2.Constraint()) is None
    assert sampling.grammar_of(inference_pb2.Constraint(json_object=False)) is None


def test_json_schema_becomes_a_grammar_with_strict_strings() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    grammar = sampling.grammar_of(inference_pb2.Constraint(json_schema=json.dumps(schema)))
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["root"].startswith('"{" space name-kv "," space age-kv')
    # Raw control characters are not JSON, surrogates are not characters: the rule excludes them.
    assert rules["char"].startswith('[^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF]')


def test_json_object_grammar_is_a_generic_object() -> None:
    grammar = sampling.grammar_of(inference_pb2.Constraint(json_object=True))
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["root"] == "object"
    assert rules["char"].startswith('[^"\\\\\\x7F')


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json_schema": "{nope"}, "not valid JSON"),
        ({"json_schema": "[1, 2]"}, "must be a JSON object, not list"),
        ({"json_schema": "true"}, "must be a JSON object, not bool"),
        ({"json_schema": '{"type": "no-such-type"}'}, "not a valid JSON Schema"),
        ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "cannot be turned into a grammar"),
        ({"json_schema": '{"$ref": "https://example.com/s.json"}'}, "cannot be turned"),
        ({"json_schema": '{"type": "string", "pattern": "^(?!a)"}'}, "cannot be turned"),
        ({"json_schema": '{"type": "integer", "maximum": 9}'}, "cannot enforce: maximum"),
        ({"grammar": 'start ::= "x"'}, "no 'root' rule"),
    ],
)
def test_bad_constraints_are_invalid_requests(constraint: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=message) as caught:
        sampling.resolve(
            inference_pb2.Sampling(), seed=1, constraint=inference_pb2.Constraint(**constraint)
        )
    # Each dialect blames its own parameter for it (OpenAI: response_format).
    assert caught.value.metadata[errors.FIELD_KEY] == "constraint"


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        # jsonschema's regex check catches re.error only; this is an OverflowError.
        ('{"type": "string", "pattern": "a{99999999999}"}', "the pattern cannot be compiled"),
        # Would be written into the grammar as Infinity, which is not JSON.
        ('{"enum": [1e400]}', "out of a double's range"),
    ],
)
def test_schemas_python_cannot_hold_are_invalid_requests(document: str, fragment: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=re.escape(fragment)) as info:
        sampling.resolve(
            inference_pb2.Sampling(), constraint=inference_pb2.Constraint(json_schema=document)
        )
    assert info.value.metadata[errors.FIELD_KEY] == "constraint"


def test_a_schema_with_an_integer_past_the_digit_limit_is_an_invalid_request() -> None:
    """Found by tests/integration/fuzz: a plain ValueError from the decoder (it was an
    INTERNAL error)."""
    document = '{"type": "string", "maxLength": 1' + "0" * 5000 + "}"
    with pytest.raises(errors.InvalidRequest, match="not valid JSON: Exceeds the limit") as info:
        sampling.resolve(
            inference_pb2.Sampling(), constraint=inference_pb2.Constraint(json_schema=document)
        )
    assert info.value.metadata[errors.FIELD_KEY] == "constraint"


@pytest.mark.parametrize(
    "document",
    [
        "[" * 5000 + "]" * 5000,  # too deep for the JSON decoder itself
        # Decodes, but too deep to translate (or to encode again).
        '{"type": "object", "properties": {"a": ' * 900 + '{"type": "string"}' + "}}" * 900,
    ],
)
def test_a_schema_nested_too_deeply_is_an_invalid_request(document: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="nest") as info:
        sampling.resolve(
            inference_pb2.Sampling(), constraint=inference_pb2.Constraint(json_schema=document)
        )
    assert info.value.metadata[errors.FIELD_KEY] == "constraint"


def test_a_grammar_pass_past_its_bound_ends_the_request_not_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chain's pick is rejected, and the grammar's pass over the vocabulary takes
    11 s (200 optional items in a row did, per token): the request is refused, naming
    the time, before its next step would hold the decode thread as long again."""
    ticks = iter([0.0, 11.0])
    sampler = sampling.Sampler(
        chain=object(), grammar=object(), n_vocab=4, clock=lambda: next(ticks)
    )
    monkeypatch.setattr(sampler, "_draw", lambda ctx, index, *, grammar_first: 1)
    monkeypatch.setattr(sampler, "_allows", lambda token: False)
    with pytest.raises(errors.InvalidRequest, match=r"took 11\.0 s to constrain one token") as info:
        sampler.sample(None, 0)
    assert info.value.metadata[errors.FIELD_KEY] == "constraint"


# --- when a slice of the best logits decides the chain's draw ---------------------------

LN20 = math.log(20)  # -ln(0.05): min-p 0.05 keeps logits within this of the best


@pytest.mark.parametrize(
    ("allowed", "boundary", "keep", "top_p", "min_p", "decides"),
    [
        # keep of them allowed: top-k never looks past the slice.
        pytest.param([5.0, 4.0, 3.0], 0.0, 3, 0.95, 0.0, True, id="keep-allowed"),
        pytest.param([], 0.0, 40, 0.95, 0.05, False, id="none-allowed"),
        # Without min-p, a token outside could be drawn, however unlikely.
        pytest.param([9.0], 0.0, 40, 1.0, 0.0, False, id="no-min-p"),
        # min-p drops everything at or below the boundary...
        pytest.param([9.0], 9.0 - LN20 - 0.01, 40, 1.0, 0.05, True, id="min-p-drops-the-rest"),
        # ...but not a boundary within its reach (nor within the float margin of it).
        pytest.param([9.0], 9.0 - LN20 + 0.01, 40, 1.0, 0.05, False, id="min-p-reaches-past"),
        pytest.param([9.0], 9.0 - LN20 - 1e-4, 40, 1.0, 0.05, False, id="within-the-margin"),
        # top-p cuts after the best (0.99 of the slice's weight), and min-p drops the
        # second: outside weight moving the cut later changes nothing.
        pytest.param([9.0, 4.0], 0.0, 40, 0.95, 0.05, True, id="top-p-cut-min-p-drops"),
        # top-p may cut after the best, but the second survives min-p if outside
        # weight moves the cut past it: undecided.
        pytest.param([9.0, 7.0], 0.0, 40, 0.5, 0.05, False, id="top-p-cut-moves"),
        # top-p keeps both whatever lies outside: decided.
        pytest.param([9.0, 8.5], 0.0, 40, 0.95, 0.05, True, id="top-p-keeps-both"),
    ],
)
def test_a_slice_decides_the_draw_only_when_nothing_outside_can_be_drawn(
    allowed: list[float], boundary: float, keep: int, top_p: float, min_p: float, decides: bool
) -> None:
    got = sampling.slice_decides(allowed, boundary, keep=keep, top_p=top_p, min_p=min_p)
    assert got is decides
