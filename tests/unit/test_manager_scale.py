"""The controller at fleet scale: 200 objects applied at once settle within 5 s, a
later change to one of them reconciles only that one, and a periodic resync reconciles
everything again. The real SQLite store and reconcilers; processes are faked at the
supervisor's contract (`FakeProcesses`), as in tests/unit/test_controller.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from blazar.api import errors, manifests
from blazar.api.kinds import Kind, Resource
from blazar.controller import manager
from blazar.controller.lane import LaneReconciler
from blazar.controller.model import ModelReconciler
from blazar.controller.policy import PolicyReconciler
from blazar.store.sqlite import SQLiteStore
from tests.unit.helpers import Clock
from tests.unit.test_controller import FakeProcesses, until

KINDS = (Kind.MODEL, Kind.LANE, Kind.SLO_POLICY, Kind.SPEC_PAIR)
EACH = 50


def fleet(models: Path) -> str:
    """50 each of Models (files that are not there yet), SLOPolicies, SpecPairs and
    Lanes that name them: 200 objects."""
    docs = []
    for i in range(EACH):
        docs.append(
            f"kind: Model\nmetadata: {{name: m{i}}}\nspec: {{source: {{path: {models}/m{i}.gguf}}}}"
        )
        docs.append(f"kind: SLOPolicy\nmetadata: {{name: p{i}}}\nspec: {{priority: {i}}}")
        docs.append(
            f"kind: SpecPair\nmetadata: {{name: s{i}}}\n"
            f"spec: {{target: m{i}, draft: {{kind: ngram, ngramSize: 3}}}}"
        )
        docs.append(
            f"kind: Lane\nmetadata: {{name: l{i}}}\n"
            f"spec: {{model: m{i}, slots: 2, sloPolicy: p{i}, speculation: s{i}}}"
        )
    return "\n---\n".join(f"apiVersion: blazar.dev/v1alpha1\n{doc}" for doc in docs)


def settled(store: SQLiteStore) -> int:
    """Objects whose status was written for their current generation."""
    return sum(
        1
        for kind in KINDS
        for obj in store.list(kind)
        if obj.status.observed_generation == (obj.metadata.generation or 0)
    )


def world(tmp_path: Path, *, resync_s: float | None = None) -> tuple[SQLiteStore, manager.Manager]:
    clock = Clock()
    store = SQLiteStore(tmp_path / "state.db", clock=clock)
    models = tmp_path / "models"
    models.mkdir()
    mgr = manager.Manager(
        store=store,
        reconcilers=[
            ModelReconciler(store=store, models_dir=models, clock=clock),
            LaneReconciler(store=store, processes=FakeProcesses(clock), clock=clock),
            PolicyReconciler(kind=Kind.SLO_POLICY, store=store, clock=clock),
            PolicyReconciler(kind=Kind.SPEC_PAIR, store=store, clock=clock),
        ],
        resync_s=resync_s,
    )
    return store, mgr


def apply(store: SQLiteStore, text: str) -> None:
    docs = manifests.parse_documents(text, source="test")
    store.apply_all(
        manifests.validate_objects(docs, exists=lambda k, n: store.get(k, n) is not None)
    )


def test_two_hundred_objects_settle_within_5_s_and_one_change_reconciles_one(
    tmp_path: Path,
) -> None:
    store, mgr = world(tmp_path)

    async def run() -> tuple[float, dict[Kind, int]]:
        await mgr.start()
        try:
            began = time.monotonic()
            apply(store, fleet(tmp_path / "models"))
            await until(lambda: settled(store) == 4 * EACH, timeout=5.0)
            took = time.monotonic() - began
            await until(lambda: len(mgr.queue) == 0)
            await asyncio.sleep(0.2)  # let anything that would follow come
            before = mgr.reconciled.copy()
            # A policy no Lane names but l7: itself and that Lane, nothing else.
            apply(store, fleet(tmp_path / "models").replace("{priority: 7}", "{priority: 70}"))
            await until(lambda: settled(store) == 4 * EACH)
            await asyncio.sleep(0.2)
            after = mgr.reconciled - before
            return took, {key: n for key, n in after.items()}
        finally:
            await mgr.stop()

    took, changed = asyncio.run(run())
    print(f"200 objects settled in {took:.2f} s")
    assert took < 5.0
    assert changed == {(Kind.SLO_POLICY, "p7"): 1, (Kind.LANE, "l7"): 1}


def test_a_periodic_resync_reconciles_every_object_again(tmp_path: Path) -> None:
    store, mgr = world(tmp_path, resync_s=0.5)
    apply(store, fleet(tmp_path / "models"))

    async def run() -> int:
        await mgr.start()
        try:
            await until(lambda: settled(store) == 4 * EACH)
            await until(lambda: all(mgr.reconciled[k] >= 2 for k in keys(store)), timeout=5.0)
            return len(keys(store))
        finally:
            await mgr.stop()

    assert asyncio.run(run()) == 4 * EACH


def keys(store: SQLiteStore) -> list[tuple[Kind, str]]:
    return [(kind, obj.metadata.name) for kind in KINDS for obj in store.list(kind)]


def test_a_resync_the_store_cannot_read_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, mgr = world(tmp_path, resync_s=0.3)
    apply(store, fleet(tmp_path / "models"))
    real_list = store.list
    failed: list[str] = []

    def list_failing_once(kind: Kind | None = None) -> list[Resource]:
        if kind is None and not failed:  # the resync's read of every object
            failed.append("resync")
            raise errors.Unavailable("cannot read the store: disk I/O error")
        return real_list(kind)

    async def run() -> None:
        await mgr.start()
        try:
            await until(lambda: settled(store) == 4 * EACH)
            monkeypatch.setattr(store, "list", list_failing_once)
            await until(lambda: bool(failed), timeout=5.0)
            after_failure = mgr.reconciled.copy()
            await until(
                lambda: all(mgr.reconciled[k] > after_failure[k] for k in keys(store)),
                timeout=5.0,
            )
        finally:
            await mgr.stop()

    asyncio.run(run())
