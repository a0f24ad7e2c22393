"""Pure helpers every shim dialect shares: body validation, field paths, HTTP status,
Retry-After."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from blazar.api import errors
from blazar.shim import http_errors, streaming, validation


@pytest.mark.parametrize(
    ("loc", "document", "missing", "expected"),
    [
        (("model",), {}, True, "model"),
        (
            ("messages", 0, "content", "str"),
            {"messages": [{"content": 5}]},
            False,
            "messages[0].content",
        ),
        (
            ("messages", 0, "content", "list[ContentPart]", 1, "text"),
            {"messages": [{"content": [{}, {"text": 1}]}]},
            False,
            "messages[0].content[1].text",
        ),
        (("stop", "str"), {"stop": {"a": 1}}, False, "stop"),
        (("messages", 3), {"messages": []}, False, "messages"),
        ((), [], False, "body"),
    ],
)
def test_field_path(loc: tuple[Any, ...], document: Any, missing: bool, expected: str) -> None:
    assert validation.field_path(loc, document, missing=missing) == expected


class Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")

    prompt: str = ""
    stop: list[str] = []


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (rb'{"prompt": "a\ud800b"}', "prompt", "(\\ud800 at character 1)"),
        (rb'{"stop": ["ok", "\ud83d"]}', "stop[1]", "unpaired surrogate"),
        (rb'{"stop": ["\ude00\ud83d"]}', "stop[0]", "(\\ude00 at character 0)"),
        # json.loads decodes bytes with surrogatepass, so raw ones arrive the same way.
        (b'{"prompt": "ab\xed\xa0\x80"}', "prompt", "(\\ud800 at character 2)"),
        # Unknown fields too: the body as a whole must be valid Unicode.
        (rb'{"messages": [{"content": "\udfff"}]}', "messages[0].content", "the string"),
        (rb'{"x": [[{"y": ["\udc00"]}]]}', "x[0][0].y[0]", "unpaired surrogate"),
        (rb'{"x": {"\ud800k": 1}}', "x.\\ud800k", "the key contains"),
    ],
)
def test_unpaired_surrogates_are_invalid(raw: bytes, param: str, fragment: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        validation.parse_body(Body, raw)
    assert caught.value.metadata == {validation.PARAM_KEY: param}
    assert fragment in caught.value.message
    assert "not valid Unicode" in caught.value.message
    # The message goes back to the client as UTF-8.
    caught.value.message.encode("utf-8")


def test_surrogate_pairs_are_valid() -> None:
    raw = rb'{"prompt": "\ud83d\ude00 \u00e9", "stop": ["\ud83d\ude00"]}'
    assert validation.parse_body(Body, raw) == Body(prompt="\U0001f600 \u00e9", stop=["\U0001f600"])


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    """Python's parser reads them; JSON has no such values, and a NaN temperature was
    refused as "less than or equal to 2"."""
    raw = b'{"prompt": "x", "temperature": ' + constant.encode() + b"}"
    with pytest.raises(errors.InvalidRequest) as caught:
        validation.parse_body(Body, raw)
    assert f"{constant.lstrip('-')} is not a JSON value" in caught.value.message
    assert "could not parse the JSON body" in caught.value.message


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (errors.InvalidRequest("x"), 400),
        (errors.ContextLengthExceeded("x"), 400),
        (errors.RequestTooLarge("x"), 413),
        (errors.ModelNotFound.of("m"), 404),
        (errors.ObjectNotFound("x"), 404),
        (errors.Overloaded("x"), 429),
        (errors.Unavailable("x"), 503),
        (errors.Unauthenticated("x"), 401),
        (errors.PermissionDenied("x"), 403),
        (errors.AdminRequired("x"), 403),
        (errors.DeadlineExceeded("x"), 504),
        (errors.UnsupportedMediaType("x"), 415),
        (errors.QueueFull("x"), 429),
        (errors.RateLimited("x"), 429),
        (errors.BlazarError("x"), 500),
        (errors.RequestStateConflict("x"), 400),
        (errors.Conflict("x"), 409),
        # A newer peer's reason, unknown here: its code decides.
        (errors.from_reason("NEW_REASON", "x", {}, code="OUT_OF_RANGE"), 400),
        (errors.from_reason("NEW_REASON", "x", {}, code="UNIMPLEMENTED"), 501),
        (errors.from_reason("NEW_REASON", "x", {}, code="DATA_LOSS"), 500),
    ],
)
def test_http_status(err: errors.BlazarError, status: int) -> None:
    assert http_errors.http_status(err) == status


@pytest.mark.parametrize(
    ("metadata", "seconds"),
    [
        ({}, 1),
        ({"retry_after_ms": "0"}, 1),
        ({"retry_after_ms": "1000"}, 1),
        ({"retry_after_ms": "1001"}, 2),
        ({"retry_after_ms": "4500"}, 5),
        ({"retry-after-ms": "4500"}, 1),  # not the key the daemon sends
        ({"retry_after_ms": "soon"}, 1),
        ({"retry_after_ms": "nan"}, 1),
    ],
)
def test_retry_after_seconds(metadata: dict[str, str], seconds: int) -> None:
    assert http_errors.retry_after_seconds(errors.Overloaded("x", metadata=metadata)) == seconds


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (errors.Overloaded("x"), {"retry-after": "1"}),
        (
            errors.Overloaded("x", metadata={"retry_after_ms": "2500"}),
            {"retry-after": "3", "retry-after-ms": "2500"},
        ),
        (
            errors.Overloaded("x", metadata={"retry_after_ms": "120.2"}),
            {"retry-after": "1", "retry-after-ms": "121"},
        ),
        (errors.Overloaded("x", metadata={"retry_after_ms": "soon"}), {"retry-after": "1"}),
        # An upstream server's own 503 with its Retry-After.
        (
            errors.Unavailable("x", metadata={"retry_after_ms": "30000"}),
            {"retry-after": "30", "retry-after-ms": "30000"},
        ),
        (errors.Unavailable("x"), {}),
        (errors.InvalidRequest("x", metadata={"retry_after_ms": "30000"}), {}),
        # A refusal no wait cures: no Retry-After, and the SDKs told not to retry.
        (
            errors.SloUnattainable.too_long(
                lane="l", policy="p", prefill_s=5.0, predicted_ttft_s=6.0, ttft_target_s=2.0
            ),
            {"x-should-retry": "false"},
        ),
    ],
)
def test_retry_after_header(err: errors.BlazarError, expected: dict[str, str]) -> None:
    assert http_errors.headers(err) == expected


def test_sse_event_framing() -> None:
    assert streaming.sse_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert streaming.sse_event("{}", event="ping") == b"event: ping\ndata: {}\n\n"
