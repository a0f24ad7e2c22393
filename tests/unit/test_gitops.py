"""GitOps `sync`: a directory of manifests applied as one batch, against a MemoryStore."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import watchfiles

from blazar.api import errors, kinds, manifests
from blazar.api.kinds import Kind
from blazar.gitops import watcher
from blazar.store import apply
from blazar.store.base import ApplyOutcome, WatchEvent
from blazar.store.memory import MemoryStore

MODEL = """
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: m}
spec: {source: {path: /m.gguf}}
"""
LANE = """
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: m}
"""


def test_sync_applies_every_manifest_of_the_directory(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "lanes").mkdir()
    (tmp_path / "lanes" / "l.yml").write_text(LANE)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    assert [(o.kind, o.metadata.name) for o in store.list()] == [("Lane", "l"), ("Model", "m")]


def test_sync_rejects_a_bad_directory_whole(tmp_path: Path) -> None:
    store = MemoryStore()
    (tmp_path / "model.yaml").write_text(MODEL)
    assert watcher.sync(store, tmp_path)
    before = store.resource_version
    (tmp_path / "lane.yaml").write_text(LANE.replace("model: m", "model: missing"))
    (tmp_path / "model.yaml").write_text(MODEL.replace("/m.gguf", "/other.gguf"))
    assert not watcher.sync(store, tmp_path)
    assert store.resource_version == before  # the valid Model change was not applied either
    (event,) = store.events()
    assert (event.reason, event.name) == ("ManifestRejected", f"gitops:{tmp_path}")
    assert "Lane/l (lane.yaml#1): spec.model" in event.message


def test_sync_records_a_file_it_cannot_parse(tmp_path: Path) -> None:
    store = MemoryStore()
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    assert not watcher.sync(store, tmp_path)
    assert store.list() == []
    (event,) = store.events()
    assert event.reason == "ManifestRejected"
    assert "broken.yaml#1: invalid YAML" in event.message


def test_a_watched_file_s_resource_version_is_no_precondition(tmp_path: Path) -> None:
    # A file taken from `get -o yaml`, edited twice: its copied version is stale by the
    # second edit, and the directory, being the desired state, still applies.
    store = MemoryStore()
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "lane.yaml").write_text(LANE)
    assert watcher.sync(store, tmp_path)
    stale = LANE.replace("{name: l}", "{name: l, resourceVersion: 1}")
    (tmp_path / "lane.yaml").write_text(stale.replace("{model: m}", "{model: m, replicas: 2}"))
    assert watcher.sync(store, tmp_path)
    (tmp_path / "lane.yaml").write_text(stale.replace("{model: m}", "{model: m, replicas: 3}"))
    assert watcher.sync(store, tmp_path)
    lane = store.get(Kind.LANE, "l")
    assert isinstance(lane, kinds.Lane) and lane.metadata.resource_version == 4
    assert lane.spec.replicas == 3
    assert store.events() == []


POLICY = """
apiVersion: blazar.dev/v1alpha1
kind: SLOPolicy
metadata: {name: p}
spec: {priority: 1}
"""


def keys(store: MemoryStore) -> list[str]:
    return [f"{o.kind}/{o.metadata.name}" for o in store.list()]


def test_objects_carry_the_file_they_came_from(tmp_path: Path) -> None:
    (tmp_path / "lanes").mkdir()
    (tmp_path / "lanes" / "l.yaml").write_text(LANE)
    (tmp_path / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    sources = {
        o.metadata.name: o.metadata.annotations[watcher.SOURCE_ANNOTATION] for o in store.list()
    }
    assert sources == {"l": "lanes/l.yaml", "m": "model.yaml"}


def test_a_deleted_file_prunes_its_objects_lanes_first(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
    (tmp_path / "policy.yaml").write_text(POLICY)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    seen: list[WatchEvent] = []
    store.subscribe(seen.append)
    (tmp_path / "fleet.yaml").unlink()
    assert watcher.sync(store, tmp_path)
    assert keys(store) == ["SLOPolicy/p"]
    assert [(e.kind, e.name, e.reason) for e in store.events()] == [
        ("Lane", "l", "Pruned"),
        ("Model", "m", "Pruned"),
    ]
    assert "it came from fleet.yaml" in store.events()[0].message
    assert [(e.type.value, e.object.kind) for e in seen] == [
        ("DELETED", "Lane"),
        ("DELETED", "Model"),
    ]
    assert [e.resource_version for e in seen] == sorted(e.resource_version for e in seen)
    assert seen[-1].resource_version == store.resource_version


def test_an_object_removed_from_a_file_that_remains_is_pruned(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(MODEL + "---" + POLICY)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    (tmp_path / "fleet.yaml").write_text(MODEL)
    assert watcher.sync(store, tmp_path)
    assert keys(store) == ["Model/m"]


def test_a_file_of_no_objects_is_skipped_and_logged_not_an_error(tmp_path: Path) -> None:
    # Unlike `blazar apply -f`, for which it is an error: a watched file may be emptied
    # on purpose, and the other files still apply.
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "dashes.yaml").write_text("# later\n---\n")
    store = MemoryStore()
    with structlog.testing.capture_logs() as logs:
        assert watcher.sync(store, tmp_path)
    assert keys(store) == ["Model/m"]
    assert store.events() == []
    [applied] = [e for e in logs if e["event"] == "gitops.applied"]
    assert applied["empty"] == ("dashes.yaml", "empty.yaml")


def test_objects_applied_by_hand_are_never_pruned(tmp_path: Path) -> None:
    store = MemoryStore()
    apply.apply_documents(store, manifests.parse_documents(POLICY, source="hand"))
    (tmp_path / "model.yaml").write_text(MODEL)
    assert watcher.sync(store, tmp_path)
    (tmp_path / "model.yaml").unlink()
    assert watcher.sync(store, tmp_path)
    assert keys(store) == ["SLOPolicy/p"]


def test_prune_off_keeps_what_a_deleted_file_applied(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path, prune=False)
    (tmp_path / "model.yaml").unlink()
    assert watcher.sync(store, tmp_path, prune=False)
    assert keys(store) == ["Model/m"]


@pytest.mark.parametrize(
    ("broken", "named"),
    [
        ("kind: [unclosed\n", "bad.yaml#1: invalid YAML"),
        (
            POLICY.replace("priority: 1", "priority: 1, bogus: 2"),
            "SLOPolicy/q (bad.yaml#1): spec.bogus",
        ),
    ],
)
def test_a_broken_file_prunes_nothing_and_names_its_file_and_field(
    tmp_path: Path, broken: str, named: str
) -> None:
    (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    before = store.resource_version
    (tmp_path / "fleet.yaml").unlink()  # would prune both, were the batch accepted
    (tmp_path / "bad.yaml").write_text(broken.replace("name: p", "name: q"))
    assert not watcher.sync(store, tmp_path)
    assert store.resource_version == before
    assert keys(store) == ["Lane/l", "Model/m"]
    (event,) = store.events()
    assert named in event.message


def test_a_manifest_symlink_that_points_nowhere_prunes_nothing(tmp_path: Path) -> None:
    """The file it pointed to is gone (a checkout half done, a typo): the batch is
    rejected naming it, where leaving it out pruned what it held without a word."""
    fleet, elsewhere = tmp_path / "fleet", tmp_path / "src"
    fleet.mkdir()
    elsewhere.mkdir()
    (fleet / "model.yaml").write_text(MODEL)
    (elsewhere / "lane.yaml").write_text(LANE)
    (fleet / "lane.yaml").symlink_to(elsewhere / "lane.yaml")
    store = MemoryStore()
    assert watcher.sync(store, fleet)
    assert keys(store) == ["Lane/l", "Model/m"]
    (elsewhere / "lane.yaml").unlink()
    assert not watcher.sync(store, fleet)
    assert keys(store) == ["Lane/l", "Model/m"]
    event = store.events()[-1]
    assert "lane.yaml" in event.message and "cannot read" in event.message


def test_a_batch_cannot_name_an_object_it_prunes(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    (tmp_path / "model.yaml").unlink()
    (tmp_path / "lane.yaml").write_text(LANE)
    assert not watcher.sync(store, tmp_path)
    assert keys(store) == ["Model/m"]
    (event,) = store.events()
    assert 'Lane/l (lane.yaml#1): spec.model: Model "m" not found' in event.message


def test_a_vanished_directory_prunes_nothing(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, fleet)
    (fleet / "model.yaml").unlink()
    fleet.rmdir()
    assert not watcher.sync(store, fleet)
    assert keys(store) == ["Model/m"]


def test_a_dry_run_reports_what_it_would_prune(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    outcomes = apply.apply_documents(store, [], dry_run=True, prune=watcher.owned)
    assert [(o.action.value, o.object.metadata.name) for o in outcomes] == [("pruned", "m")]
    assert keys(store) == ["Model/m"]


def test_watch_reads_the_directory_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A huge file takes seconds to parse; meanwhile the loop serves every request, so
    it must keep running: the directory is read on a thread, only applied on the loop."""
    real_load = watcher.load

    def slow_load(directory: Path) -> watcher.Loaded:
        time.sleep(1.0)  # a 30 MB manifest, say
        return real_load(directory)

    monkeypatch.setattr(watcher, "load", slow_load)
    store = MemoryStore()

    async def scenario() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.watch(store, tmp_path, stop))
        await asyncio.sleep(0.3)  # the watch has started
        (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
        longest, last = 0.0, time.monotonic()
        deadline = last + 10
        while store.get(Kind.LANE, "l") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now
        stop.set()
        await task
        return longest

    longest = asyncio.run(scenario())
    assert store.get(Kind.LANE, "l") is not None
    assert longest < 0.5, f"the event loop stalled {longest:.2f} s while the directory was read"


async def _watch_until(
    store: MemoryStore, directory: Path, change: Callable[[], None], *, seen: Callable[[], bool]
) -> bool:
    """Watch `directory`, make `change`, and say whether `seen()` came true in 5 s."""
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.watch(store, directory, stop, poll=0.2))
    await asyncio.sleep(0.3)  # the watch has started
    change()
    deadline = time.monotonic() + 5
    while not seen() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await task
    return seen()


