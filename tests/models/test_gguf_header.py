"""The header walk that runs before the gguf package: a corrupted length or
count is a CheckpointError naming the file, never an allocation that kills
the process or an exception of another kind."""

from __future__ import annotations

import random
import struct

import pytest

from trioserve.errors import CheckpointError
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.gguf_header import check_header


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


def test_unknown_version_is_named(tmp_path, tiny_checkpoints):
    data = bytearray(tiny_checkpoints["gguf_f32"].read_bytes())
    struct.pack_into("<I", data, 4, 77)
    path = tmp_path / "v77.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="unsupported GGUF version 77"):
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
