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
