"""The whole forward pass through the seam (kernels/ops.py): the tiny model
with every operation on the Triton kernels (interpreted here) equals the
torch reference forward in float32, on a prompt with a cached prefix and
on decode rows, K/V cache included; and the seam's choices and refusals."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu.conftest import DEVICE
from trioserve.kernels.ops import Kernels, NativeKernels, TritonKernels, select_kernels
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.models.step import SeqChunk, build_step

BLOCK = 4


@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "batch-invariant"])
def test_a_triton_forward_equals_the_reference_forward(tiny_checkpoints, invariant):
    ckpt = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)
    # The Triton model on the GPU where there is one (compiled), else on the
    # CPU (interpreted); the reference, the oracle, always on the CPU.
    devices = {"triton": DEVICE, "reference": torch.device("cpu")}
    models = {name: DecoderModel.from_checkpoint(ckpt, batch_invariant=invariant, kernels=name, device=devices[name]) for name in devices}
    assert isinstance(models["triton"].kernels, TritonKernels) and type(models["reference"].kernels) is Kernels
    caches = {name: m.new_kv_cache(16, BLOCK) for name, m in models.items()}
    steps = [
        # Two prompts, one of them a single token; then the first continued
        # after its cached prefix beside a decode row of the second.
        [SeqChunk([5, 9, 33, 7, 2, 8, 11], 0, [0, 1]), SeqChunk([3], 0, [4])],
        [SeqChunk([17], 1, [4], decode=True), SeqChunk([14, 6, 21], 7, [0, 1, 2])],
        [SeqChunk([9], 2, [4], decode=True), SeqChunk([4], 10, [0, 1, 2], decode=True)],
    ]
    for chunks in steps:
        out = {name: m.forward(build_step(chunks, BLOCK, devices[name], fixed=invariant), caches[name]).cpu() for name, m in models.items()}
        torch.testing.assert_close(out["triton"], out["reference"], atol=1e-4, rtol=1e-4)
        assert torch.equal(out["triton"].argmax(-1), out["reference"].argmax(-1))
    torch.testing.assert_close(caches["triton"].k.cpu(), caches["reference"].k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches["triton"].v.cpu(), caches["reference"].v, atol=1e-5, rtol=1e-5)


def test_the_seam_picks_by_device_and_refuses_triton_without_a_gpu(monkeypatch):
    cpu = torch.device("cpu")
    assert type(select_kernels("reference", cpu, torch.float32, 4, 2, 16)) is Kernels
    auto = select_kernels("auto", cpu, torch.float32, 4, 2, 16)
    assert isinstance(auto, NativeKernels | Kernels) and not isinstance(auto, TritonKernels)
    assert isinstance(select_kernels("auto", cpu, torch.float16, 4, 2, 16), Kernels)  # no C kernels for fp16: torch
    assert not isinstance(select_kernels("auto", cpu, torch.float16, 4, 2, 16), NativeKernels)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--kernels triton needs a CUDA device"):
        select_kernels("triton", cpu, torch.float32, 4, 2, 16)
    with pytest.raises(ValueError, match="kernels must be one of auto, reference, triton"):
        select_kernels("fast", cpu, torch.float32, 4, 2, 16)


def test_kernels_triton_without_a_gpu_is_one_error_line_and_exit_2(tiny_checkpoints):
    """`serve --kernels triton` on this CPU, and a bad TRIOSERVE_KERNELS:
    one line saying why, exit 2."""
    from tests.test_cli import run_cli
    from trioserve.config import settings_from_env

    model = ["--model", str(tiny_checkpoints["gguf_f32"]), "--port", "0"]
    proc = run_cli("serve", *model, "--kernels", "triton", env={"TRITON_INTERPRET": "0"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines()[-1].startswith("trioserve: error: --kernels triton needs a CUDA device (this model is on cpu)"), proc.stderr
    bad = run_cli("serve", *model, env={"TRIOSERVE_KERNELS": "fastest"})
    assert bad.returncode == 2 and bad.stderr.splitlines() == ["trioserve: error: TRIOSERVE_KERNELS: must be one of auto, reference, triton, got 'fastest'"]
    with pytest.raises(ValueError, match="TRIOSERVE_KERNELS: must be one of auto, reference, triton, got 'fastest'"):
        settings_from_env({"TRIOSERVE_KERNELS": "fastest"})
    assert settings_from_env({"TRIOSERVE_KERNELS": "reference"}).engine.kernels == "reference"


def test_generated_tokens_take_the_triton_4_bit_kernel(tiny_checkpoints):
    """A Q4_1 model on the Triton set: decode rows multiply the 4-bit codes
    by the Triton kernel (TritonProjection), and its decode logits agree
    with the C kernels' (which round activations to bf16, hence the
    tolerance) and pick the same tokens."""
    from trioserve.kernels.ops import TritonProjection

    ckpt = load_checkpoint(tiny_checkpoints["gguf_q4_1"], dtype=torch.float32)
    triton_model = DecoderModel.from_checkpoint(ckpt, kernels="triton", device=DEVICE)
    cpu_model = DecoderModel.from_checkpoint(ckpt, activations="bf16")  # the Triton kernel's bf16 activations
    layer = triton_model.layers[0]
    assert isinstance(layer.qkv, TritonProjection) and layer.qkv.packed is not None
    models = {"triton": (triton_model, DEVICE), "cpu": (cpu_model, torch.device("cpu"))}
    caches = {name: m.new_kv_cache(8, BLOCK) for name, (m, _) in models.items()}
    out = {}
    for chunks in ([SeqChunk([5, 9, 33, 7, 2], 0, [0, 1])], [SeqChunk([8], 5, [0, 1], decode=True)]):
        out = {name: m.forward(build_step(chunks, BLOCK, device), caches[name]).cpu() for name, (m, device) in models.items()}
    assert (out["triton"] - out["cpu"]).abs().max() <= 0.02 * out["cpu"].abs().max()
    assert torch.equal(out["triton"].argmax(-1), out["cpu"].argmax(-1))
