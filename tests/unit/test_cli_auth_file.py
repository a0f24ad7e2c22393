"""`blazar serve --auth-file` follows its file while serving: keys added, revoked or
rotated take effect without a restart, also when the file is a symbolic link that is
re-pointed (`ln -sfn`, a Kubernetes Secret mounted as a volume)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

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


async def follow(path: Path, tmp_path: Path, change: Callable[[], None]) -> access.Access:
    """The tenants in force after `change`, followed from a file that held alice's."""
    gate = access.Access(tenants=daemon.read_auth_file(path))
    store = SQLiteStore(tmp_path / "state.db")
    stop = asyncio.Event()
    task = asyncio.create_task(daemon._follow_auth_file(path, gate, store, stop))
    try:
        await asyncio.sleep(0.5)  # the watch is armed
        change()
        await until(lambda: in_force(gate) == ["bob"])
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
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
