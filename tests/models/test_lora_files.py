"""load_lora_adapter on PEFT adapters that tests/lora_files.py writes for the
tiny model: the factors and scale come back exactly, and every adapter that
does not fit the model (or uses a PEFT option trioserve does not implement)
is one AdapterError, a 400, whose message names the problem. The files are
untrusted input: a FIFO, a device, a socket or a directory in a file's
place, or a file past its bound, is refused at once, naming the file."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.lora_files import dev_zero_in_place, fifo_in_place, merged_weights, write_peft_adapter
from tests.tiny_model import TINY, hf_config, tiny_weights
from trioserve.errors import RequestError
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.config import ModelConfig, config_from_hf
from trioserve.models.files import MAX_JSON
from trioserve.models.lora import TARGETS, AdapterError, LoraAdapter, load_lora_adapter, weights_bound

VOCAB = 300
# TINY's q/k/v/o/gate/up/down matrices as (in, out): hidden 64, head_dim 16, 2 KV heads, 128 intermediate.
FEATURES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
            "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
PARENT = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for t in TARGETS}


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return config_from_hf(hf_config(VOCAB, tie=False), Path("config.json"))


def load(path: Path, config: ModelConfig, *, max_rank: int = 64) -> LoraAdapter:
    return load_lora_adapter(path, config, name="x", max_rank=max_rank)


def stored(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path / "adapter_model.safetensors"))


def rewrite(path: Path, change) -> None:
    """Replace the adapter's tensors with ``change(tensors)``."""
    save_file(change(stored(path)), str(path / "adapter_model.safetensors"))


def edit_config(path: Path, **keys) -> None:
    file = path / "adapter_config.json"
    file.write_text(json.dumps(dict(json.loads(file.read_text()), **keys)))


def refused(path: Path, config: ModelConfig, *, max_rank: int = 64) -> str:
    with pytest.raises(AdapterError) as info:
        load(path, config, max_rank=max_rank)
    assert isinstance(info.value, RequestError) and info.value.field == "path"
    message = str(info.value)
    assert message.startswith("adapter 'x': "), message
    return message


def assert_factors(adapter: LoraAdapter, path: Path, pairs: list[tuple[int, str]], *, prefix="base_model.model.", segment="") -> None:
    """The adapter holds exactly ``pairs``, each equal to the file's float32 tensors."""
    tensors = stored(path)
    assert sorted((i, t) for i, per in adapter.weights.items() for t in per) == sorted(pairs)
    for i, target in pairs:
        a, b = adapter.weights[i][target]
        stem = f"{prefix}model.layers.{i}.{PARENT[target]}.{target}"
        n_in, n_out = FEATURES[target]
        assert a.shape == (adapter.rank, n_in) and b.shape == (n_out, adapter.rank)
        for got, ab in ((a, "A"), (b, "B")):
            assert got.dtype == torch.float32 and got.device.type == "cpu" and got.is_contiguous()
            assert np.array_equal(got.numpy(), tensors[f"{stem}.lora_{ab}{segment}.weight"])


def test_a_full_adapter_reads_back_exactly(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=8.0)
    adapter = load(path, config)
    assert (adapter.name, adapter.path, adapter.rank, adapter.scale) == ("x", str(path), 4, 2.0)
    assert adapter.targets == TARGETS
    assert_factors(adapter, path, [(i, t) for i in range(2) for t in TARGETS])
    assert np.abs(adapter.weights[0]["q_proj"][1].numpy()).max() > 0  # B is not PEFT's zero init


def test_the_config_of_a_tiny_checkpoint_fits(tmp_path, tiny_checkpoints):
    checkpoint = load_checkpoint(tiny_checkpoints["gguf_f32"])
    adapter = load(write_peft_adapter(tmp_path / "a", TINY), checkpoint.config)
    assert adapter.targets == TARGETS


