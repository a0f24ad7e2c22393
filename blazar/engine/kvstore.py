"""Slot KV state on disk (a launch's `kv_dir`): saved on graceful stop, restored on start.

Per slot two files: `slot-<i>.kv` (llama.cpp's sequence state with its token list)
and `slot-<i>.json`, written last, which says what the state belongs to: the model
file (size, modification time and a hash of its head and tail), the slot count, the
context per slot and the cache types, and the `.kv` file's own sha256; and whose
requests filled it (the slot's cache scope, `Job.cache_scope`), which a restored slot
keeps: only their requests reuse it after the restart, as before it.
A restore loads only files whose identity matches this worker and whose content is
what was written (llama.cpp reads a damaged state without complaint as long as it
parses, and the cache would then answer wrongly), and consumes them; anything else
is skipped with a warning, never fatal. Decode thread only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import structlog

from blazar.api import replicas
from blazar.engine import llama

log = structlog.get_logger("blazar.engine.kvstore")

# 2: the record holds the `.kv` file's sha256.
FORMAT = 2
_HASHED_BYTES = 1 << 20


@dataclass(frozen=True)
class Cached:
    """What one slot's cache holds: its tokens, and whose requests filled it."""

    tokens: list[int]
    scope: str = ""


@dataclass(frozen=True)
class Identity:
    """What a saved state is only valid for."""

    model_size: int
    # An in-place edit of the weights keeps the size and may keep head and tail; it
    # changes the modification time (as the Model controller's rehash check assumes).
    model_mtime_ns: int
    model_hash: str
    # llama.cpp refuses a sequence state saved with another number of KV streams.
    slots: int
    context_per_slot: int
    type_k: str
    type_v: str
    format: int = FORMAT

    @classmethod
    def of(cls, spec: replicas.LaunchSpec, *, context_per_slot: int) -> Identity:
        stat = os.stat(spec.model_path)
        return cls(
            model_size=stat.st_size,
            model_mtime_ns=stat.st_mtime_ns,
            model_hash=model_fingerprint(spec.model_path),
            slots=spec.slots,
            context_per_slot=context_per_slot,
            type_k=spec.type_k,
            type_v=spec.type_v,
        )


def model_fingerprint(path: str) -> str:
    """sha256 of the file's first and last MiB: cheap, and tells GGUF files apart."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_HASHED_BYTES))
        f.seek(max(0, os.fstat(f.fileno()).st_size - _HASHED_BYTES))
        digest.update(f.read(_HASHED_BYTES))
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _paths(directory: Path, slot: int) -> tuple[Path, Path]:
    return directory / f"slot-{slot}.kv", directory / f"slot-{slot}.json"


def _slot_of(path: Path) -> int | None:
    """The slot index a `slot-<i>.kv` or `slot-<i>.json` file belongs to."""
    stem = path.name.split(".", 1)[0].removeprefix("slot-")
    return int(stem) if stem.isdigit() else None


def save(
    runtime: llama.Runtime, directory: Path, identity: Identity, slots: dict[int, Cached]
) -> None:
    """Write each slot's state (slot index -> what it caches); stale files go."""
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    saved: dict[int, int] = {}
    for index in range(runtime.spec.slots):
        kv, meta = _paths(directory, index)
        meta.unlink(missing_ok=True)  # first: a crash mid-save leaves no valid pair
        cached = slots.get(index)
        tokens = cached.tokens if cached is not None else []
        if cached is None or not tokens:
            kv.unlink(missing_ok=True)
            continue
        tmp = kv.with_suffix(".kv.tmp")
        try:
            written = runtime.save_seq(index, str(tmp), tokens)
            if written == 0:
                raise OSError("llama_state_seq_save_file failed")
            tmp.replace(kv)
            record = asdict(identity) | {
                "tokens": len(tokens),
                "sha256": _file_sha256(kv),
                "scope": cached.scope,
            }
            meta.write_text(json.dumps(record, sort_keys=True))
        except OSError as exc:
            log.warning("kv_save_failed", slot=index, error=str(exc))
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            continue
        saved[index] = len(tokens)
    log.info(
        "kv_saved",
        dir=str(directory),
        slots=saved,
        ms=round((time.perf_counter() - started) * 1000, 1),
    )


