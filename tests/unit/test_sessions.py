"""`blazar.api.sessions`: a dialect field's session key."""

from __future__ import annotations

from blazar.api import sessions


def test_a_field_is_its_own_key_up_to_the_bound_then_its_digest() -> None:
    assert sessions.of_field(None) == sessions.of_field("") == ""
    fits = "é" * (sessions.MAX_SESSION_BYTES // 2)  # 2 bytes each: exactly the bound
    assert sessions.of_field(fits) == fits
    longer = fits + "x"
    key = sessions.of_field(longer)
    assert key.startswith("sha256:") and len(key.encode()) <= sessions.MAX_SESSION_BYTES
    assert sessions.of_field(longer) == key != sessions.of_field(longer + "y")
