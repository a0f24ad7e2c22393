"""What a saved slot state is valid for (`kvstore.Identity`)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from blazar.engine import kvstore
from tests import launches


def identity(path: Path) -> kvstore.Identity:
    spec = launches.spec(path, slots=2, context_per_slot=512, threads=1)
    return kvstore.Identity.of(spec, context_per_slot=512)


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


class FakeRuntime:
    """`save_seq`/`load_seq` as llama.cpp's state files behave: whatever parses loads."""

    def __init__(self, slots: int = 2) -> None:
        self.spec = launches.spec("m.gguf", slots=slots, context_per_slot=512, threads=1)
        self.loaded: dict[int, list[int]] = {}
        # What the directory held when each load started (a crash there leaves this).
        self.on_disk_at_load: list[set[str]] = []

    def save_seq(self, seq: int, path: str, tokens: list[int]) -> int:
        data = bytes(t % 251 for t in tokens) * 64
        Path(path).write_bytes(len(tokens).to_bytes(4, "little") + data)
        return len(data) + 4

    def load_seq(self, seq: int, path: str) -> list[int] | None:
        file = Path(path)
        self.on_disk_at_load.append({p.name for p in file.parent.iterdir()})
        raw = file.read_bytes()
        count = int.from_bytes(raw[:4], "little")
        self.loaded[seq] = list(raw[4 : 4 + count])
        return self.loaded[seq]

    def clear(self, seq: int) -> None:
        self.loaded.pop(seq, None)


def saved(tmp_path: Path) -> tuple[FakeRuntime, Path, kvstore.Identity]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1 << 10))
    runtime, directory, ident = FakeRuntime(), tmp_path / "kv", identity(model)
    slots = {0: kvstore.Cached([1, 2, 3, 4], "t1"), 1: kvstore.Cached([7, 8])}
    kvstore.save(runtime, directory, ident, slots)
    return runtime, directory, ident


def test_a_saved_state_is_restored_and_consumed(tmp_path: Path) -> None:
    runtime, directory, ident = saved(tmp_path)
    restored = kvstore.restore(runtime, directory, ident)
    # Each with the scope of the requests that filled it: only theirs reuse it.
    assert restored == {0: kvstore.Cached([1, 2, 3, 4], "t1"), 1: kvstore.Cached([7, 8], "")}
    assert list(directory.iterdir()) == []


def test_a_state_saved_before_scopes_is_the_owners(tmp_path: Path) -> None:
    """A record written before cache scopes has none: the shared scope "", which no
    tenant's requests reuse (their scope is their name)."""
    runtime, directory, ident = saved(tmp_path)
    meta = directory / "slot-0.json"
    record = json.loads(meta.read_text())
    del record["scope"]
    meta.write_text(json.dumps(record))
    assert kvstore.restore(runtime, directory, ident)[0] == kvstore.Cached([1, 2, 3, 4], "")


def test_a_damaged_state_is_not_loaded(tmp_path: Path) -> None:
    """llama.cpp loads a state whose cells were overwritten as long as it parses, and
    the cache then answers wrongly: a review saw it (and saw it saved again)."""
    runtime, directory, ident = saved(tmp_path)
    kv = directory / "slot-0.kv"
    with kv.open("r+b") as f:
        f.seek(8)
        f.write(b"\xee")
    restored = kvstore.restore(runtime, directory, ident)
    assert restored == {1: kvstore.Cached([7, 8])}
    assert 0 not in runtime.loaded
    assert list(directory.iterdir()) == []


def test_the_record_is_gone_before_llama_cpp_reads_a_state(tmp_path: Path) -> None:
    """Should llama.cpp abort on a state, the next start must not find it valid again."""
    runtime, directory, ident = saved(tmp_path)
    kvstore.restore(runtime, directory, ident)
    assert runtime.on_disk_at_load == [
        {"slot-0.kv", "slot-1.kv", "slot-1.json"},
        {"slot-1.kv"},
    ]


