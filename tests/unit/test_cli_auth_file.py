"""`blazar serve --auth-file` follows its file while serving: keys added, revoked or
rotated take effect without a restart, also when the file is a symbolic link that is
re-pointed (`ln -sfn`, a Kubernetes Secret mounted as a volume)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from blazar.api import errors
from blazar.cli import daemon
from blazar.dataplane import access
from blazar.store.sqlite import SQLiteStore


def auth_text(*names: str) -> str:
    lines = ["tenants:"]
    for name in names:
        digest = hashlib.sha256(f"key-{name}".encode()).hexdigest()
        lines += [f"  - name: {name}", f'    keys: ["sha256:{digest}"]', '    lanes: ["*"]']
    return "\n".join(lines) + "\n"


def in_force(gate: access.Access) -> list[str]:
    assert gate.tenants is not None
    return [t.name for t in gate.tenants.tenants]


async def until(condition: Callable[[], bool], *, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "the auth file's change was not put in force"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def following(
    path: Path, gate: access.Access, store_path: Path
) -> AsyncIterator[tuple[SQLiteStore, asyncio.Task[None]]]:
    """The auth file at `path` followed into `gate`, its events in a store at
    `store_path`, until the block ends: the store, and the follower's task."""
    store = SQLiteStore(store_path)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon._follow_auth_file(path, gate, store, stop))
    try:
        yield store, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        store.close()


async def follow(path: Path, tmp_path: Path, change: Callable[[], None]) -> access.Access:
    """The tenants in force after `change`, followed from a file that held alice's."""
    gate = access.Access(tenants=daemon.read_auth_file(path))
    async with following(path, gate, tmp_path / "state.db"):
        await asyncio.sleep(0.5)  # the watch is armed
        change()
        await until(lambda: in_force(gate) == ["bob"])
    return gate


def kubernetes_secret(directory: Path, text: str) -> Path:
    """A Secret as the kubelet mounts it: auth.yaml -> ..data/auth.yaml, ..data -> ..v1."""
    directory.mkdir()
    (directory / "..v1").mkdir()
    (directory / "..v1" / "auth.yaml").write_text(text)
    (directory / "..data").symlink_to("..v1")
    (directory / "auth.yaml").symlink_to("..data/auth.yaml")
    return directory / "auth.yaml"


def kubernetes_update(directory: Path, text: str) -> None:
    """The kubelet's update: a new directory, `..data` swapped by a rename, the old gone."""
    (directory / "..v2").mkdir()
    (directory / "..v2" / "auth.yaml").write_text(text)
    (directory / "..data_tmp").symlink_to("..v2")
    os.replace(directory / "..data_tmp", directory / "..data")
    (directory / "..v1" / "auth.yaml").unlink()
    (directory / "..v1").rmdir()


@pytest.mark.anyio
async def test_a_key_revoked_in_a_mounted_kubernetes_secret_is_refused(tmp_path: Path) -> None:
    path = kubernetes_secret(tmp_path / "secret", auth_text("alice"))
    gate = await follow(
        path, tmp_path, lambda: kubernetes_update(tmp_path / "secret", auth_text("bob"))
    )
    assert gate.tenants is not None and gate.tenants.authenticate("key-alice") is None


@pytest.mark.anyio
async def test_a_symbolic_link_re_pointed_elsewhere_puts_its_new_target_in_force(
    tmp_path: Path,
) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    (tmp_path / "old" / "auth.yaml").write_text(auth_text("alice"))
    (tmp_path / "new" / "auth.yaml").write_text(auth_text("bob"))
    path = tmp_path / "auth.yaml"
    path.symlink_to(tmp_path / "old" / "auth.yaml")

    def repoint() -> None:
        (tmp_path / "link").symlink_to(tmp_path / "new" / "auth.yaml")
        os.replace(tmp_path / "link", path)

    await follow(path, tmp_path, repoint)


