"""Every GGUF tensor type the loader accepts comes out as float32 of the
right shape: the float and simple block types reproduce the values written
(within the format's precision); the K-quant types, which the gguf package
can read but not write, are written as crafted raw blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from trioserve.models.gguf_file import open_reader
from trioserve.models.gguf_loader import SCALE_FIELDS, SUPPORTED_TYPES, scales_finite, tensor_array

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 256
# Largest error relative to the row's largest magnitude, by type.
WRITABLE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q4_0: 0.1, Q.Q4_1: 0.1}
# K-quant byte offsets of each block's f16 scale fields (d, and dmin where present).
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def crafted_k_blocks(qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS, COLS // block, size), dtype=np.uint8)
    for offset in K_SCALES[qtype]:
        raw[:, :, offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    rng = np.random.default_rng(7)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw_k = {}
    for qtype in WRITABLE:
        data = values if qtype == Q.F32 else gguf.quants.quantize(values, qtype)
        writer.add_tensor(f"t.{qtype.name}", data, raw_dtype=None if qtype == Q.F32 else qtype)
    for qtype in K_SCALES:
        raw_k[qtype] = crafted_k_blocks(qtype, rng)
        writer.add_tensor(f"t.{qtype.name}", raw_k[qtype], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in open_reader(path).tensors}
    return values, raw_k, tensors


@pytest.mark.parametrize("qtype", list(WRITABLE), ids=lambda q: q.name)
def test_written_values_come_back(qtype, written):
    values, _, tensors = written
    assert qtype in SUPPORTED_TYPES
    out = tensor_array(tensors[f"t.{qtype.name}"])
    assert out.shape == (ROWS, COLS) and out.dtype == np.float32
    scale = np.abs(values).max(axis=1, keepdims=True)
    assert (np.abs(out - values) <= WRITABLE[qtype] * scale).all()


@pytest.mark.parametrize("qtype", list(K_SCALES), ids=lambda q: q.name)
def test_k_quant_blocks_load_in_row_order(qtype, written):
    _, raw_k, tensors = written
    assert qtype in SUPPORTED_TYPES
    out = tensor_array(tensors[f"t.{qtype.name}"])
    assert out.shape == (ROWS, COLS) and np.isfinite(out).all()
    # Row r of the tensor is exactly the blocks of raw row r, decoded alone.
    for r in range(ROWS):
        np.testing.assert_array_equal(out[r], gguf.quants.dequantize(raw_k[qtype][r : r + 1], qtype)[0])
    assert np.abs(out).max() > 0


@pytest.mark.parametrize("qtype", list(SCALE_FIELDS), ids=lambda q: q.name)
def test_the_scale_fields_tell_exactly_which_blocks_dequantize_to_finite_numbers(qtype):
    # The loader checks a quantized tensor from its blocks' float16 scale
    # fields alone; that must agree with dequantizing it whole, for blocks
    # whose fields are finite, NaN, +-infinity, and infinity beside zero codes.
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(11)
    special = np.array([np.nan, np.inf, -np.inf], dtype=np.float16).view(np.uint8).reshape(3, 2)
    for trial in range(12):
        raw = rng.integers(0, 256, size=(4, 2, size), dtype=np.uint8)
        for offset in SCALE_FIELDS[qtype]:
            raw[..., offset : offset + 2] = np.array([0.02], dtype=np.float16).view(np.uint8)
        if trial % 4:  # one field of one block made special; trial 0, 4, 8 stay clean
            offset = SCALE_FIELDS[qtype][trial % len(SCALE_FIELDS[qtype])]
            row, blk = rng.integers(0, 4), rng.integers(0, 2)
            raw[row, blk, offset : offset + 2] = special[trial % 3]
            if trial % 4 == 3:  # every other byte zero: an infinite scale times zero codes
                keep = raw[row, blk, offset : offset + 2].copy()
                raw[row, blk] = 0
                raw[row, blk, offset : offset + 2] = keep
        data = raw.reshape(4, -1)
        with np.errstate(invalid="ignore", over="ignore"):
            expected = bool(np.isfinite(gguf.quants.dequantize(data, qtype)).all())
        assert scales_finite(data, qtype) is expected, (trial, expected)
        assert expected is (trial % 4 == 0)
