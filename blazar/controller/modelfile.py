"""Effects on model files: resolve a Model's source to a path, hash it, read its header.

Hashing a multi-hundred-megabyte file is slow, so digests are remembered across
restarts and packaged models assembled once per machine (`modelcache`); callers run
these functions in a worker thread. The header is read by a parser of GGUF's
key-value metadata here rather than by the `gguf` package, whose reader decodes every
array (the tokenizer's hundreds of thousands of strings) and took 17-22 s on the
bundled model where this takes 0.07 s.
"""

from __future__ import annotations

import errno
import importlib.metadata
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blazar.api.kinds import ModelSource
from blazar.controller import fit, modelcache
from blazar.controller.sources import ModelSources, SourceError

# Every GGUF file begins with these four bytes.
GGUF_MAGIC = b"GGUF"


def resolve(
    source: ModelSource,
    *,
    models_dir: Path,
    cache: modelcache.ModelCache,
    sources: ModelSources,
) -> Path:
    """The local GGUF path for source; a packaged model is assembled into the machine's
    cache once and linked into models_dir (assembled there directly without a cache).
    A file is checked to be a GGUF file before anything else reads it (`check_magic`)."""
    if source.path is not None:
        path = sources.path(source.path)
        if not path.is_file():
            raise SourceError("FileNotFound", missing(source.path, path))
        check_magic(path)
        return path
    if source.package is not None:
        module = sources.package(source.package)
        return _from_package(source.package, module, models_dir=models_dir, cache=cache)
    raise SourceError("SourceUnsupported", "Only `path` and `package` sources are supported yet.")


def missing(given: str, real: Path) -> str:
    """Why no file is at `given` (`real` with its links followed): every case read "No
    file at ...", a directory (a model's download folder) and a link whose target is
    gone too, which looked like a wrong path to a user who could see it there."""
    if real.is_dir():
        return f"{given} is a directory, not a GGUF file: name the .gguf file in it."
    try:
        os.stat(given)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{given} is a loop of symbolic links: none of them leads to a file."
    if real.exists():
        return f"{given} is not a regular file (a FIFO, socket or device): name a .gguf file."
    if os.path.islink(given):
        return f"{given} is a symbolic link to {real}, where there is no file."
    return f"No file at {given}."


def check_magic(path: Path) -> None:
    """SourceError unless the file begins as a GGUF file does: nothing else is read (and
    no digest computed, which would tell the digest of any file) before this holds."""
    try:
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise SourceError("FileUnreadable", f"{path} cannot be read: {exc.strerror}.") from None
    if head != GGUF_MAGIC:
        raise SourceError("NotGGUF", f"{path} is not a GGUF file (it does not begin with 'GGUF').")