def _two_revisions(tmp_path: Path) -> tuple[Path, Path, MemoryStore]:
    """`fleet`, a symlink to revision 1 (a Model) as applied, and revision 2 (the
    Model and a Lane) beside it, as git-sync lays out two revisions."""
    old, new = tmp_path / "rev1", tmp_path / "rev2"
    old.mkdir()
    new.mkdir()
    (old / "model.yaml").write_text(MODEL)
    (new / "model.yaml").write_text(MODEL)
    (new / "lane.yaml").write_text(LANE)
    fleet = tmp_path / "fleet"
    fleet.symlink_to(old)
    store = MemoryStore()
    assert watcher.sync(store, fleet)
    return fleet, new, store


def test_a_symlink_repointed_to_another_directory_is_applied_and_watched(tmp_path: Path) -> None:
    """git-sync publishes each revision by swapping a symlink: the watch, on the old
    revision's directory, saw nothing of the new one."""
    fleet, new, store = _two_revisions(tmp_path)

    def swap() -> None:
        (tmp_path / "next").symlink_to(new)
        (tmp_path / "next").rename(fleet)

    assert asyncio.run(
        _watch_until(store, fleet, swap, seen=lambda: store.get(Kind.LANE, "l") is not None)
    )

    # And what changes in the new one from then on is applied too.
    def edit() -> None:
        (new / "lane.yaml").write_text(LANE.replace("name: l", "name: l2"))

    assert asyncio.run(
        _watch_until(store, fleet, edit, seen=lambda: store.get(Kind.LANE, "l2") is not None)
    )