def test_something_that_cannot_be_removed_does_not_fail_the_restore(tmp_path: Path) -> None:
    """A directory where a slot's file goes (junk in the cache directory) cannot be
    unlinked: the restore must still return what it loaded, or the slots would hold
    positions their tokens do not say, and every decode in them fails."""
    runtime, directory, ident = saved(tmp_path)
    (directory / "slot-5.kv").mkdir()  # a slot this worker does not have
    restored = kvstore.restore(runtime, directory, ident)
    assert restored == {0: kvstore.Cached([1, 2, 3, 4], "t1"), 1: kvstore.Cached([7, 8])}


@dataclasses.dataclass
class Slot:
    index: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    scope: str = ""
    prompt_len: int = 0


def test_a_restore_that_fails_leaves_no_slot_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime, directory, _ = saved(tmp_path)
    runtime.spec = dataclasses.replace(runtime.spec, model_path=str(tmp_path / "m.gguf"))
    runtime.context_per_slot = 512  # type: ignore[attr-defined]

    def fails_after_loading(rt: FakeRuntime, *_: object) -> dict[int, kvstore.Cached]:
        rt.load_seq(0, str(directory / "slot-0.kv"))
        raise OSError("the disk went away")

    monkeypatch.setattr(kvstore, "restore", fails_after_loading)
    slots = [Slot(0), Slot(1)]
    kvstore.restore_slots(runtime, directory, slots, kvstore.loaded(runtime))  # type: ignore[arg-type]
    assert runtime.loaded == {}
    assert [s.tokens for s in slots] == [[], []]


class SavingRuntime(FakeRuntime):
    """A loaded runtime of the model at `path`, as `save_slots` needs one."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.spec = dataclasses.replace(self.spec, model_path=str(path))
        self.context_per_slot = 512

    def truncate(self, seq: int, keep: int) -> bool:
        return True


def test_a_cache_of_weights_replaced_while_running_is_not_saved(tmp_path: Path) -> None:
    """A review replaced the model file under a running engine (a new GGUF, same name),
    stopped it, and the next start restored a cache the old weights had computed under
    the new file's identity: its answer differed from a cold one's."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1 << 10))
    runtime, directory = SavingRuntime(model), tmp_path / "kv"
    at_load = kvstore.loaded(runtime)  # type: ignore[arg-type]
    assert at_load is not None
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\x01" * (2 << 10))
    other.replace(model)
    slots = [Slot(0, [1, 2, 3], "", 3), Slot(1)]
    kvstore.save_slots(runtime, directory, slots, at_load)  # type: ignore[arg-type]
    now = kvstore.loaded(runtime)  # type: ignore[arg-type]
    assert now is not None
    assert kvstore.restore(runtime, directory, now) == {}  # type: ignore[arg-type]


def test_a_cache_of_the_weights_still_on_disk_is_saved(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1 << 10))
    runtime, directory = SavingRuntime(model), tmp_path / "kv"
    at_load = kvstore.loaded(runtime)  # type: ignore[arg-type]
    kvstore.save_slots(runtime, directory, [Slot(0, [1, 2, 3], "t", 3)], at_load)  # type: ignore[arg-type]
    assert at_load is not None
    restored = kvstore.restore(runtime, directory, at_load)  # type: ignore[arg-type]
    assert restored == {0: kvstore.Cached([1, 2, 3], "t")}


def test_a_save_cut_short_leaves_no_file_behind(tmp_path: Path) -> None:
    """A worker killed while writing a slot's state leaves `slot-<i>.kv.tmp`; one of a
    slot the next worker does not have (fewer slots now) was never removed."""
    runtime, directory, ident = saved(tmp_path)
    (directory / "slot-0.kv.tmp").write_bytes(b"half")
    (directory / "slot-5.kv.tmp").write_bytes(b"half")
    assert kvstore.restore(runtime, directory, ident).keys() == {0, 1}
    assert list(directory.iterdir()) == []