def _from_package(
    distribution: str, module: Any, *, models_dir: Path, cache: modelcache.ModelCache
) -> Path:
    module_name = getattr(module, "__name__", distribution.replace("-", "_"))
    if hasattr(module, "assemble"):
        # Chunked weight packages reassemble the file. Their assemble() re-hashes an
        # existing file on every call, so it is only ever asked for a new one; the files
        # are checked here instead, against the package's own digest, with the memo.
        filename = getattr(module, "MODEL_NAME", f"{module_name}.gguf")
        target = models_dir / distribution / filename

        def assemble(path: Path) -> None:
            module.assemble(path, overwrite=True)

        try:
            cache.provide(
                target,
                name=distribution,
                version=_version(distribution),
                expected=getattr(module, "EXPECTED_SHA256", None),
                assemble=assemble,
            )
        except modelcache.ChecksumMismatch as err:
            raise SourceError(
                "ChecksumMismatch",
                f"Package '{distribution}' assembled a file with sha256 {err.digest}, "
                f"but declares {err.expected}.",
            ) from None
        check_magic(target)
        return target.resolve()
    package_dir = Path(module.__file__).parent if getattr(module, "__file__", None) else None
    found = sorted(package_dir.rglob("*.gguf")) if package_dir else []
    if len(found) != 1:
        raise SourceError(
            "PackageHasNoModel",
            f"Package '{distribution}' has {len(found)} .gguf files and no assemble(); "
            "expected exactly one.",
        )
    check_magic(found[0])
    return found[0].resolve()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    """Architecture, trained context and the figures the fit ledger needs
    (`blazar.controller.fit.ModelShape` reads them back)."""
    try:
        values, index = read_gguf_layout(path)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise SourceError("InvalidGGUF", f"{path} is not a readable GGUF file: {exc}.") from exc

    arch = values.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else "unknown"
    params: dict[str, str] = {}
    for suffix in _KEPT_SUFFIXES:
        v = values.get(f"{arch}.{suffix}")
        if v is not None and not isinstance(v, SkippedString):
            params[suffix] = str(v)
    for key in ("general.name", "general.size_label", "general.file_type"):
        v = values.get(key)
        if v is not None and not isinstance(v, SkippedString):
            params[key.removeprefix("general.")] = str(v)
    params["has_chat_template"] = str("tokenizer.chat_template" in values).lower()
    params["tensor_bytes"] = str(index.data_bytes)
    params["repacked_bytes"] = str(fit.repacked_bytes(index.tensors))
    tokens = values.get("tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray | list):
        params["vocab_size"] = str(
            tokens.count if isinstance(tokens, SkippedArray) else len(tokens)
        )
    if not index.tensors:
        # llama.cpp's ggml-vocab-*.gguf are such files (a tokenizer's tests read them):
        # every engine start failed on "tensor 'token_embd.weight' not found".
        raise SourceError(
            "InvalidGGUF",
            f"{path} holds no tensors: it is a vocabulary-only GGUF, with no weights to "
            "serve; name the model's GGUF file.",
        )
    try:
        ctx = _count(values, f"{arch}.context_length", low=0)
        _count(values, f"{arch}.block_count", low=1, high=LAYERS_MAX)
    except ValueError as exc:
        raise SourceError("InvalidGGUF", f"{path} is not a loadable GGUF file: {exc}.") from None
    return GGUFInfo(architecture=arch, context_length=ctx or None, parameters=params)


# The layers llama.cpp loads at most (`LLAMA_MAX_LAYERS`): it aborts on a model of more,
# or of none, rather than refuse it.
LAYERS_MAX = 512
_U32_MAX = 2**32 - 1


def _count(values: dict[str, Any], key: str, *, low: int, high: int = _U32_MAX) -> int | None:
    """The figure at `key`, a whole number from `low` to `high` (None when absent).

    llama.cpp reads these figures as 32-bit unsigned integers and refuses the file at
    every engine start when one is anything else (a string, a float: "key
    gemma3.context_length has wrong type f32 but expected type u32"), or aborts the
    engine (a `block_count` of 0); said here, it is the Model's reason, not a Lane's
    crash loop, and never an exception that left the Model unresolved for good."""
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kinds = {str: "a string", SkippedString: "a string", float: "a float", bool: "a boolean"}
        kind = kinds.get(type(value), "an array")  # else a list or a SkippedArray
        raise ValueError(
            f"{key} is {kind} ({repr(value)[:80]}) where llama.cpp reads an unsigned integer"
        )
    if not low <= value <= high:
        raise ValueError(f"{key} is {value}, where llama.cpp takes {low} to {high}")
    return value


# GGUF metadata value types (ggml's gguf.h): fixed-size scalars by struct format.
_GGUF_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_GGUF_STRING = 8
_GGUF_ARRAY = 9
# Arrays longer than this (a tokenizer's 262,144 tokens, scores, merges) are stepped
# over, not decoded: nothing here needs them, and decoding them is what made the
# `gguf` package's reader take 17-22 s on the bundled model.
ARRAY_DECODE_MAX = 4096
# Array items decoded in one header at most; arrays past it are stepped over too. A
# header of 10,000 arrays of 4,096 integers (156 MB) took 23 s and 1.7 GB of the
# daemon's memory to decode; a real model's short arrays hold a few hundred items.
DECODED_ITEMS_MAX = 65536
# String values longer than this, or past this many bytes of strings decoded in one
# header, are stepped over: a 300 MB chat template held 0.9 GB of the daemon (the mapped
# pages, their bytes and the str) to tell that the model has one. A real template is
# tens of KB.
STRING_DECODE_MAX = 1 << 20
DECODED_BYTES_MAX = 16 << 20
# The longest key or tensor name taken: GGUF's limit for keys (llama.cpp's for tensor
# names is 63 bytes, and it refuses the file).
NAME_MAX = 65535


@dataclass(frozen=True)
class SkippedString:
    """A metadata string too long to decode (`STRING_DECODE_MAX`): its length in bytes."""

    length: int


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array too long to decode (`ARRAY_DECODE_MAX`): its item type and length."""

    item_type: int
    count: int


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (`read_gguf_layout` without the tensors)."""
    return read_gguf_layout(path)[0]


@dataclass(frozen=True)
class TensorIndex:
    """Where a GGUF's tensors are: the bytes of its data section (what llama.cpp maps as
    the model's weights), and each tensor's ggml type and bytes (up to the next one)."""

    data_bytes: int
    tensors: dict[str, tuple[int, int]] = field(default_factory=dict)


def read_gguf_layout(path: Path) -> tuple[dict[str, Any], TensorIndex]:
    """The key-value metadata of a GGUF file (versions 2 and 3, either byte order), and
    its tensor index.

    Strings come as str, numbers as int or float, booleans as bool, arrays as lists,
    arrays longer than `ARRAY_DECODE_MAX` (or past `DECODED_ITEMS_MAX` in all) as
    `SkippedArray`, strings longer than `STRING_DECODE_MAX` (or past `DECODED_BYTES_MAX`)
    as `SkippedString`. Only the header is
    read (through mmap, so a few MB of a file of any size): the header and the tensor
    index after it, not the tensors. Raises ValueError
    (UnicodeDecodeError for a string that is not UTF-8) on a file that is not GGUF or
    ends inside its header or tensor index.
    """
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
        try:
            return _layout(buf)
        except struct.error:
            raise ValueError("its header runs past the end of the file") from None


# ggml tensor types by number (ggml.h's `ggml_type`): (elements per block, bytes per
# block), to tell how far a tensor's data reaches. A type not listed is not checked.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip

# Where tensor data begins is aligned to this many bytes unless `general.alignment` says.
_DEFAULT_ALIGNMENT = 32


def _layout(buf: mmap.mmap) -> tuple[dict[str, Any], TensorIndex]:
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian host
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
    (tensors,) = struct.unpack_from(order + "Q", buf, 8)
    reader = _MetadataReader(buf, order, offset=16)  # past the tensor count
    values: dict[str, Any] = {}
    for _ in range(reader.scalar("Q")):
        key = reader.name()
        try:
            values[key] = reader.value(reader.scalar("I"))
        except ValueError as exc:  # struct.error (cut short) is not one: said as such
            raise ValueError(f"{key[:80]}: {exc}") from None
    placed: list[tuple[int, str, int]] = []  # (offset, name, type)
    needed = 0  # how far into the data section the tensors of known types reach
    for _ in range(tensors):
        name = reader.name()
        elements = math.prod(reader.scalar("Q") for _ in range(reader.scalar("I")))
        ggml_type = reader.scalar("I")
        offset = reader.scalar("Q")
        placed.append((offset, name, ggml_type))
        if ggml_type in GGML_BLOCKS:
            block, block_bytes = GGML_BLOCKS[ggml_type]
            needed = max(needed, offset + -(-elements // block) * block_bytes)
    alignment = values.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
    start = -(-reader.offset // alignment) * alignment
    if start > len(buf):
        raise struct.error("the tensor index runs past the end of the file")
    data_bytes = len(buf) - start
    if needed > data_bytes:
        # Cut short (an interrupted copy or download): llama.cpp refuses it at every
        # engine start, so it is refused here, before a Lane crash-loops on it.
        raise ValueError(
            f"its tensor data runs past the end of the file (the tensors need "
            f"{needed} bytes, the file holds {data_bytes}): it is cut short"
        )
    # A tensor runs to where the next begins (its alignment padding included).
    placed.sort()
    ends = [offset for offset, _, _ in placed[1:]] + [data_bytes] * bool(placed)
    sizes = {
        name: (t, max(0, end - offset)) for (offset, name, t), end in zip(placed, ends, strict=True)
    }
    return values, TensorIndex(data_bytes, sizes)


class _MetadataReader:
    """A cursor over a GGUF header: each call reads one item and moves past it."""

    def __init__(self, buf: mmap.mmap, order: str, *, offset: int) -> None:
        self._buf = buf
        self._order = order
        self._offset = offset
        # Array items and string bytes decoded so far (`DECODED_ITEMS_MAX`,
        # `DECODED_BYTES_MAX`).
        self._decoded = 0
        self._decoded_bytes = 0

    @property
    def offset(self) -> int:
        return self._offset

    def skip(self, count: int) -> None:
        self._offset += count
        if self._offset > len(self._buf):
            raise struct.error("an item runs past the end of the file")

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(self._order + fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return v

    def name(self) -> str:
        """A key or a tensor's name (GGUF keys are at most 65,535 bytes)."""
        length = self.scalar("Q")
        if length > NAME_MAX:
            raise ValueError(f"a key or tensor name is {length} bytes long (GGUF allows 65535)")
        return self._text(length)

    def string(self) -> str | SkippedString:
        """A string value; one too long to decode (`STRING_DECODE_MAX`, `DECODED_BYTES_MAX`)
        is stepped over."""
        length = self.scalar("Q")
        if length > STRING_DECODE_MAX or self._decoded_bytes + length > DECODED_BYTES_MAX:
            self.skip(length)
            return SkippedString(length)
        self._decoded_bytes += length
        return self._text(length)

    def _text(self, length: int) -> str:
        end = self._offset + length
        if end > len(self._buf):
            raise struct.error("a string runs past the end of the file")
        text = self._buf[self._offset : end].decode("utf-8")
        self._offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item = self.scalar("I")
        count = self.scalar("Q")
        if item == _GGUF_ARRAY:
            # llama.cpp refuses such a file ("key 'x' has invalid GGUF type 9"), and
            # nested deep enough it made this reader recurse until Python gave up.
            raise ValueError("it is an array of arrays, which GGUF readers do not load")
        if item not in _GGUF_SCALARS and item != _GGUF_STRING:
            raise ValueError(f"unknown GGUF value type {item}")
        if count <= ARRAY_DECODE_MAX and self._decoded + count <= DECODED_ITEMS_MAX:
            self._decoded += count
            return [self.value(item) for _ in range(count)]
        self._skip(item, count)
        return SkippedArray(item_type=item, count=count)

    def _skip(self, item: int, count: int) -> None:
        if item in _GGUF_SCALARS:
            self._offset += count * struct.calcsize(_GGUF_SCALARS[item])
            if self._offset > len(self._buf):
                raise struct.error("an array runs past the end of the file")
            return
        buf, offset, length = self._buf, self._offset, struct.Struct(self._order + "Q")
        for _ in range(count):
            offset += 8 + length.unpack_from(buf, offset)[0]
        if offset > len(buf):
            raise struct.error("an array runs past the end of the file")
        self._offset = offset
