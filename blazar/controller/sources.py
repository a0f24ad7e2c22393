"""Where a Model may come from on this host: files under the model roots, packages
registered as models.

A Model is applied by whoever may call Control, but it is read by the daemon, as the
daemon's user. Without bounds, `source.path` could name any file that user can read (a
wrong sha256 printed the real digest of /etc/passwd), and `source.package` imported any
top-level module and called its `assemble()` (`package: this` printed the Zen of Python
into the daemon's log; a `.py` file on the daemon's path ran as the daemon). So:

- `path` must resolve, all links followed, to a place under one of the model roots
  (`serve --model-root`, `BLAZAR_MODEL_ROOTS`; `$BLAZAR_HOME/models` always): a link
  inside a root that points out of it is refused like the path it points to.
- `package` must be registered under the `blazar.models` entry-point group by an
  installed distribution (Blazar registers the bundled model); only that entry point
  is loaded, nothing is imported by name.

`problems` runs when manifests are applied (the store's admission), so a refusal names
the field; `path` and `package` run again at reconcile, since roots and installed
packages can change after an object was stored. Both read the filesystem and package
metadata: call them off the event loop for anything large.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blazar.api.errors import FieldError
from blazar.api.kinds import Model, Resource

PACKAGE_GROUP = "blazar.models"
ROOTS_ENV = "BLAZAR_MODEL_ROOTS"


class SourceError(Exception):
    """The source cannot be used; `reason` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def registered() -> Sequence[importlib.metadata.EntryPoint]:
    """The model packages installed distributions register."""
    return tuple(importlib.metadata.entry_points(group=PACKAGE_GROUP))


def _canonical(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ModelSources:
    """The host's model roots, resolved."""

    roots: tuple[Path, ...]

    @classmethod
    def of(cls, roots: Sequence[Path]) -> ModelSources:
        resolved = dict.fromkeys(Path(os.path.realpath(r.expanduser())) for r in roots)
        return cls(tuple(resolved))

    def path(self, given: str) -> Path:
        """The file `given` names, all links followed, if it lies under a root."""
        real = Path(os.path.realpath(Path(given).expanduser()))
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            shown = ", ".join(str(r) for r in self.roots)
            if not Path(given).expanduser().is_absolute():
                # `path: m.gguf` beside the root's other files read "m.gguf is not under
                # a model root (/home/.../models)", which it seemed to be.
                raise SourceError(
                    "OutsideModelRoots",
                    f"{given} is a relative path, read from the daemon's working "
                    f"directory as {real}, which is not under a model root ({shown}); "
                    "give the file's absolute path.",
                )
            inside = Path(os.path.abspath(Path(given).expanduser()))
            if any(inside == root or inside.is_relative_to(root) for root in self.roots):
                # A link in a root to a file outside: "m.gguf is not under a model
                # root (.../models)" named the link, which is.
                raise SourceError(
                    "OutsideModelRoots",
                    f"{given} is a link to {real}, which is not under a model root "
                    f"({shown}); links are followed, so start the daemon with "
                    f"--model-root for the directory that holds {real}.",
                )
            raise SourceError(
                "OutsideModelRoots",
                f"{given} is not under a model root ({shown}); start the daemon with "
                f"--model-root for the directory that holds it.",
            )
        return real

    def package(self, name: str) -> Any:
        """What the `blazar.models` entry point named `name` loads (a module with
        `assemble`, or a package directory holding one .gguf)."""
        wanted = _canonical(name)
        found = [ep for ep in registered() if _canonical(ep.name) == wanted]
        if not found:
            known = sorted({ep.name for ep in registered()})
            raise SourceError(
                "PackageNotRegistered",
                f"No installed package registers a model named '{name}' (entry-point group "
                f"'{PACKAGE_GROUP}'); registered: {', '.join(known) or 'none'}.",
            )
        try:
            return found[0].load()
        except ImportError:
            raise SourceError(
                "PackageNotInstalled",
                f"The model package '{name}' is registered but cannot be imported "
                f"(pip install {name}).",
            ) from None

    def problems(self, objects: Sequence[Resource]) -> list[FieldError]:
        """Each Model's source this host refuses, by field path (the store's admission)."""
        out: list[FieldError] = []
        for obj in objects:
            if not isinstance(obj, Model):
                continue
            where = f"Model/{obj.metadata.name}: spec.source"
            source = obj.spec.source
            try:
                if source.path is not None:
                    self.path(source.path)
                elif source.package is not None:
                    self._registered(source.package)
            except SourceError as err:
                field = "path" if source.path is not None else "package"
                out.append(FieldError(f"{where}.{field}", err.message))
        return out

    def _registered(self, name: str) -> None:
        wanted = _canonical(name)
        if not any(_canonical(ep.name) == wanted for ep in registered()):
            self.package(name)  # raises with the list of registered names


def roots_from_environment(home: Path, given: Sequence[Path] = ()) -> ModelSources:
    """`$BLAZAR_HOME/models`, the `--model-root` directories and those in
    BLAZAR_MODEL_ROOTS (separated as PATH is)."""
    env = [Path(p) for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p]
    return ModelSources.of([home / "models", *given, *env])
