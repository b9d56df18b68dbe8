"""The Triton kernel tests run two ways. Here, without a GPU, under Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
On a machine with a CUDA GPU and TRITON_INTERPRET=0 (bench/gpu_check.sh),
compiled: the tests still build their inputs on the CPU, so every public
function of the kernel modules is wrapped to run on the GPU. CPU tensors
go in as CUDA copies, whatever the kernel wrote into them in place
(caches, the residual stream) is copied back, and results come back to
the CPU; packed weight records (attrs, with a ``to``) are moved the same
way. A call with GPU tensors already (the model on cuda) runs as it is.
Under the interpreter nothing is wrapped."""

from __future__ import annotations

import functools
import importlib
import inspect
import os

import attrs
import pytest
import torch

MODULES = ("attention", "elementwise", "quant_matmul", "sampler")
NATIVE = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "") in ("", "0")
DEVICE = torch.device("cuda") if NATIVE else torch.device("cpu")


def _to_device(value, copies: list):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        moved = value.to(DEVICE)
        copies.append((value, moved))
        return moved
    if attrs.has(type(value)) and hasattr(value, "to"):
        return value.to(DEVICE)
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, copies) for v in value)
    return value


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def on_gpu(fn):
    """``fn`` run on the GPU for CPU arguments (see the module docstring)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        copies: list = []
        args = tuple(_to_device(a, copies) for a in args)
        kwargs = {k: _to_device(v, copies) for k, v in kwargs.items()}
        result = fn(*args, **kwargs)
        if not copies:  # called with GPU tensors already (the model): as it is
            return result
        for original, moved in copies:
            original.copy_(moved)  # what the kernel wrote in place
        return _to_cpu(result)

    return run


@pytest.fixture(autouse=True)
def kernels_on_the_gpu(monkeypatch):
    """Compiled on a GPU: each kernel module's public functions wrapped."""
    if not NATIVE:
        return
    for name in MODULES:
        try:
            module = importlib.import_module(f"trioserve.kernels.gpu.{name}")
        except ImportError:
            continue
        for attr, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not attr.startswith("_"):
                monkeypatch.setattr(module, attr, on_gpu(fn))
