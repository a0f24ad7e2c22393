"""Effects on model files: resolve a Model's source to a path, hash it, read its header.

Hashing a multi-hundred-megabyte file is slow, so digests are cached by
(path, size, mtime); callers run these functions in a worker thread.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blazar.api.kinds import ModelSource

_DIGESTS: dict[tuple[str, int, int], str] = {}


class SourceError(Exception):
    """The source cannot be resolved; `reason` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def resolve(source: ModelSource, *, models_dir: Path) -> Path:
    """The local GGUF path for source, assembling a packaged model into models_dir."""
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not path.is_file():
            raise SourceError("FileNotFound", f"No file at {path}.")
        return path.resolve()
    if source.package is not None:
        return _from_package(source.package, models_dir=models_dir)
    raise SourceError("SourceUnsupported", "Only `path` and `package` sources are supported yet.")


def _from_package(distribution: str, *, models_dir: Path) -> Path:
    module_name = distribution.replace("-", "_").replace(".", "_")
    try:
        module: Any = importlib.import_module(module_name)
    except ImportError:
        raise SourceError(
            "PackageNotInstalled",
            f"Python package '{distribution}' is not installed (pip install {distribution}).",
        ) from None
    if hasattr(module, "assemble"):
        # Chunked weight packages reassemble the file once. Their assemble() re-hashes an
        # existing file on every call, so an assembled file is checked here instead,
        # against the package's own digest, with the (path, size, mtime) cache.
        filename = getattr(module, "MODEL_NAME", f"{module_name}.gguf")
        target = models_dir / distribution / filename
        expected = getattr(module, "EXPECTED_SHA256", None)
        if target.is_file() and (expected is None or sha256(target) == expected):
            return target.resolve()
        return Path(module.assemble(target, overwrite=target.exists())).resolve()
    package_dir = Path(module.__file__).parent if module.__file__ else None
    found = sorted(package_dir.rglob("*.gguf")) if package_dir else []
    if len(found) != 1:
        raise SourceError(
            "PackageHasNoModel",
            f"Package '{distribution}' has {len(found)} .gguf files and no assemble(); "
            "expected exactly one.",
        )
    return found[0].resolve()


def sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(4 << 20):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    context_length: int | None
    parameters: dict[str, str] = field(default_factory=dict)


_KEPT_SUFFIXES = (
    "block_count",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.sliding_window",
)


def read_gguf(path: Path) -> GGUFInfo:
    """Architecture, trained context and the figures the fit ledger needs."""
    from gguf import GGUFReader  # heavy import, only where needed

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf package raises bare ValueErrors and friends
        raise SourceError("InvalidGGUF", f"{path} is not a readable GGUF file: {exc}.") from exc

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = str(value("general.architecture") or "unknown")
    params: dict[str, str] = {}
    for suffix in _KEPT_SUFFIXES:
        v = value(f"{arch}.{suffix}")
        if v is not None:
            params[suffix] = str(v)
    for key in ("general.name", "general.size_label", "general.file_type"):
        v = value(key)
        if v is not None:
            params[key.removeprefix("general.")] = str(v)
    params["has_chat_template"] = str(value("tokenizer.chat_template") is not None).lower()
    ctx = value(f"{arch}.context_length")
    return GGUFInfo(architecture=arch, context_length=int(ctx) if ctx else None, parameters=params)
