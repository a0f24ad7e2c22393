"""The committed stubs in blazar/_proto must be exactly what proto/ generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_proto(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "tools" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in gen.generate(tmp_path)}
    committed_dir = REPO / "blazar" / "_proto"
    committed = {
        p.relative_to(committed_dir): p.read_text()
        for p in committed_dir.rglob("*")
        if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert set(fresh) == set(committed), "stub files differ: run `make proto`"
    stale = sorted(str(name) for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stubs out of date with proto/: {stale}; run `make proto`"
