"""The device thread (actors/device.py): one OS thread for all of an
engine's torch work, reached from trio."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from trioserve.models import step_runner as step_runner_module
from trioserve.actors.device import open_device_thread, release_openmp_threads
from trioserve.config import EngineConfig
from trioserve.engine import open_engine
from trioserve.models.checkpoint import load_checkpoint
from trioserve.models.decoder import DecoderModel
from trioserve.types import GenerateRequest, SamplingParams


async def test_runs_every_call_on_one_thread_of_its_own_and_hands_back_errors():
    async with open_device_thread() as device:
        idents = {await device.run(threading.get_ident) for _ in range(5)}
        assert idents == {device.ident} and device.ident != threading.get_ident()
        assert await device.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await device.run(lambda: 1 / 0)
        assert await device.run(lambda: "still serving") == "still serving"
    assert not any(t.ident == device.ident for t in threading.enumerate())  # ended on exit


async def test_a_cancelled_caller_waits_for_its_call_then_sees_the_cancellation():
    release = threading.Event()
    finished = []

    def slow() -> None:
        release.wait(10)
        finished.append(True)

    async with open_device_thread() as device:
        threading.Timer(0.3, release.set).start()  # well after the deadline below
        started = trio.current_time()
        with trio.move_on_after(0.05) as scope:
            await device.run(slow)
            raise AssertionError("the cancellation was not raised")
        assert scope.cancelled_caught and finished == [True]
        assert trio.current_time() - started >= 0.25  # it waited for the call


def test_releasing_the_openmp_helpers_leaves_torch_working():
    x = torch.randn(512, 512)
    before = x @ x
    assert release_openmp_threads() is True
    assert torch.equal(x @ x, before)


async def test_the_engine_runs_forward_and_sampling_on_its_device_thread(tiny_checkpoints, monkeypatch):
    ckpt = load_checkpoint(tiny_checkpoints["gguf_f32"], dtype=torch.float32)
    seen: dict[str, set[int]] = {"forward": set(), "sample": set()}

    class Watched(DecoderModel):
        def forward(self, batch, cache):
            seen["forward"].add(threading.get_ident())
            return super().forward(batch, cache)

    real_sample = step_runner_module.sample_rows

    def watched_sample(*args, **kwargs):
        seen["sample"].add(threading.get_ident())
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(step_runner_module, "sample_rows", watched_sample)
    model = Watched(ckpt.config, ckpt.weights, batch_invariant=True)
    with trio.fail_after(30):
        async with open_engine(EngineConfig(dtype="float32", kv_cache_bytes=1 << 20, prefill_budget=64, max_num_seqs=4), checkpoint=ckpt, model=model) as engine:
            async with trio.open_nursery() as nursery:
                for seed in range(4):
                    request = GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=1.0, seed=seed))
                    nursery.start_soon(lambda r=request: _drain(engine, r))
    assert len(seen["forward"]) == 1 and seen["forward"] == seen["sample"]
    assert threading.get_ident() not in seen["forward"]


async def _drain(engine, request) -> None:
    async for _ in engine.generate(request):
        pass


def test_without_openmp_helpers_returns_and_raises_what_its_function_does():
    from trioserve.actors.device import without_openmp_helpers

    x = torch.randn(256, 256)
    assert torch.equal(without_openmp_helpers(lambda: x @ x), x @ x)
    with pytest.raises(KeyError):
        without_openmp_helpers(lambda: {}["missing"])