@pytest.mark.anyio
async def test_a_linked_file_edited_where_it_lies_is_put_in_force(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    target = tmp_path / "conf" / "auth.yaml"
    target.write_text(auth_text("alice"))
    (tmp_path / "etc").mkdir()
    path = tmp_path / "etc" / "auth.yaml"
    path.symlink_to(target)
    await follow(path, tmp_path, lambda: target.write_text(auth_text("bob")))


@pytest.mark.anyio
async def test_a_plain_file_rewritten_is_put_in_force(tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(auth_text("alice"))
    await follow(path, tmp_path, lambda: path.write_text(auth_text("bob")))


@pytest.mark.anyio
async def test_a_change_beside_the_auth_file_reloads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(auth_text("alice"))
    gate = access.Access(tenants=daemon.read_auth_file(path))
    async with following(path, gate, tmp_path / "elsewhere.db") as (store, _):
        await asyncio.sleep(0.5)  # the watch is armed
        (tmp_path / "notes.txt").write_text("not the auth file")
        await asyncio.sleep(0.8)  # past the watch's debounce
        path.write_text(auth_text("bob"))
        await until(lambda: in_force(gate) == ["bob"])
        assert [e.reason for e in store.events()] == ["AuthFileLoaded"]


@pytest.mark.parametrize(
    ("mode", "owner", "says"),
    [
        (0o600, 1000, None),
        (0o644, 1000, None),
        (0o664, 1000, None),  # a user's private group, as Debian's umask 002 makes
        (0o644, 0, None),  # root's: a Secret mounted by the kubelet
        (0o666, 1000, "anyone may write it (mode 0666); chmod o-w it"),
        (0o602, 0, "anyone may write it (mode 0602); chmod o-w it"),
        (0o600, 1001, "it belongs to uid 1001, not this user (1000) or root"),
    ],
)
def test_an_auth_file_another_user_may_write_is_not_trusted(
    mode: int, owner: int, says: str | None
) -> None:
    st = os.stat_result((stat.S_IFREG | mode, 0, 0, 1, owner, 0, 0, 0, 0, 0))
    assert daemon.auth_file_problem(st, uid=1000) == says


def test_serve_refuses_a_world_writable_auth_file(tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(auth_text("alice"))
    path.chmod(0o666)
    with pytest.raises(errors.InvalidRequest, match=r"not used, as anyone may write it"):
        daemon.read_auth_file(path)
    path.chmod(0o644)
    assert daemon.read_auth_file(path).by_name("alice") is not None


@pytest.mark.anyio
async def test_an_auth_file_made_world_writable_keeps_the_tenants_in_force(
    tmp_path: Path,
) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(auth_text("alice"))
    gate = access.Access(tenants=daemon.read_auth_file(path))
    async with following(path, gate, tmp_path / "state.db") as (store, _):
        await asyncio.sleep(0.5)  # the watch is armed
        path.chmod(0o666)
        path.write_text(auth_text("bob"))
        await until(lambda: any(e.reason == "AuthFileRejected" for e in store.events()))
    assert in_force(gate) == ["alice"]


@pytest.mark.anyio
async def test_an_auth_file_whose_directory_comes_back_is_followed_again(
    tmp_path: Path,
) -> None:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "auth.yaml"
    path.write_text(auth_text("alice"))
    gate = access.Access(tenants=daemon.read_auth_file(path))
    (tmp_path / "conf" / "auth.yaml").unlink()
    (tmp_path / "conf").rmdir()
    async with following(path, gate, tmp_path / "state.db") as (_, task):
        await asyncio.sleep(0.2)
        assert not task.done()  # it waits for the directory, it does not end or spin
        (tmp_path / "conf").mkdir()
        await asyncio.sleep(daemon.AUTH_FILE_RETRY_S + 0.5)  # the watch is armed again
        path.write_text(auth_text("bob"))
        await until(lambda: in_force(gate) == ["bob"])