def test_delta_is_scale_times_b_at_a(tmp_path, config):
    adapter = load(write_peft_adapter(tmp_path / "a", TINY, rank=8, alpha=32.0, targets=("q_proj", "down_proj")), config)
    assert adapter.scale == 4.0
    for i in range(2):
        for target in TARGETS:
            delta = adapter.delta(i, target)
            if target not in ("q_proj", "down_proj"):
                assert delta is None
                continue
            a, b = adapter.weights[i][target]
            n_in, n_out = FEATURES[target]
            assert delta.shape == (n_out, n_in) and delta.dtype == torch.float32
            expected = 4.0 * (b.double() @ a.double())
            torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-7)
    assert adapter.delta(5, "q_proj") is None


def test_rslora_divides_alpha_by_the_root_of_the_rank(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, rank=16, alpha=8.0, extra_config={"use_rslora": True})
    assert load(path, config).scale == 8.0 / math.sqrt(16) == 2.0
    path = write_peft_adapter(tmp_path / "b", TINY, rank=3, alpha=5.0, extra_config={"use_rslora": True})
    assert load(path, config).scale == 5.0 / math.sqrt(3)


def test_a_regex_target_modules(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=r"model\.layers\.1\.self_attn\.(q|v)_proj")
    assert json.loads((path / "adapter_config.json").read_text())["target_modules"].startswith("model")
    adapter = load(path, config)
    assert adapter.targets == ("q_proj", "v_proj")
    assert_factors(adapter, path, [(1, "q_proj"), (1, "v_proj")])
    path = write_peft_adapter(tmp_path / "b", TINY, targets=r".*(gate|up|down)_proj")
    assert load(path, config).targets == ("gate_proj", "up_proj", "down_proj")


def test_layers_to_transform(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("k_proj", "o_proj", "up_proj"), layers=[1])
    adapter = load(path, config)
    assert adapter.targets == ("k_proj", "o_proj", "up_proj")
    assert_factors(adapter, path, [(1, "k_proj"), (1, "o_proj"), (1, "up_proj")])
    assert adapter.delta(0, "k_proj") is None


def test_names_with_an_adapter_segment_or_without_the_prefix(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY)
    rewrite(path, lambda t: {n.replace(".weight", ".default.weight"): v for n, v in t.items()})
    assert_factors(load(path, config), path, [(i, t) for i in range(2) for t in TARGETS], segment=".default")
    path = write_peft_adapter(tmp_path / "b", TINY, seed=1)
    rewrite(path, lambda t: {n.removeprefix("base_model.model."): v for n, v in t.items()})
    assert_factors(load(path, config), path, [(i, t) for i in range(2) for t in TARGETS], prefix="")


def test_half_precision_weights_become_float32(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("v_proj",))
    rewrite(path, lambda t: {n: v.astype(np.float16) for n, v in t.items()})
    a, b = load(path, config).weights[0]["v_proj"]
    assert a.dtype == b.dtype == torch.float32
    assert np.array_equal(a.numpy(), stored(path)["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"].astype(np.float32))