def test_an_edit_between_a_swap_and_the_new_watch_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swapped-in directory is read, and only then watched: an edit landing in
    between made no change event the new watch could see."""
    fleet, new, store = _two_revisions(tmp_path)
    read = watcher.load

    def load_then_edit(directory: Path) -> watcher.Loaded:
        loaded = read(directory)
        if (new / "lane.yaml").read_text() == LANE and fleet.resolve() == new:
            # Right after the swapped-in revision was read, before its watch starts.
            (new / "lane.yaml").write_text(LANE.replace("name: l", "name: l2"))
        return loaded

    monkeypatch.setattr(watcher, "load", load_then_edit)

    def swap() -> None:
        (tmp_path / "next").symlink_to(new)
        (tmp_path / "next").rename(fleet)

    assert asyncio.run(
        _watch_until(store, fleet, swap, seen=lambda: store.get(Kind.LANE, "l2") is not None)
    )


def test_a_directory_replaced_by_rename_is_applied_and_watched(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "model.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, fleet)

    def replace() -> None:
        fleet.rename(tmp_path / "old")
        staged = tmp_path / "staged"
        staged.mkdir()
        (staged / "model.yaml").write_text(MODEL)
        (staged / "lane.yaml").write_text(LANE)
        staged.rename(fleet)

    assert asyncio.run(
        _watch_until(store, fleet, replace, seen=lambda: store.get(Kind.LANE, "l") is not None)
    )


def test_a_zero_byte_file_settles_before_it_prunes() -> None:
    assert watcher.zero_byte_since(["a.yaml", "b.yaml"], {"a.yaml": 10.0, "c.yaml": 1.0}, 12.0) == {
        "a.yaml": 10.0,
        "b.yaml": 12.0,
    }
    since = {"a.yaml": 10.0, "b.yaml": 12.0}
    settle = watcher.ZERO_BYTE_SETTLE_S
    assert watcher.settling(since, 12.0) == {"a.yaml", "b.yaml"}
    assert watcher.settling(since, 10.0 + settle) == {"b.yaml"}
    assert watcher.settling(since, 12.0 + settle) == frozenset()


def _truncate_then(store: MemoryStore, fleet: Path, then: Callable[[], None]) -> list[str]:
    """Watch `fleet`, truncate its fleet.yaml to zero bytes, and call `then` 0.8 s later;
    what the store holds then."""

    async def scenario() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.watch(store, fleet, stop, poll=0.1))
        await asyncio.sleep(0.3)  # the watch has started
        (fleet / "fleet.yaml").write_text("")
        await asyncio.sleep(0.8)  # well past the watch's debounce
        during = keys(store)
        then()
        await asyncio.sleep(1.2)
        stop.set()
        await task
        return during

    return asyncio.run(scenario())


def test_a_file_truncated_while_being_rewritten_prunes_nothing(tmp_path: Path) -> None:
    """`blazar get lanes -o yaml > fleet.yaml`: the shell truncates the file, and the
    command writes it a second later. Its Lane must not be stopped and started again."""
    (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)

    def rewrite() -> None:
        (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)

    assert _truncate_then(store, tmp_path, rewrite) == ["Lane/l", "Model/m"]
    assert keys(store) == ["Lane/l", "Model/m"]
    assert [e.reason for e in store.events()] == []


def test_a_file_left_at_zero_bytes_prunes_once_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "ZERO_BYTE_SETTLE_S", 1.2)
    (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
    (tmp_path / "policy.yaml").write_text(POLICY)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)

    def delete_the_policy() -> None:
        (tmp_path / "policy.yaml").unlink()

    # The other file's change applies at once; the zero-byte one waits out its settle.
    during = _truncate_then(store, tmp_path, delete_the_policy)
    assert during == ["Lane/l", "Model/m", "SLOPolicy/p"]
    assert keys(store) == []
    assert [e.reason for e in store.events()] == ["Pruned"] * 3


def test_a_zero_byte_file_at_start_prunes_at_once(tmp_path: Path) -> None:
    # `sync` runs before anything serves: there is no rewrite to wait out.
    (tmp_path / "fleet.yaml").write_text(MODEL)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    (tmp_path / "fleet.yaml").write_text("")
    assert watcher.sync(store, tmp_path)
    assert keys(store) == []


class FullDisk(MemoryStore):
    """A store that cannot take a write until `room` is set (a full disk, a lock)."""

    room = False

    def apply_all(self, *args: Any, **kwargs: Any) -> list[ApplyOutcome]:
        if not self.room and not kwargs.get("dry_run"):
            raise errors.Unavailable("cannot write the store state.db: disk I/O error")
        return super().apply_all(*args, **kwargs)


def test_an_edit_the_store_could_not_take_is_applied_once_it_can(tmp_path: Path) -> None:
    """The edit made no other change event: waiting for the next one would leave the
    store behind the directory, with nothing but a log line to say so."""
    store = FullDisk()

    async def scenario() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.watch(store, tmp_path, stop, poll=0.2))
        await asyncio.sleep(0.3)  # the watch has started
        (tmp_path / "fleet.yaml").write_text(MODEL + "---" + LANE)
        await asyncio.sleep(1.0)  # the edit is seen, and its apply refused
        assert store.get(Kind.LANE, "l") is None
        store.room = True
        deadline = time.monotonic() + 5
        while store.get(Kind.LANE, "l") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await task
        return store.get(Kind.LANE, "l") is not None

    assert asyncio.run(scenario())


def test_git_s_directory_is_found_from_the_watched_directory(tmp_path: Path) -> None:
    fleet = tmp_path / "repo" / "deploy" / "fleet"
    fleet.mkdir(parents=True)
    assert watcher.git_dir(fleet) is None  # no git work tree holds tmp_path
    (tmp_path / "repo" / ".git").mkdir()
    assert watcher.git_dir(fleet) == tmp_path / "repo" / ".git"
    # A linked worktree (and a submodule): `.git` is a file naming the git directory.
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".git").write_text("gitdir: ../repo/.git/worktrees/tree\n")
    assert watcher.git_dir(tree) == tree / "../repo/.git/worktrees/tree"


def test_git_is_busy_while_it_holds_its_index_or_a_rebase_runs(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    git = tmp_path / ".git"
    git.mkdir()
    assert watcher.git_busy(fleet) is None
    for state in ("rebase-merge", "rebase-apply", "sequencer"):
        (git / state).mkdir()
        assert watcher.git_busy(fleet) == state
        (git / state).rmdir()
    (git / "index.lock").write_text("")
    assert watcher.git_busy(fleet) == "index.lock"


def test_a_directory_git_locks_waits_for_git_a_while() -> None:
    wait = watcher.GIT_LOCK_WAIT_S
    assert not watcher.waiting_for_git(None, 100.0)
    assert watcher.waiting_for_git(100.0, 100.0)
    assert watcher.waiting_for_git(100.0, 100.0 + wait - 0.1)
    assert not watcher.waiting_for_git(100.0, 100.0 + wait)


def test_a_file_git_renames_in_a_checkout_keeps_its_lane(tmp_path: Path) -> None:
    """git removes a renamed file before it writes the new one, and a large file
    between the two can outlast the watch's debounce: the Lane must not be pruned
    (its engine stopped) and created again, nor anything applied before git is done."""
    (tmp_path / ".git").mkdir()
    lock = tmp_path / ".git" / "index.lock"
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "a.yaml").write_text(LANE)
    store = MemoryStore()
    assert watcher.sync(store, tmp_path)
    uid = store.get(Kind.LANE, "l").metadata.uid  # type: ignore[union-attr]

    async def scenario() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.watch(store, tmp_path, stop, poll=0.2))
        await asyncio.sleep(0.3)  # the watch has started
        lock.write_text("")
        (tmp_path / "a.yaml").unlink()
        await asyncio.sleep(0.8)  # git writes a large file: well past the debounce
        during = keys(store)
        (tmp_path / "b.yaml").write_text(LANE)
        lock.unlink()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            store.get(Kind.LANE, "l") is None
            or store.get(Kind.LANE, "l").metadata.annotations.get(watcher.SOURCE_ANNOTATION)  # type: ignore[union-attr]
            != "b.yaml"
        ):
            await asyncio.sleep(0.05)
        stop.set()
        await task
        return during

    assert asyncio.run(scenario()) == ["Lane/l", "Model/m"]
    lane = store.get(Kind.LANE, "l")
    assert lane is not None and lane.metadata.uid == uid
    assert lane.metadata.annotations[watcher.SOURCE_ANNOTATION] == "b.yaml"
    assert [e.reason for e in store.events()] == []


def test_the_folders_that_hold_manifests_are_every_ancestor_of_each_file() -> None:
    assert watcher.folders(["a.yaml", "lanes/b.yaml", "x/y/z/c.yaml"]) == {
        "lanes",
        "x",
        "x/y",
        "x/y/z",
    }


@pytest.mark.parametrize(
    ("relative", "change", "is_dir", "seen"),
    [
        (("lanes", "a.yaml"), watchfiles.Change.added, False, True),
        (("a.json",), watchfiles.Change.deleted, False, True),
        # A folder moved in makes one event, its files none.
        (("newdir",), watchfiles.Change.added, True, True),
        # A folder that held manifests moved away (or to a hidden name), or deleted.
        (("lanes",), watchfiles.Change.deleted, False, True),
        (("x", "y"), watchfiles.Change.deleted, False, True),
        # A folder that held none, or a file of no manifest's name, changes nothing.
        (("docs",), watchfiles.Change.deleted, False, False),
        (("4913",), watchfiles.Change.added, False, False),
        (("4913",), watchfiles.Change.deleted, False, False),
        (("a.yaml~",), watchfiles.Change.added, False, False),
        (("a.yaml.orig",), watchfiles.Change.added, False, False),
        (("lanes", ".a.yaml.swp"), watchfiles.Change.added, False, False),
        # Nothing under a hidden folder: git's own objects, whatever their names.
        ((".git", "objects", "ab"), watchfiles.Change.added, True, False),
        ((".git", "x.yaml"), watchfiles.Change.modified, False, False),
        ((".hidden", "lanes"), watchfiles.Change.deleted, False, False),
        (None, watchfiles.Change.added, True, False),
        ((), watchfiles.Change.modified, True, False),
    ],
)
def test_what_the_watch_reads_the_directory_again_for(
    relative: tuple[str, ...] | None, change: watchfiles.Change, is_dir: bool, seen: bool
) -> None:
    held = frozenset({"lanes", "x", "x/y"})
    assert watcher.relevant(relative, change=change, is_dir=is_dir, held=held) is seen


@pytest.mark.parametrize("away", ["outside", ".hidden"])
def test_a_folder_moved_away_prunes_what_it_held(tmp_path: Path, away: str) -> None:
    fleet = tmp_path / "fleet"
    (fleet / "lanes" / "nested").mkdir(parents=True)
    (fleet / "model.yaml").write_text(MODEL)
    (fleet / "lanes" / "nested" / "lane.yaml").write_text(LANE)
    store = MemoryStore()
    assert watcher.sync(store, fleet)
    target = tmp_path / away if away == "outside" else fleet / away
    assert asyncio.run(
        _watch_until(
            store,
            fleet,
            lambda: (fleet / "lanes").rename(target),
            seen=lambda: store.get(Kind.LANE, "l") is None,
        )
    )


def test_a_folder_moved_in_is_applied(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "model.yaml").write_text(MODEL)
    (tmp_path / "lanes").mkdir()
    (tmp_path / "lanes" / "lane.yaml").write_text(LANE)
    store = MemoryStore()
    assert watcher.sync(store, fleet)
    assert asyncio.run(
        _watch_until(
            store,
            fleet,
            lambda: (tmp_path / "lanes").rename(fleet / "lanes"),
            seen=lambda: store.get(Kind.LANE, "l") is not None,
        )
    )
