"""Bounds on echoed text: errors, field errors and their metadata."""

from __future__ import annotations

from blazar.api import clip, errors


def test_clip_keeps_short_text_and_says_how_much_it_cut() -> None:
    assert clip.clip("abc", 3) == "abc"
    assert clip.clip("abcdefgh", 4) == "abc [... 4 characters left out ...] h"
    # The end stays: it is where an error says what to do.
    long = "Invalid name '" + "x" * 10_000 + "': use letters and digits."
    assert clip.clip(long, 1_000).endswith("x': use letters and digits.")


def test_an_error_quoting_a_huge_value_is_bounded() -> None:
    name = "m" * 2**20
    err = errors.InvalidRequest(f"The model '{name}' does not exist.", metadata={"model": name})
    assert len(err.message) < clip.MESSAGE_CHARS + 100
    assert len(err.metadata["model"]) < clip.FIELD_CHARS + 100
    field = errors.FieldError(path="Lane/x: spec", message=name)
    assert len(str(field)) < clip.FIELD_CHARS + 200


def test_half_a_surrogate_pair_is_written_as_its_escape() -> None:
    """An error quoting a caller's key decoded from `"\\ud800key"` can still be sent
    (found by the engine fuzz test: the refusal itself failed as INTERNAL)."""
    err = errors.InvalidRequest("keyword \ud800key", metadata={"field": "x\udfffy"})
    assert err.message == "keyword \\ud800key"
    assert err.metadata["field"] == "x\\udfffy"
    err.message.encode("utf-8")
    assert clip.clip("fine \U0001f600", 100) == "fine \U0001f600"


def test_a_field_error_stays_on_its_line_whatever_key_the_caller_sent() -> None:
    """Found by the manifest fuzz test: an extra key `'4z\\n§'` split a field error over
    two lines, so the second no longer said which object and field it was about."""
    field = errors.FieldError(path="SLOPolicy/p: spec.§\x1c\n4z\u2028", message="Extra\ninputs")
    assert str(field) == "SLOPolicy/p: spec.§\\x1c\\n4z\\u2028: Extra\\ninputs"
    batch = errors.ManifestInvalid([field, errors.FieldError("Lane/x: spec", "bad")])
    assert len(batch.message.splitlines()) == 3
    assert clip.one_line("plain text, ünïcode \U0001f600") == "plain text, ünïcode \U0001f600"
