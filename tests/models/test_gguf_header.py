"""trioserve's GGUF reader (models/gguf_header.py): the same metadata and
tensors as the gguf package's reader; a corrupted length or count is a
CheckpointError naming the file, never an allocation that kills the
process or an exception of another kind; and it holds little memory."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from tests.tiny_tokenizer import smollm2_gguf_path
from trioserve.errors import CheckpointError
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.gguf_file import open_reader
from trioserve.models.gguf_header import check_header


@pytest.mark.parametrize("kind", ["gguf_f32", "gguf_q8_0", "gguf_q4_1"])
def test_the_reader_reads_what_the_gguf_package_reads(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    ours, theirs = open_reader(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        value = value.item() if isinstance(value, np.generic) else value
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        assert (mine.n_bytes, mine.data_offset) == (t.n_bytes, t.data_offset)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data), mine.name
        assert not mine.data.flags.writeable


def test_the_default_model_reads_the_same_and_holds_little_memory():
    """SmolLM2's file: 49,152 tokens and ~48,900 merges. The gguf package's
    reader holds ~150 MB for them (a numpy object per part of every string);
    this one its plain values and the mapping's views."""
    path = smollm2_gguf_path()
    probe = (
        "import ctypes, gc, json, sys\n"
        "from trioserve.models.gguf_file import open_reader\n"
        "def rss():\n"
        "    gc.collect(); ctypes.CDLL(None).malloc_trim(0)\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) << 10\n"
        "before = rss(); r = open_reader(sys.argv[1]); held = rss() - before\n"
        "print(json.dumps({'held': held, 'tokens': len(r.metadata['tokenizer.ggml.tokens']), 'tensors': len(r.tensors)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["tokens"] == 49152 and report["tensors"] == 272
    assert report["held"] < 40 << 20, report["held"] >> 20


def _tensor_entry(data: bytes, name: str) -> int:
    """Offset of tensor ``name``'s entry in the tensor table (its name's length)."""
    return data.index(struct.pack("<Q", len(name)) + name.encode())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("duplicate", "tensor 'blk.0.attn_q.weight' appears twice"),
        ("past_the_end", "tensor 'token_embd.weight' needs"),
        ("unknown_type", "tensor 'output_norm.weight' has unknown type 250"),
        ("partial_block", "is not whole Q8_0 blocks of 32"),
    ],
)
def test_a_bad_tensor_table_is_named(tmp_path, tiny_checkpoints, corrupt, message):
    data = bytearray(tiny_checkpoints["gguf_q8_0"].read_bytes())
    if corrupt == "duplicate":  # K's name, same length, made Q's
        at = _tensor_entry(data, "blk.0.attn_k.weight") + 8
        data[at : at + len("blk.0.attn_q.weight")] = b"blk.0.attn_q.weight"
    elif corrupt == "past_the_end":
        at = _tensor_entry(data, "token_embd.weight") + 8 + len("token_embd.weight")
        dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<Q", data, at + 4 + 8 * dims + 4, 1 << 40)  # the offset
    elif corrupt == "unknown_type":
        at = _tensor_entry(data, "output_norm.weight") + 8 + len("output_norm.weight")
        dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<I", data, at + 4 + 8 * dims, 250)
    else:
        at = _tensor_entry(data, "blk.0.attn_q.weight") + 8 + len("blk.0.attn_q.weight")
        struct.pack_into("<Q", data, at + 4, 33)  # 33 columns: not whole blocks of 32
    path = tmp_path / f"{corrupt}.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path == str(path)
    assert message in info.value.problem


def _count_offset(data: bytes, key: str) -> int:
    """Offset of the u64 item count of array metadata ``key``."""
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 9  # an array
    return at + 4 + 4


def test_intact_files_pass(tiny_checkpoints):
    for kind in ("gguf_f32", "gguf_q8_0", "gguf_q4_1"):
        check_header(tiny_checkpoints[kind])


def test_a_huge_array_count_is_refused_before_any_allocation(tmp_path, tiny_checkpoints):
    data = bytearray(tiny_checkpoints["gguf_f32"].read_bytes())
    at = _count_offset(data, "tokenizer.ggml.token_type")
    data[at + 6] = 105  # high byte: a count of ~2^54
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.path == str(path)
    assert "items of 'tokenizer.ggml.token_type' needs" in info.value.problem


@pytest.mark.parametrize(
    ("fmt", "version", "message"),
    [("<I", 77, "unsupported GGUF version 77"), (">I", 3, "a big-endian GGUF file: trioserve reads little-endian ones")],
    ids=["unknown", "big-endian"],
)
def test_a_version_it_cannot_read_is_named(tmp_path, tiny_checkpoints, fmt, version, message):
    data = bytearray(tiny_checkpoints["gguf_f32"].read_bytes())
    struct.pack_into(fmt, data, 4, version)
    path = tmp_path / "version.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_single_byte_corruptions_of_the_header_fail_cleanly(tmp_path, tiny_checkpoints):
    """Flip one byte at 150 places in the header: each file either loads or
    raises CheckpointError (the CLI's one-line message), nothing else."""
    original = tiny_checkpoints["gguf_f32"].read_bytes()
    header_end = original.index(b"token_embd.weight") + 200  # metadata and tensor table
    rng = random.Random(3)
    path = tmp_path / "flip.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(150):
        data = bytearray(original)
        at = rng.randrange(4, header_end)
        data[at] ^= 1 << rng.randrange(8) | 0x40
        path.write_bytes(bytes(data))
        try:
            load_checkpoint(path)
            outcomes["loaded"] += 1
        except CheckpointError as exc:
            assert exc.path == str(path) and "\n" not in str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


def _string_items(*items: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(item)) + item for item in items)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_string_items(b"a", b"\xc3\xa9t\xc3\xa9", b"")[:-3] + b"", None),  # cut inside the lengths: named below
        (_string_items(b"ab", b"c\xffd"), "corrupt metadata: the value of 'k' is not UTF-8 text"),
        (_string_items(b"ab") + struct.pack("<Q", 1 << 40) + b"x" * 8, "an item of 'k' needs 1099511627776 bytes at offset 18"),
    ],
    ids=["truncated", "not_utf8", "huge_length"],
)
def test_a_bad_string_array_item_is_named_as_one_at_a_time_names_it(data, message, tmp_path):
    # The string arrays (a vocabulary, its merges) are read in one tight
    # loop; a bad item is read again one at a time so that the message
    # names it as before: its offset and size, or that it is not UTF-8.
    from trioserve.models.gguf_header import _Cursor, _strings

    cur = _Cursor(memoryview(data), tmp_path / "m.gguf")
    with pytest.raises(CheckpointError) as info:
        _strings(cur, 3 if message is None else 2, "k")
    assert (message or "an item of 'k' needs") in info.value.problem


def test_a_string_array_reads_every_item_and_moves_past_it(tmp_path):
    from trioserve.models.gguf_header import _Cursor, _strings

    items = [b"", b"a", "é\u2581x".encode(), b"z" * 300]
    data = _string_items(*items) + b"rest"
    cur = _Cursor(memoryview(data), tmp_path / "m.gguf")
    assert _strings(cur, len(items), "k") == [i.decode() for i in items]
    assert bytes(cur.data[cur.at :]) == b"rest"
