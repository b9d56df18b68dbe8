"""Checkpoint files as untrusted input (issue #49): a file that is not a
regular file or is too big is refused before it is read; header integers
are bounded before anything is made from them; settings that no model has
(zero, NaN, negative, contradicting the tensors or the tokenizer) are
refused before a model is published. Every refusal is one CheckpointError
line naming the file and the key. Every file here is written raw by the test."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.tiny_model import set_gguf_u32, tiny_weights, write_gguf, write_hf_dir
from tests.tiny_tokenizer import VOCAB_SIZE, train_tiny_tokenizer
from trioserve.errors import CheckpointError
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.config import MAX_CONTEXT
from trioserve.models.files import MAX_JSON, MAX_TOKENIZER_JSON
from trioserve.models.decoder import DecoderModel

ROOT = Path(__file__).resolve().parents[2]
QUICK_S = 10.0  # a refusal takes well under a second; this only bounds a test that would hang


def refused(target: Path, *, within: float = QUICK_S) -> CheckpointError:
    """The CheckpointError that loading ``target`` raises, from a thread
    that must finish within ``within`` seconds (a load blocked on a FIFO
    would otherwise hang the test); one line."""
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_checkpoint(target)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=load, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"loading {target} did not end within {within} s"
    assert outcome[0] is not None, f"{target} loaded"
    err = outcome[0]
    assert isinstance(err, CheckpointError), repr(err)
    assert "\n" not in str(err)
    assert time.monotonic() - started < within
    return err


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- HF directories: files that are not regular files, or too big ---------------------


@pytest.fixture
def hf(tiny_checkpoints, tmp_path) -> Path:
    return copy_dir(tiny_checkpoints["hf"], tmp_path / "hf")


def test_a_fifo_tokenizer_json_is_refused_at_once(hf):
    (hf / "tokenizer.json").unlink()
    os.mkfifo(hf / "tokenizer.json")
    err = refused(hf)
    assert err.path == str(hf)
    assert "tokenizer.json" in err.problem and "FIFO" in err.problem


def test_a_tokenizer_json_linked_to_dev_zero_is_refused_at_once(hf):
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").symlink_to("/dev/zero")
    err = refused(hf)
    assert "tokenizer.json" in err.problem and "character device" in err.problem


def test_a_tokenizer_json_over_the_bound_is_refused_unread(hf):
    with (hf / "tokenizer.json").open("r+b") as f:
        f.truncate(MAX_TOKENIZER_JSON + 1)  # sparse: refused on its size, never read
    err = refused(hf)
    assert f"is {MAX_TOKENIZER_JSON + 1} bytes, more than the {MAX_TOKENIZER_JSON}" in err.problem


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"])
def test_every_small_file_of_the_directory_is_read_the_same_way(hf, name):
    path = hf / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    err = refused(hf)
    assert name in str(err) and "FIFO" in err.problem


def test_a_json_file_over_its_bound_is_refused_unread(hf):
    with (hf / "tokenizer_config.json").open("r+b") as f:
        f.truncate(MAX_JSON + 1)
    assert "more than the" in refused(hf).problem


def test_a_shard_that_is_a_fifo_is_refused(tiny_checkpoints, tmp_path):
    tokenizer = train_tiny_tokenizer()
    d = write_hf_dir(tmp_path / "one", tiny_weights(tokenizer.get_vocab_size()), tokenizer, shards=1)
    os.mkfifo(d / "extra.safetensors")
    err = refused(d)
    assert err.path == str(d / "extra.safetensors") and "FIFO" in err.problem


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", 7])
def test_an_index_naming_a_file_outside_the_directory_is_refused(hf, file):
    index = hf / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = next(iter(raw["weight_map"]))
    raw["weight_map"][name] = file
    index.write_text(json.dumps(raw))
    err = refused(hf)
    assert err.path == str(index) and repr(file) in err.problem


def test_a_directory_of_links_to_regular_files_still_loads(hf, tmp_path):
    # A Hugging Face cache's snapshot: every file a link into the blob store.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for file in hf.iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(blobs / file.name)
    assert load_checkpoint(snapshot).tokenizer.vocab_size == VOCAB_SIZE


def test_the_cli_refuses_a_fifo_tokenizer_in_one_line(hf):
    (hf / "tokenizer.json").unlink()
    os.mkfifo(hf / "tokenizer.json")
    proc = subprocess.run(
        [sys.executable, "-m", "trioserve.cli", "generate", "--model", str(hf), "--prompt", "hi"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("Loading")]
    assert len(lines) == 1 and lines[0].startswith("trioserve: error: ") and "FIFO" in lines[0], proc.stderr


# -- GGUF header integers: bounded before anything is made from them --------------------


def tiny_gguf(tiny_checkpoints, tmp_path: Path, name: str = "t.gguf") -> Path:
    return Path(shutil.copy(tiny_checkpoints["gguf_f32"], tmp_path / name))


def set_gguf_f32(path: Path, key: str, value: float) -> Path:
    """Overwrite, in place, the float32 value of GGUF metadata ``key``."""
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == gguf.GGUFValueType.FLOAT32
    struct.pack_into("<f", data, at + 4, value)
    path.write_bytes(data)
    return path


def rewrite_gguf(src: Path, dst: Path, **overrides: tuple[object, gguf.GGUFValueType]) -> Path:
    """``src`` written again with metadata ``overrides`` (key with "." as
    "__" -> (value, type)): any value of any type, where set_gguf_u32 can
    only change a uint32 in place."""
    changes = {key.replace("__", "."): v for key, v in overrides.items()}
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in changes.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_huge_block_count_is_refused_at_once(tiny_checkpoints, tmp_path):
    path = set_gguf_u32(tiny_gguf(tiny_checkpoints, tmp_path), "llama.block_count", 3_000_000)
    started = time.monotonic()
    err = refused(path)
    assert time.monotonic() - started < 10.0  # it took 40 s and 5 GB before the bound; a busy machine still makes 10
    assert "'llama.block_count' is 3000000" in err.problem


@pytest.mark.parametrize(("declared", "held"), [(1, 2), (3, 2)])
def test_a_block_count_that_contradicts_the_tensors_is_refused(tiny_checkpoints, tmp_path, declared, held):
    # 29 blocks declared for 30 layers of tensors ran 29 of them; 31 asked for one not there.
    path = set_gguf_u32(tiny_gguf(tiny_checkpoints, tmp_path), "llama.block_count", declared)
    err = refused(path)
    assert f"'llama.block_count' is {declared}, but the file has tensors for {held} layers" in err.problem


CHILD = textwrap.dedent(
    """
    import resource, sys
    import torch
    from trioserve.models.checkpoint import load_checkpoint
    from trioserve.models.decoder import DecoderModel

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    torch.set_num_threads(1)
    plain, long = sys.argv[1], sys.argv[2]
    DecoderModel.from_checkpoint(load_checkpoint(plain), max_model_len=8192)
    before = peak()
    checkpoint = load_checkpoint(long)
    loaded = peak()
    model = DecoderModel.from_checkpoint(checkpoint, max_model_len=8192)
    print(checkpoint.config.max_position, model.max_positions, loaded - before, peak() - before)
    """
)


def test_a_long_context_costs_only_the_context_served(tiny_checkpoints, tmp_path):
    # context_length 2^22 served with --max-model-len 8192: its RoPE tables were
    # 2^22 rows (+3.1 GB peak, +1 GB kept for SmolLM2's head size); now 8192.
    # Peak resident memory measured in a child of its own.
    path = set_gguf_u32(tiny_gguf(tiny_checkpoints, tmp_path), "llama.context_length", 1 << 22)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_checkpoints["gguf_f32"]), str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    context, served, load_growth, build_growth = (int(x) for x in out)
    assert (context, served) == (1 << 22, 8192)
    assert load_growth < 32 << 20 and build_growth < 64 << 20, (load_growth, build_growth)


ENGINE_CHILD = textwrap.dedent(
    """
    import resource, sys
    import trio
    from trioserve.config import EngineConfig
    from trioserve.engine import open_engine

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    async def main():
        async with open_engine(EngineConfig(model=sys.argv[1], dtype="float32", max_model_len=8192, kv_cache_bytes=1 << 20)) as engine:
            pass
        before = peak()
        async with open_engine(EngineConfig(model=sys.argv[2], dtype="float32", max_model_len=8192, kv_cache_bytes=1 << 20)) as engine:
            print(engine.max_model_len, peak() - before)

    trio.run(main)
    """
)


def test_an_engine_serving_8192_of_a_long_contexts_positions_builds_tables_for_8192(tiny_checkpoints, tmp_path):
    # What the server does (open_engine passes --max-model-len on): 2^22 rows of
    # RoPE tables would be 512 MB for the tiny model's head size; 8192 are 1 MB.
    path = set_gguf_u32(tiny_gguf(tiny_checkpoints, tmp_path), "llama.context_length", 1 << 22)
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_CHILD, str(tiny_checkpoints["gguf_f32"]), str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    served, growth = (int(x) for x in out.stdout.split()[-2:])
    assert served == 8192 and growth < 64 << 20, (served, growth / 2**20)


def test_the_rope_tables_follow_the_context_served(tiny_checkpoints):
    checkpoint = load_checkpoint(tiny_checkpoints["gguf_f32"])
    assert checkpoint.config.max_position == 256
    full = DecoderModel.from_checkpoint(checkpoint)
    short = DecoderModel.from_checkpoint(checkpoint, max_model_len=100)
    longer = DecoderModel.from_checkpoint(checkpoint, max_model_len=10_000)
    assert (full.max_positions, short.max_positions, longer.max_positions) == (256, 100, 256)
    assert torch.equal(short.rope_cos, full.rope_cos[:100]) and torch.equal(short.rope_sin, full.rope_sin[:100])


NONSENSE_U32 = [
    ("llama.context_length", 0),
    ("llama.context_length", MAX_CONTEXT + 1),
    ("llama.block_count", 0),
    ("llama.embedding_length", 0),
    ("llama.feed_forward_length", 0),
    ("llama.attention.head_count", 0),
    ("llama.attention.head_count_kv", 0),
    ("llama.attention.head_count_kv", 3),  # 4 query heads do not divide into 3
    ("llama.attention.head_count_kv", 8),  # more KV heads than query heads
    ("llama.rope.dimension_count", 8),  # heads are 16 wide: a partial rotary
]


@pytest.mark.parametrize(("key", "value"), NONSENSE_U32, ids=[f"{k}={v}" for k, v in NONSENSE_U32])
def test_a_nonsense_integer_is_refused_naming_its_key(tiny_checkpoints, tmp_path, key, value):
    path = set_gguf_u32(tiny_gguf(tiny_checkpoints, tmp_path), key, value)
    err = refused(path)
    assert err.path == str(path)
    assert repr(key) in err.problem, err.problem


NONSENSE_F32 = [
    ("llama.rope.freq_base", math.nan),
    ("llama.rope.freq_base", math.inf),
    ("llama.rope.freq_base", 0.0),
    ("llama.rope.freq_base", -10000.0),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5),
    ("llama.attention.layer_norm_rms_epsilon", 0.0),
    ("llama.attention.layer_norm_rms_epsilon", math.nan),
    ("llama.attention.layer_norm_rms_epsilon", 10.0),
]


@pytest.mark.parametrize(("key", "value"), NONSENSE_F32, ids=[f"{k}={v}" for k, v in NONSENSE_F32])
def test_a_nonsense_float_is_refused_naming_its_key(tiny_checkpoints, tmp_path, key, value):
    # A negative epsilon served logprobs of -3.4e+38 and zero embeddings; a NaN base, NaN everywhere.
    path = set_gguf_f32(tiny_gguf(tiny_checkpoints, tmp_path), key, value)
    err = refused(path)
    assert repr(key) in err.problem, err.problem


T = gguf.GGUFValueType
WRONG_TYPES = [
    ("llama.block_count", ("two", T.STRING)),
    ("llama.context_length", (256.5, T.FLOAT32)),
    ("llama.attention.head_count_kv", ([2, 2], T.ARRAY)),
    ("llama.rope.freq_base", ("10000", T.STRING)),
    ("llama.attention.layer_norm_rms_epsilon", (True, T.BOOL)),
    ("llama.rope.scaling.factor", (math.nan, T.FLOAT32)),
]


@pytest.mark.parametrize(("key", "override"), WRONG_TYPES, ids=[k for k, _ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(tiny_checkpoints, tmp_path, key, override):
    overrides = {key.replace(".", "__"): override}
    if key == "llama.rope.scaling.factor":
        overrides["llama__rope__scaling__type"] = ("linear", T.STRING)
    path = rewrite_gguf(tiny_checkpoints["gguf_f32"], tmp_path / "typed.gguf", **overrides)
    err = refused(path)
    assert repr(key) in err.problem, err.problem


def test_the_rewritten_file_itself_loads(tiny_checkpoints, tmp_path):
    # The helper above changes only what it is asked to.
    path = rewrite_gguf(tiny_checkpoints["gguf_f32"], tmp_path / "same.gguf")
    assert load_checkpoint(path).config == load_checkpoint(tiny_checkpoints["gguf_f32"]).config


@pytest.mark.parametrize(("key", "count"), [("tokenizer.ggml.tokens", 1 << 23), ("tokenizer.ggml.token_type", 1 << 30)])
def test_an_array_count_past_the_bound_is_refused_before_any_list_is_made(tiny_checkpoints, tmp_path, key, count):
    # The bytes are there (a sparse tail): only the bound stops a list of a billion Python objects.
    path = tiny_gguf(tiny_checkpoints, tmp_path)
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key) + 4 + 4
    struct.pack_into("<Q", data, at, count)
    path.write_bytes(data)
    with path.open("r+b") as f:
        f.truncate(len(data) + count * 8)
    err = refused(path)
    assert f"{key!r} claims {count} items" in err.problem


def test_a_huge_tensor_count_is_refused(tiny_checkpoints, tmp_path):
    path = tiny_gguf(tiny_checkpoints, tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8, 1 << 40)
    path.write_bytes(data)
    assert f"claims {1 << 40} tensors" in refused(path).problem


# -- the tokenizer against the embedding ------------------------------------------------


def gguf_with_rows(tmp_path: Path, rows: int) -> Path:
    tokenizer = train_tiny_tokenizer()
    return write_gguf(tmp_path / f"rows{rows}.gguf", tiny_weights(rows), tokenizer)


def test_a_tokenizer_far_smaller_than_the_embedding_is_refused(tmp_path):
    # The 1,000-token vocabulary against 49,152 embedding rows, at the tiny model's scale.
    err = refused(gguf_with_rows(tmp_path, VOCAB_SIZE + 4000))
    assert "'tokenizer.ggml.tokens'" not in err.problem  # named plainly, with both counts
    assert f"has {VOCAB_SIZE} tokens for {VOCAB_SIZE + 4000} embedding rows (token_embd.weight)" in err.problem


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path):
    err = refused(gguf_with_rows(tmp_path, VOCAB_SIZE - 10))
    assert f"has {VOCAB_SIZE} tokens, more than the {VOCAB_SIZE - 10} embedding rows" in err.problem


def test_an_embedding_padded_past_the_tokenizer_still_loads(tmp_path):
    # Qwen2.5 pads 271 rows, Phi-3 53: padding is not a mismatch.
    checkpoint = load_checkpoint(gguf_with_rows(tmp_path, VOCAB_SIZE + 64))
    assert (checkpoint.config.vocab_size, checkpoint.tokenizer.vocab_size) == (VOCAB_SIZE + 64, VOCAB_SIZE)


def test_rope_divisors_that_are_not_positive_are_refused(tmp_path):
    tokenizer = train_tiny_tokenizer()
    weights = tiny_weights(tokenizer.get_vocab_size())
    path = write_gguf(tmp_path / "freqs.gguf", weights, tokenizer)
    reader = gguf.GGUFReader(path)
    out = gguf.GGUFWriter(str(tmp_path / "freqs0.gguf"), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            out.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        out.add_tensor(t.name, np.array(t.data))
    out.add_tensor("rope_freqs.weight", np.zeros(8, dtype=np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    assert "rope_freqs.weight" in refused(tmp_path / "freqs0.gguf").problem


# -- config.json: the same checks, naming config.json's keys ---------------------------------


HF_NONSENSE = [
    ("num_hidden_layers", 3_000_000),
    ("num_hidden_layers", 1),
    ("max_position_embeddings", 0),
    ("max_position_embeddings", 1 << 40),
    ("rope_theta", math.nan),
    ("rope_theta", -1.0),
    ("rms_norm_eps", -1e-6),
    ("rms_norm_eps", 0),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 3),
    ("head_dim", 15),
    ("hidden_size", "64"),
    ("vocab_size", 2.5),
    ("tie_word_embeddings", "no"),
]


@pytest.mark.parametrize(("key", "value"), HF_NONSENSE, ids=[f"{k}={v}" for k, v in HF_NONSENSE])
def test_a_nonsense_config_json_value_is_refused_naming_its_key(hf, key, value):
    config = json.loads((hf / "config.json").read_text())
    config[key] = value
    (hf / "config.json").write_text(json.dumps(config))
    err = refused(hf)
    assert repr(key) in err.problem, err.problem


def test_a_config_json_that_is_not_an_object_is_refused(hf):
    (hf / "config.json").write_text("[1, 2]")
    err = refused(hf)
    assert err.path == str(hf / "config.json") and "not an object" in err.problem


def test_an_hf_tokenizer_far_smaller_than_the_embedding_is_refused(tmp_path):
    tokenizer = train_tiny_tokenizer()
    d = write_hf_dir(tmp_path / "hf", tiny_weights(VOCAB_SIZE + 4000), tokenizer, shards=1)
    err = refused(d)
    assert "tokenizer.json" in err.problem and "vocab_size" in err.problem


def test_the_default_model_and_the_tiny_models_still_load(tiny_checkpoints):
    for path in tiny_checkpoints.values():
        load_checkpoint(path)
    load_checkpoint("smollm2")
