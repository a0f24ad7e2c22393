"""What `blazar diff` shows: the part of an object its user writes (apiVersion, kind,
name, labels, annotations, spec), stored versus as `apply` would leave it, as a
unified diff of YAML. Pure: the command fetches both sides."""

from __future__ import annotations

import difflib
from typing import Any

import yaml

ObjectJson = dict[str, Any]


def user_part(obj: ObjectJson | None) -> ObjectJson | None:
    """What a manifest writes of `obj`: no status, no server-set metadata."""
    if obj is None:
        return None
    meta = obj.get("metadata", {})
    written = {"name": meta.get("name")}
    for key in ("labels", "annotations"):
        if meta.get(key):
            written[key] = meta[key]
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": written,
        "spec": obj.get("spec", {}),
    }


def _lines(obj: ObjectJson | None) -> list[str]:
    if obj is None:
        return []
    return yaml.safe_dump(obj, sort_keys=True).splitlines(keepends=True)


def unified(live: ObjectJson | None, applied: ObjectJson | None, *, label: str) -> str:
    """The diff from `live` (None: not stored) to `applied` (None: deleted) of what
    users write; "" when that part does not change. `label` names the object
    (`lane/gemma3`)."""
    return "".join(
        difflib.unified_diff(
            _lines(user_part(live)),
            _lines(user_part(applied)),
            fromfile=f"live/{label}",
            tofile=f"applied/{label}",
        )
    )
