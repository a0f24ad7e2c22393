"""The manifest directories users are pointed at stay valid: each is applied, as
`blazar serve --watch DIR` applies it, to a store, and holds what its README says."""

from __future__ import annotations

from pathlib import Path

import pytest

from blazar.api import manifests
from blazar.gitops import watcher
from blazar.store.memory import MemoryStore

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "examples" / "fleet"


@pytest.mark.parametrize(
    ("directory", "expected"),
    [
        (
            REPO / "manifests",
            {
                ("Model", "gemma3-270m"),
                ("Lane", "gemma3"),
                ("SLOPolicy", "interactive"),
                ("SLOPolicy", "batch"),
                ("SpecPair", "ngram"),
            },
        ),
        (
            FLEET,
            {
                ("Model", "gemma3-270m"),
                ("Lane", "chat"),
                ("Lane", "batch"),
                ("SLOPolicy", "interactive"),
                ("SLOPolicy", "batch"),
                ("SpecPair", "ngram-lookup"),
            },
        ),
    ],
    ids=["manifests", "examples-fleet"],
)
def test_a_fleet_directory_applies_whole(directory: Path, expected: set[tuple[str, str]]) -> None:
    store = MemoryStore()
    assert watcher.sync(store, directory), [e.message for e in store.events()]
    assert {(o.kind, o.metadata.name) for o in store.list()} == expected
    assert store.events() == []


def test_the_default_fleet_keeps_slots_free_for_interactive_work() -> None:
    """manifests/: batch work may hold 4 of the default Lane's 6 slots (n-gram drafting
    stays on at that batch), and interactive requests have the other two."""
    store = MemoryStore()
    assert watcher.sync(store, REPO / "manifests")
    spec = {
        name: manifests.to_dict(obj)["spec"]
        for kind, name in [("Lane", "gemma3"), ("SLOPolicy", "batch"), ("SpecPair", "ngram")]
        if (obj := store.get(kind, name)) is not None
    }
    cap = spec["batch"]["maxSlotsPerReplica"]
    assert (spec["gemma3"]["slots"], cap) == (6, 4)
    assert cap <= spec["ngram"]["disableAboveBatch"]
    interactive = store.get("SLOPolicy", "interactive")
    assert interactive is not None
    assert "maxSlotsPerReplica" not in manifests.to_dict(interactive)["spec"]


def test_the_example_fleet_lanes_differ_and_use_every_policy_and_the_specpair() -> None:
    store = MemoryStore()
    assert watcher.sync(store, FLEET)
    lanes = {name: store.get("Lane", name) for name in ("chat", "batch")}
    chat, batch = (manifests.to_dict(lane) for lane in lanes.values() if lane is not None)
    assert chat["spec"]["model"] == batch["spec"]["model"] == "gemma3-270m"
    settings = ("slots", "contextPerSlot", "sloPolicy", "kvCache")
    assert all(chat["spec"].get(s) != batch["spec"].get(s) for s in settings)
    assert {chat["spec"]["sloPolicy"], batch["spec"]["sloPolicy"]} == {"interactive", "batch"}
    assert chat["spec"]["speculation"] == "ngram-lookup"


def test_the_example_fleet_readme_names_every_file_and_the_command() -> None:
    readme = (FLEET / "README.md").read_text()
    assert "blazar serve --watch examples/fleet" in readme
    files = sorted(p.name for p in FLEET.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    assert files, "the fleet has manifests"
    missing = [name for name in files if f"`{name}`" not in readme]
    assert not missing, f"examples/fleet/README.md does not describe {missing}"
