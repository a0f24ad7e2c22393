"""What a saved slot state is valid for (`kvstore.Identity`)."""

from __future__ import annotations

import os
from pathlib import Path

from blazar.engine import kvstore, llama


def identity(path: Path) -> kvstore.Identity:
    options = llama.RuntimeOptions(model_path=str(path), slots=2, context_per_slot=512, threads=1)
    return kvstore.Identity.of(options, context_per_slot=512)


def test_same_file_same_identity(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3 << 20))
    assert identity(model) == identity(model)


def test_weights_edited_in_place_change_the_identity(tmp_path: Path) -> None:
    """Same size, same first and last MiB: a review restored a cache made with other
    weights this way. The modification time tells them apart."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(3 << 20))
    before = identity(model)
    with model.open("r+b") as f:
        f.seek(3 << 19)
        f.write(b"\xff" * 4096)
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, before.model_mtime_ns + 1_000_000))
    after = identity(model)
    assert (after.model_size, after.model_hash) == (before.model_size, before.model_hash)
    assert after != before