def test_an_adapter_for_another_shape(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", dict(TINY, num_key_value_heads=4), targets=("k_proj",))
    assert refused(path, config) == "adapter 'x': layers.0.self_attn.k_proj.lora_B.weight has shape (64, 4); the model needs (32, 4)"
    path = write_peft_adapter(tmp_path / "b", dict(TINY, hidden_size=128))
    assert refused(path, config) == "adapter 'x': layers.0.self_attn.q_proj.lora_A.weight has shape (4, 128); the model needs (4, 64)"
    path = write_peft_adapter(tmp_path / "c", dict(TINY, num_hidden_layers=3), targets=("q_proj",))
    edit_config(path, target_modules=None)
    assert "is for layer 2; the model has 2 layers" in refused(path, config)


def test_a_rank_the_config_does_not_match(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, rank=4)
    edit_config(path, r=8)
    assert "lora_A.weight has shape (4, 64); the model needs (8, 64)" in refused(path, config)


def test_rank_limits(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, rank=128, targets=("q_proj",))
    assert refused(path, config, max_rank=64) == "adapter 'x': rank 128 is more than --max-lora-rank 64"
    assert load(path, config, max_rank=128).rank == 128
    edit_config(path, r=0)
    assert refused(path, config) == "adapter 'x': rank 0 is less than 1"
    edit_config(path, r="4")
    assert "r '4'" in refused(path, config)


def test_an_unknown_target(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("q_proj",), extra_config={"target_modules": ["q_proj", "lm_head"]})
    assert refused(path, config).startswith("adapter 'x': target module 'lm_head' is not one of q_proj, k_proj, v_proj")
    path = write_peft_adapter(tmp_path / "b", TINY, targets=("q_proj",), extra_config={"target_modules": None})
    rewrite(path, lambda t: dict(t, **{"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}))
    assert refused(path, config).startswith("adapter 'x': target module 'lm_head' is not one of q_proj")


def test_weights_the_config_does_not_target(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("q_proj", "v_proj"), extra_config={"target_modules": ["q_proj"]})
    assert "holds weights for layers.0.self_attn.v_proj, which adapter_config.json does not target" in refused(path, config)
    path = write_peft_adapter(tmp_path / "b", TINY, targets=("q_proj",), extra_config={"target_modules": ["q_proj", "v_proj"]})
    message = refused(path, config)
    assert "holds no LoRA weights for layers.0.self_attn.v_proj, layers.1.self_attn.v_proj, which adapter_config.json targets" in message
    path = write_peft_adapter(tmp_path / "c", TINY, targets=("q_proj",), layers=[0], extra_config={"layers_to_transform": [0, 1]})
    assert "holds no LoRA weights for layers.1.self_attn.q_proj" in refused(path, config)
    path = write_peft_adapter(tmp_path / "d", TINY, targets=("q_proj",), extra_config={"layers_to_transform": [2]})
    assert "layers_to_transform names layer 2; the model has 2 layers" in refused(path, config)


def test_a_missing_or_broken_config(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY)
    (path / "adapter_config.json").unlink()
    assert refused(path, config) == f"adapter 'x': no adapter_config.json in {path}"
    (path / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json cannot be read" in refused(path, config)
    assert refused(tmp_path / "nowhere", config) == f"adapter 'x': {tmp_path / 'nowhere'} is not a directory"


def test_a_missing_or_broken_weights_file(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    message = refused(path, config)
    assert "adapter_model.bin" in message and "pickle" in message and "convert it to adapter_model.safetensors" in message
    (path / "adapter_model.bin").unlink()
    assert refused(path, config) == f"adapter 'x': no adapter_model.safetensors in {path}"
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    assert "adapter_model.safetensors cannot be read" in refused(path, config)
    save_file({}, str(path / "adapter_model.safetensors"))
    assert refused(path, config) == "adapter 'x': adapter_model.safetensors holds no LoRA weights"


def test_an_a_without_its_b_or_the_reverse(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("o_proj",), extra_config={"target_modules": None})
    rewrite(path, lambda t: {n: v for n, v in t.items() if n != "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"})
    assert refused(path, config) == (
        "adapter 'x': layers.1.self_attn.o_proj.lora_A.weight has no matching layers.1.self_attn.o_proj.lora_B.weight")
    path = write_peft_adapter(tmp_path / "b", TINY, targets=("up_proj",))
    rewrite(path, lambda t: {n: v for n, v in t.items() if n != "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"})
    assert "layers.0.mlp.up_proj.lora_B.weight has no matching layers.0.mlp.up_proj.lora_A.weight" in refused(path, config)


def test_names_that_are_not_llama_lora_weights(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("q_proj",))
    rewrite(path, lambda t: dict(t, **{"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(64, np.float32)}))
    assert "which is not a LoRA A or B weight" in refused(path, config)
    path = write_peft_adapter(tmp_path / "b", TINY, targets=("q_proj",))
    rewrite(path, lambda t: {n.replace("self_attn.q_proj", "mlp.q_proj"): v for n, v in t.items()})
    assert "is not at a decoder layer's q_proj (model.layers.N.self_attn.q_proj)" in refused(path, config)
    path = write_peft_adapter(tmp_path / "c", TINY, targets=("q_proj",))
    tensors = stored(path)
    rewrite(path, lambda t: dict(t, **{n.removeprefix("base_model.model."): v for n, v in tensors.items()}))
    assert "holds two lora_A tensors for layers.0.self_attn.q_proj" in refused(path, config)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"bias": "all"}, "adapter 'x': bias 'all' is not supported"),
        ({"bias": "lora_only"}, "adapter 'x': bias 'lora_only' is not supported"),
        ({"fan_in_fan_out": True}, "adapter 'x': fan_in_fan_out is true"),
        ({"modules_to_save": ["lm_head"]}, "adapter 'x': modules_to_save ['lm_head'] is not supported"),
        ({"peft_type": "IA3"}, "adapter 'x': peft_type 'IA3' is not LORA"),
        ({"use_dora": True}, "adapter 'x': use_dora is true"),
        ({"rank_pattern": {"q_proj": 8}}, "adapter 'x': rank_pattern is not supported"),
    ],
)
def test_unsupported_peft_options(tmp_path, config, extra, expected):
    path = write_peft_adapter(tmp_path / "a", TINY, extra_config=extra)
    assert refused(path, config).startswith(expected)


def test_a_config_without_peft_type_or_alpha_is_accepted(tmp_path, config):
    path = write_peft_adapter(tmp_path / "a", TINY, rank=2, targets=("q_proj",))
    raw = json.loads((path / "adapter_config.json").read_text())
    del raw["peft_type"], raw["lora_alpha"]
    (path / "adapter_config.json").write_text(json.dumps(raw))
    assert load(path, config).scale == 8.0 / 2  # PEFT's default lora_alpha


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value(tmp_path, config, bad):
    path = write_peft_adapter(tmp_path / "a", TINY, targets=("gate_proj",))
    name = "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"

    def spoil(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][7, 2] = bad
        return tensors

    rewrite(path, spoil)
    assert refused(path, config) == "adapter 'x': layers.1.mlp.gate_proj.lora_B.weight holds a non-finite value (NaN or infinity)"


def test_merged_weights_change_exactly_the_targeted_matrices(tmp_path, config):
    weights = tiny_weights(VOCAB)
    path = write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=16.0, targets=("q_proj", "k_proj", "down_proj"), layers=[1])
    adapter = load(path, config)
    merged = merged_weights(weights, path)
    assert merged.keys() == weights.keys()
    changed = {f"model.layers.1.{PARENT[t]}.{t}.weight": t for t in ("q_proj", "k_proj", "down_proj")}
    for name, original in weights.items():
        if name not in changed:
            assert merged[name] is original
            continue
        assert merged[name].dtype == np.float32 and merged[name].shape == original.shape
        delta = adapter.delta(1, changed[name]).double().numpy()
        assert np.abs(delta).max() > 1e-3  # the adapter really changes the model
        np.testing.assert_allclose(merged[name].astype(np.float64) - original, delta, rtol=0, atol=1e-6)


# -- the files as untrusted input (#49) --------------------------------------------
# Any API key may name a directory on the server's disk; each file there is
# read only if it is a regular file, and only up to its bound. A refusal
# names the file by its name alone, never the directory it is in.

GUARD_S = 60  # a backstop against a hang, not a timing: a refused FIFO answers at once


def refused_promptly(path: Path, config: ModelConfig, fifos: tuple[Path, ...] = ()) -> str:
    """`refused`, in a thread joined for at most GUARD_S. Should the load
    block on one of ``fifos`` (opened for reading, waiting for a writer),
    a writer comes and goes to let it go, and the test fails."""
    outcome: list = []

    def attempt() -> None:
        try:
            outcome.append(refused(path, config))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread, which raises it
            outcome.append(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(GUARD_S)
        pytest.fail(f"the load was still running {GUARD_S} s later: it blocked on a file")
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_is_refused_at_once(tmp_path, config, file):
    path = write_peft_adapter(tmp_path / "a", TINY)
    fifo = fifo_in_place(path / file)
    message = refused_promptly(path, config, (fifo,))
    assert message == f"adapter 'x': {file} is a FIFO (named pipe), not a regular file"
    assert str(tmp_path) not in message


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_link_to_dev_zero_is_refused_at_once(tmp_path, config, file):
    path = write_peft_adapter(tmp_path / "a", TINY)
    dev_zero_in_place(path / file)
    assert refused_promptly(path, config) == f"adapter 'x': {file} is a character device, not a regular file"


def test_a_directory_or_a_socket_in_a_files_place(tmp_path, config, monkeypatch):
    path = write_peft_adapter(tmp_path / "a", TINY)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.safetensors").mkdir()
    assert refused_promptly(path, config) == "adapter 'x': adapter_model.safetensors is a directory, not a regular file"
    (path / "adapter_config.json").unlink()
    monkeypatch.chdir(path)  # a relative name: a socket's path must be short (108 bytes), tmp_path may not be
    with socket.socket(socket.AF_UNIX) as listening:
        try:
            listening.bind("adapter_config.json")
        except OSError as exc:
            pytest.skip(f"cannot bind a Unix socket in {path}: {exc}")
        assert refused_promptly(path, config) == "adapter 'x': adapter_config.json is a socket, not a regular file"


def test_a_config_over_its_bound(tmp_path, config):
    """A config past MAX_JSON is refused by its size: sparse here, so the
    test writes nothing, and the loader reads nothing of it."""
    path = write_peft_adapter(tmp_path / "a", TINY)
    os.truncate(path / "adapter_config.json", MAX_JSON + 1)
    message = refused_promptly(path, config)
    assert message == f"adapter 'x': adapter_config.json is {MAX_JSON + 1} bytes, more than the {MAX_JSON} trioserve reads for it"
    (path / "adapter_config.json").write_bytes(b"\xff{}")
    assert refused(path, config) == "adapter 'x': adapter_config.json is not UTF-8 text (byte 0)"


def expected_bound(rank: int, modules: list[tuple[int, str]]) -> int:
    """The weights bound worked out here, from FEATURES: 8 bytes a value of
    each A and B, a MiB for the header and 1 KiB per tensor."""
    values = sum(rank * (FEATURES[t][0] + FEATURES[t][1]) for _, t in modules)
    return 8 * values + (1 << 20) + 1024 * 2 * len(modules)


def test_weights_over_the_most_the_adapter_can_hold(tmp_path, config):
    every = [(i, t) for i in range(2) for t in TARGETS]
    assert weights_bound(config, 4, None) == expected_bound(4, every) == 1_142_784
    path = write_peft_adapter(tmp_path / "a", TINY, rank=4, extra_config={"target_modules": None})  # the tensors alone say which
    os.truncate(path / "adapter_model.safetensors", expected_bound(4, every) + 1)
    assert refused_promptly(path, config) == (
        f"adapter 'x': adapter_model.safetensors is {expected_bound(4, every) + 1} bytes, more than the {expected_bound(4, every)} "
        "trioserve reads for it (the most an adapter of rank 4 for every module of this model can hold)"
    )
    # The bound follows the config's rank and targets: one module of rank 2, a few KiB past the header's room.
    path = write_peft_adapter(tmp_path / "b", TINY, rank=2, targets=("q_proj",), layers=[1])
    bound = expected_bound(2, [(1, "q_proj")])
    assert bound == (1 << 20) + 8 * 2 * 128 + 2048
    os.truncate(path / "adapter_model.safetensors", bound + 1)
    assert refused_promptly(path, config) == (
        f"adapter 'x': adapter_model.safetensors is {bound + 1} bytes, more than the {bound} "
        "trioserve reads for it (the most an adapter of rank 2 for the 1 module adapter_config.json targets can hold)"
    )


def test_the_largest_valid_adapter_is_under_its_bound(tmp_path, config):
    """Every module, in float64 (8 bytes a value, the widest dtype), with
    long tensor names: a valid adapter is never turned away by its size."""
    path = write_peft_adapter(tmp_path / "a", TINY, rank=64)
    rewrite(path, lambda t: {n.replace(".weight", ".a_long_adapter_name_as_peft_may_write.weight"): v.astype(np.float64) for n, v in t.items()})
    size = (path / "adapter_model.safetensors").stat().st_size
    assert size > 8 * sum(64 * sum(FEATURES[t]) for t in TARGETS) * 2  # the values alone
    assert size <= weights_bound(config, 64, None)
    adapter = load(path, config)
    assert adapter.rank == 64 and adapter.weights[1]["down_proj"][0].dtype == torch.float32
