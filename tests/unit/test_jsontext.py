import json

import pytest

from blazar.api import jsontext


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "Expecting property name"),
        ("[" * 100_000, "nested too deeply"),
        ('{"a": 1' + "0" * 5000 + "}", "Exceeds the limit (4300 digits)"),
        (b"{\xff}", "can't decode byte 0xff"),
        # What Python reads and JSON has not.
        ('{"t": NaN}', "NaN is not a JSON value"),
        ("[-Infinity]", "-Infinity is not a JSON value"),
        ('{"enum": [1e400]}', "the number 1e400 is out of a double's range"),
    ],
)
def test_every_way_json_text_fails_is_one_refusal(text: str | bytes, fragment: str) -> None:
    with pytest.raises(jsontext.NotJSON) as caught:
        jsontext.loads(text)
    assert fragment in str(caught.value)
    # A ValueError still, so callers that caught ValueError keep working.
    assert isinstance(caught.value, ValueError)


def test_json_blazar_can_read_reads_as_json_does() -> None:
    text = '{"a": [1, 2.5, "x", null, true], "b": {"c": ' + "9" * 4300 + "}}"
    assert jsontext.loads(text) == json.loads(text)
    assert jsontext.loads(b'{"k": 1}') == {"k": 1}
    # A key given twice: the last kept, as JSON parsers do, unless keys must be unique.
    assert jsontext.loads('{"k": 1, "k": 2}') == {"k": 2}
    with pytest.raises(jsontext.NotJSON, match='the key "k" is given twice'):
        jsontext.loads('{"a": {"k": 1, "k": 2}}', unique_keys=True)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"\\ud800key": 1}', "\\ud800 is half of a UTF-16 surrogate pair"),
        ('{"k": ["ok", {"x": "a\\uDC00b"}]}', "\\udc00 is half"),
        (b'["\\ud83d"]', "\\ud83d is half"),
    ],
)
def test_half_a_surrogate_pair_is_refused_where_whole_characters_are_asked(
    text: str | bytes, fragment: str
) -> None:
    """No UTF-8 encoder takes the string it decodes to (a grammar made from it could
    not be handed over); without `whole_characters` it is read as Python reads it."""
    with pytest.raises(jsontext.NotJSON, match=fragment.replace("\\", "\\\\")):
        jsontext.loads(text, whole_characters=True)
    assert jsontext.loads(text) == json.loads(text)
    # A whole pair is one character; an escaped backslash before "u" is no escape.
    assert jsontext.loads('"\\ud83d\\ude00"', whole_characters=True) == "\U0001f600"
    assert jsontext.loads('"\\\\ud800"', whole_characters=True) == "\\ud800"
