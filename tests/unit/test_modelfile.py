"""The GGUF metadata reader, against files written by the `gguf` package's own writer
and read back by its reader (the reference), and against broken files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from blazar.api.kinds import ModelSource
from blazar.controller import modelcache, modelfile
from blazar.controller.sources import ModelSources

LONG = modelfile.ARRAY_DECODE_MAX + 1

# (key, value, type): one of each value type GGUF has, arrays short and long.
VALUES: list[tuple[str, Any, gguf.GGUFValueType]] = [
    ("t.uint8", 200, gguf.GGUFValueType.UINT8),
    ("t.int8", -100, gguf.GGUFValueType.INT8),
    ("t.uint16", 60000, gguf.GGUFValueType.UINT16),
    ("t.int16", -30000, gguf.GGUFValueType.INT16),
    ("t.uint32", 4_000_000_000, gguf.GGUFValueType.UINT32),
    ("t.int32", -2_000_000_000, gguf.GGUFValueType.INT32),
    ("t.float32", 0.1, gguf.GGUFValueType.FLOAT32),
    ("t.bool", True, gguf.GGUFValueType.BOOL),
    ("t.string", "héllo <start_of_turn>", gguf.GGUFValueType.STRING),
    ("t.empty_string", "", gguf.GGUFValueType.STRING),
    ("t.uint64", 2**63 + 5, gguf.GGUFValueType.UINT64),
    ("t.int64", -(2**62), gguf.GGUFValueType.INT64),
    ("t.float64", 1e-300, gguf.GGUFValueType.FLOAT64),
    ("t.ints", [1, 2, 3], gguf.GGUFValueType.ARRAY),
    ("t.strings", ["a", "bc", ""], gguf.GGUFValueType.ARRAY),
    ("t.empty_array", [], gguf.GGUFValueType.ARRAY),
    ("t.long_strings", [f"tok{i}" for i in range(LONG)], gguf.GGUFValueType.ARRAY),
    ("t.long_floats", [float(i) for i in range(LONG)], gguf.GGUFValueType.ARRAY),
]


def write(path: Path, *, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for key, value, vtype in VALUES:
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_tensor("weights", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_metadata_is_what_the_gguf_package_reads(tmp_path: Path, endian: gguf.GGUFEndian) -> None:
    path = write(tmp_path / "m.gguf", endian=endian)
    reference = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
    ours = modelfile.read_gguf_metadata(path)
    # The reader's own bookkeeping fields (GGUF.version and friends) are not metadata.
    assert set(ours) == {k for k in reference if not k.startswith("GGUF.")}
    for key, value in ours.items():
        if isinstance(value, modelfile.SkippedArray):
            assert value.count == len(reference[key]) == LONG, key
        else:
            assert value == reference[key], key
            assert type(value) is type(reference[key]), key
    assert ours["general.architecture"] == "llama"


def test_long_arrays_are_stepped_over_short_ones_decoded(tmp_path: Path) -> None:
    values = modelfile.read_gguf_metadata(write(tmp_path / "m.gguf"))
    assert values["t.strings"] == ["a", "bc", ""]
    assert values["t.long_strings"] == modelfile.SkippedArray(
        item_type=gguf.GGUFValueType.STRING, count=LONG
    )
    assert values["t.long_floats"] == modelfile.SkippedArray(
        item_type=gguf.GGUFValueType.FLOAT32, count=LONG
    )
    assert values["t.string"] == "héllo <start_of_turn>"  # after the long arrays: in step


def header(version: int) -> bytes:
    return b"GGUF" + version.to_bytes(4, "little") + (0).to_bytes(8, "little") * 2


def cut(at: int) -> Any:
    return lambda good: good[:at]


BROKEN: list[tuple[str, Any, str]] = [
    ("empty", lambda good: b"", "cannot mmap an empty file"),
    ("not GGUF", lambda good: b"GGML" + good[4:], "no GGUF magic"),
    ("version 1", lambda good: header(1), "GGUF version 1 is not supported"),
    ("in the version", cut(6), "its header runs past the end of the file"),
    ("in the counts", cut(20), "its header runs past the end of the file"),
    ("in a key", cut(30), "its header runs past the end of the file"),
    ("in a long array", lambda good: good[: good.index(b"tok4000")], "its header runs past the end of the file"),
    ("unknown type", lambda good: good[:24] + b"\x01\0\0\0\0\0\0\0k\x63\0\0\0", "unknown GGUF value type 99"),
    ("in the tensor index", lambda good: good[: good.index(b"weights") + 4], "its header runs past the end of the file"),
    # Cut inside the tensor data (an interrupted copy): llama.cpp cannot load it.
    ("in the tensor data", lambda good: good[:-1], "its tensor data runs past the end of the file"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "damage", "says"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_file_is_invalid_gguf(tmp_path: Path, name: str, damage: Any, says: str) -> None:
    good = write(tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(good))
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(path)
    assert err.value.reason == "InvalidGGUF"
    assert err.value.message.startswith(f"{path} is not a readable GGUF file: ")
    assert says in err.value.message


def test_read_gguf_keeps_the_fit_ledger_figures(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    writer.add_context_length(32768)
    writer.add_block_count(18)
    writer.add_head_count_kv(1)
    writer.add_sliding_window(512)
    writer.add_name("Tiny")
    writer.add_file_type(15)
    writer.add_chat_template("{{ messages }}")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(LONG)])
    writer.add_tensor("w", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = modelfile.read_gguf(tmp_path / "m.gguf")
    assert info == modelfile.GGUFInfo(
        architecture="gemma3",
        context_length=32768,
        parameters={
            "block_count": "18",
            "attention.head_count_kv": "1",
            "attention.sliding_window": "512",
            "name": "Tiny",
            "file_type": "15",
            "has_chat_template": "true",
            "tensor_bytes": "128",
            "repacked_bytes": "0",  # an F32 tensor: nothing repacked
            "vocab_size": str(LONG),
        },
    )


@pytest.mark.parametrize("alignment", [None, 64, 4096])
@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_tensor_bytes_are_the_data_the_gguf_package_finds(
    tmp_path: Path, alignment: int | None, endian: gguf.GGUFEndian
) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_tensor("a", np.ones((3, 5), dtype=np.float32))
    writer.add_tensor("b", np.ones((7,), dtype=np.float16))
    writer.add_tensor("c", np.ones((2, 2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = gguf.GGUFReader(path)
    _, index = modelfile.read_gguf_layout(path)
    assert index.data_bytes == path.stat().st_size - reference.data_offset
    # Each tensor runs to the next: its bytes and the padding after them.
    assert set(index.tensors) == {"a", "b", "c"}
    for t in reference.tensors:
        ggml_type, size = index.tensors[t.name]
        assert ggml_type == t.tensor_type
        assert int(t.n_bytes) <= size < int(t.n_bytes) + (alignment or 32)
    assert sum(size for _, size in index.tensors.values()) == index.data_bytes


def test_the_block_sizes_are_ggmls() -> None:
    # Those of the types the gguf package knows; it may know newer ones, not checked.
    known = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert {t: known[t] for t in modelfile.GGML_BLOCKS} == modelfile.GGML_BLOCKS


def header_only(path: Path, *kvs: tuple[str, Any, gguf.GGUFValueType]) -> Path:
    """A GGUF of architecture `llama` with `kvs` and one small tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value, vtype in kvs:
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_tensor("w", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64
LIES: list[tuple[str, Any, gguf.GGUFValueType, str]] = [
    ("llama.context_length", "lots", gguf.GGUFValueType.STRING,
     "llama.context_length is a string ('lots') where llama.cpp reads an unsigned integer"),
    ("llama.context_length", 32768.0, gguf.GGUFValueType.FLOAT32,
     "llama.context_length is a float (32768.0) where llama.cpp reads an unsigned integer"),
    ("llama.context_length", float("nan"), gguf.GGUFValueType.FLOAT32, "is a float (nan)"),
    ("llama.context_length", [1, 2], gguf.GGUFValueType.ARRAY, "is an array ([1, 2])"),
    ("llama.context_length", True, gguf.GGUFValueType.BOOL, "is a boolean (True)"),
    ("llama.context_length", -5, gguf.GGUFValueType.INT32,
     "llama.context_length is -5, where llama.cpp takes 0 to 4294967295"),
    ("llama.context_length", 2**64 - 1, U64, "is 18446744073709551615, where llama.cpp takes"),
    # llama.cpp aborts the engine (GGML_ASSERT) on these rather than refuse the file.
    ("llama.block_count", 0, U32, "llama.block_count is 0, where llama.cpp takes 1 to 512"),
    ("llama.block_count", 513, U32, "llama.block_count is 513, where llama.cpp takes 1 to 512"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value", "vtype", "says"), LIES, ids=[lie[3][:40] for lie in LIES])
def test_a_figure_llama_cpp_cannot_read_is_invalid_gguf(
    tmp_path: Path, key: str, value: Any, vtype: gguf.GGUFValueType, says: str
) -> None:
    """Not an exception other than SourceError (a ValueError left the Model unresolved,
    retried with a traceback for good), nor a Model that is ready for engines to
    crash-loop on."""
    path = header_only(tmp_path / "m.gguf", (key, value, vtype))
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(path)
    assert err.value.reason == "InvalidGGUF"
    assert err.value.message.startswith(f"{path} is not a loadable GGUF file: ")
    assert says in err.value.message


@pytest.mark.parametrize(
    ("key", "value"), [("llama.context_length", 0), ("llama.block_count", 512)]
)
def test_figures_at_their_bounds_are_read(tmp_path: Path, key: str, value: int) -> None:
    info = modelfile.read_gguf(header_only(tmp_path / "m.gguf", (key, value, U32)))
    assert info.context_length is None  # 0: not said, as llama.cpp takes it


def test_an_array_of_arrays_is_invalid_gguf(tmp_path: Path) -> None:
    """llama.cpp refuses one ("has invalid GGUF type 9"); nested 100,000 deep in 1.2 MB
    it made the reader raise RecursionError, which the Model reconciler did not catch."""
    path = header_only(tmp_path / "m.gguf", ("t.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY))
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(path)
    assert err.value.reason == "InvalidGGUF"
    assert "t.nested: it is an array of arrays" in err.value.message
    deep = tmp_path / "deep.gguf"
    nested = (9).to_bytes(4, "little") + (
        (9).to_bytes(4, "little") + (1).to_bytes(8, "little")
    ) * 100_000
    key = len(b"x").to_bytes(8, "little") + b"x"
    deep.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
                     + (1).to_bytes(8, "little") + key + nested)  # fmt: skip
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(deep)
    assert "x: it is an array of arrays" in err.value.message


def test_short_arrays_are_decoded_only_up_to_a_budget(tmp_path: Path) -> None:
    """Short arrays past DECODED_ITEMS_MAX items in all are stepped over like long ones:
    10,000 arrays of 4,096 integers (a 156 MB header) held 1.7 GB of the daemon."""
    per = modelfile.ARRAY_DECODE_MAX
    count = modelfile.DECODED_ITEMS_MAX // per + 2
    arrays = [(f"t.a{i:03d}", list(range(per)), gguf.GGUFValueType.ARRAY) for i in range(count)]
    path = header_only(tmp_path / "m.gguf", *arrays, ("t.after", "here", gguf.GGUFValueType.STRING))
    values = modelfile.read_gguf_metadata(path)
    decoded = [k for k, _, _ in arrays if isinstance(values[k], list)]
    assert len(decoded) == modelfile.DECODED_ITEMS_MAX // per
    assert values[arrays[0][0]] == list(range(per))
    assert values[arrays[-1][0]] == modelfile.SkippedArray(
        item_type=gguf.GGUFValueType.INT32, count=per
    )
    assert values["t.after"] == "here"  # in step after the arrays stepped over


def make_directory(path: Path) -> None:
    path.mkdir()


def make_dangling_link(path: Path) -> None:
    path.symlink_to(path.parent / "gone.gguf")


def make_link_loop(path: Path) -> None:
    other = path.parent / "other.gguf"
    path.symlink_to(other)
    other.symlink_to(path)


MISSING: list[tuple[str, Any, str]] = [
    ("missing", lambda path: None, "No file at {path}."),
    ("directory", make_directory, "{path} is a directory, not a GGUF file: name the .gguf file in it."),
    ("dangling link", make_dangling_link, "{path} is a symbolic link to {dir}/gone.gguf, where there is no file."),
    ("link loop", make_link_loop, "{path} is a loop of symbolic links: none of them leads to a file."),
    ("fifo", lambda path: os.mkfifo(path), "{path} is not a regular file (a FIFO, socket or device)"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "says"), MISSING, ids=[m[0] for m in MISSING])
def test_a_path_with_no_file_says_what_is_there(
    tmp_path: Path, name: str, make: Any, says: str
) -> None:
    """Each was "No file at ...", which a user who saw the directory or the link there
    took for a typo in the path. Still FileNotFound: it is looked at again."""
    path = tmp_path / "m.gguf"
    make(path)
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.resolve(
            ModelSource(path=str(path)),
            models_dir=tmp_path,
            cache=modelcache.ModelCache(None),
            sources=ModelSources.of([tmp_path]),
        )
    assert err.value.reason == "FileNotFound"
    assert err.value.message.startswith(says.format(path=path, dir=tmp_path.resolve()))


def test_long_strings_are_stepped_over_not_decoded(tmp_path: Path) -> None:
    """A string past STRING_DECODE_MAX, or past DECODED_BYTES_MAX decoded in all, is a
    SkippedString: a 300 MB chat template held 0.9 GB of the daemon to tell that the
    model has one, which it still tells."""
    long = "x" * (modelfile.STRING_DECODE_MAX + 1)
    per = modelfile.STRING_DECODE_MAX // 2
    fill = modelfile.DECODED_BYTES_MAX // per + 1
    strings = [(f"t.s{i:03d}", "y" * per, gguf.GGUFValueType.STRING) for i in range(fill)]
    path = header_only(
        tmp_path / "m.gguf",
        ("tokenizer.chat_template", long, gguf.GGUFValueType.STRING),
        *strings,
        ("t.after", 7, U32),
    )
    values = modelfile.read_gguf_metadata(path)
    assert values["tokenizer.chat_template"] == modelfile.SkippedString(len(long))
    assert values[strings[0][0]] == "y" * per
    assert values[strings[-1][0]] == modelfile.SkippedString(per)
    assert values["t.after"] == 7  # in step after the strings stepped over
    assert modelfile.read_gguf(path).parameters["has_chat_template"] == "true"


def test_a_key_longer_than_gguf_allows_is_invalid_gguf(tmp_path: Path) -> None:
    key = "k" * (modelfile.NAME_MAX + 1)
    path = header_only(tmp_path / "m.gguf", (key, 1, U32))
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(path)
    assert err.value.reason == "InvalidGGUF"
    assert f"a key or tensor name is {len(key)} bytes long" in err.value.message


def test_a_gguf_without_tensors_is_invalid_gguf(tmp_path: Path) -> None:
    """A vocabulary-only GGUF (llama.cpp's ggml-vocab-*.gguf) was ModelReady, and every
    engine start failed on "tensor 'token_embd.weight' not found"."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(modelfile.SourceError) as err:
        modelfile.read_gguf(path)
    assert err.value.reason == "InvalidGGUF"
    assert err.value.message == (
        f"{path} holds no tensors: it is a vocabulary-only GGUF, with no weights to serve; "
        "name the model's GGUF file."
    )