def _discard(path: Path) -> None:
    """Remove a consumed or stale file; something that cannot be removed (a directory
    of that name, say) stays, with a warning, and never fails the restore: the slots
    already loaded into the context would be left without the tokens they hold."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("kv_discard_failed", path=str(path), error=str(exc))


def restore(runtime: llama.Runtime, directory: Path, identity: Identity) -> dict[int, Cached]:
    """Load every matching slot file into its sequence; slot index -> what it caches
    now. A record with no scope (saved before scopes were) is the owner's: ""."""
    started = time.perf_counter()
    restored: dict[int, Cached] = {}
    expected = asdict(identity)
    for index in range(runtime.spec.slots):
        kv, meta = _paths(directory, index)
        if not kv.exists() and not meta.exists():
            continue
        try:
            record = json.loads(meta.read_text())
            # Consumed either way, the record first: should llama.cpp abort on the
            # state, the next start finds no valid pair instead of aborting again.
            meta.unlink()
            found = {k: record.get(k) for k in expected}
            if found != expected:
                differs = sorted(k for k in expected if found[k] != expected[k])
                log.warning("kv_restore_skipped", slot=index, reason="mismatch", fields=differs)
                continue
            if _file_sha256(kv) != record.get("sha256"):
                log.warning("kv_restore_skipped", slot=index, reason="checksum")
                continue
            tokens = runtime.load_seq(index, str(kv))
            if tokens is None or len(tokens) != record.get("tokens"):
                runtime.clear(index)
                log.warning("kv_restore_skipped", slot=index, reason="unreadable")
                continue
            scope = record.get("scope", "")
            restored[index] = Cached(tokens, scope if isinstance(scope, str) else "")
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("kv_restore_skipped", slot=index, reason="unreadable", error=str(exc))
        finally:
            # Consumed either way: what is on disk now describes no live cache.
            _discard(meta)
            _discard(kv)
    # A save cut short (the worker killed mid-write) leaves its temporary file: no
    # save of this worker's is under way yet, and one of a slot this worker does not
    # have would never be replaced.
    for tmp in directory.glob("slot-*.kv.tmp"):
        _discard(tmp)
    # Slots this worker does not have (it was started with more before).
    found_slots = {_slot_of(p) for p in directory.glob("slot-*")}
    for index in sorted(i for i in found_slots if i is not None and i >= runtime.spec.slots):
        log.warning("kv_restore_skipped", slot=index, reason="mismatch", fields=["slots"])
        for path in _paths(directory, index):
            _discard(path)
    if restored:
        log.info(
            "kv_restored",
            dir=str(directory),
            slots={i: len(c.tokens) for i, c in restored.items()},
            ms=round((time.perf_counter() - started) * 1000, 1),
        )
    return restored


class SlotCache(Protocol):
    """What the store needs of a decode-loop slot."""

    @property
    def index(self) -> int: ...

    # Exactly the tokens in the slot's KV cache (mutable: restore and save set it).
    tokens: list[int]
    # Whose requests filled it (restore sets it).
    scope: str

    @property
    def prompt_len(self) -> int: ...


def loaded(runtime: llama.Runtime) -> Identity | None:
    """What the caches of a runtime that has just loaded its model are valid for.

    Taken once, at load: the model file may be replaced while the engine runs (a new
    download under the same name), and a cache saved at stop under the identity of
    the file on disk then would be restored for weights that never computed it.
    None when the file cannot be read: nothing is restored or saved then.
    """
    try:
        return Identity.of(runtime.spec, context_per_slot=runtime.context_per_slot)
    except OSError as exc:
        log.warning("kv_persist_off", reason="model_unreadable", error=str(exc))
        return None


def restore_slots(
    runtime: llama.Runtime,
    directory: Path,
    slots: Sequence[SlotCache],
    identity: Identity | None,
) -> None:
    """Load the caches a previous worker saved into `directory` into these slots, if
    saved for `identity` (`loaded`).

    Never raises: a cache that cannot be restored only costs a prefill.
    """
    if identity is None or not directory.is_dir():
        return
    try:
        for index, cached in restore(runtime, directory, identity).items():
            slots[index].tokens = cached.tokens
            slots[index].scope = cached.scope
    except Exception:
        log.exception("kv_restore_failed")
        # Whatever was loaded before the failure has no tokens recorded for it: a slot
        # whose sequence holds positions its tokens do not say fails every decode.
        for slot in slots:
            runtime.clear(slot.index)
            slot.tokens = []
            slot.scope = ""


def save_slots(
    runtime: llama.Runtime,
    directory: Path,
    slots: Sequence[SlotCache],
    identity: Identity | None,
) -> None:
    """Save every slot's cache into `directory`, each cut back to its last prompt, for
    `identity` (`loaded`): only while the model file is still the one loaded, since
    a record describes the file on disk and the next worker loads that one.

    A saved state keeps only the sliding window's last positions, so it can be reused
    only by a prompt that contains the whole saved sequence. A repeated prompt, or the
    next turn of the same conversation, contains the last prompt; a saved answer would
    almost never be matched. Never raises: a failed save only costs the next start
    its prefill.
    """
    if identity is None:
        return
    try:
        now = Identity.of(runtime.spec, context_per_slot=runtime.context_per_slot)
    except OSError as exc:
        log.warning("kv_save_skipped", reason="model_unreadable", error=str(exc))
        return
    if now != identity:
        differs = sorted(k for k, v in asdict(identity).items() if asdict(now)[k] != v)
        log.warning("kv_save_skipped", reason="model_changed", fields=differs)
        return
    for slot in slots:
        if 0 < slot.prompt_len < len(slot.tokens) and runtime.truncate(slot.index, slot.prompt_len):
            del slot.tokens[slot.prompt_len :]
    try:
        save(
            runtime, directory, identity, {s.index: Cached(list(s.tokens), s.scope) for s in slots}
        )
    except Exception:
        log.exception("kv_save_failed")
