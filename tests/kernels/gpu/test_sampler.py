"""The sampler kernel (kernels/gpu/sampler.py) against the reference sampler
(models/sampling.py) with the arithmetic the kernel follows, torch's
(kernels/sampler_math.TORCH; the CPU's own default since #47 is the fixed
order, which the kernel does not follow yet): the same token for every
case, exactly.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py);
the 1,000 random cases go in five launches of 200 rows, one per vocabulary
size. Besides them: the in-kernel Philox draw against `sampling.uniform`,
the kernel's float32 sum against torch's own bit for bit, and two cases
built so that a float32 sum taken in any order but torch's changes the token
(the top-p mass and the draw's block sums)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from trioserve.kernels.gpu import sampler as gpu
from trioserve.kernels.gpu.sampler_math import torch_order_sum, uniform
from trioserve.kernels.sampler_math import TORCH
from trioserve.models import sampling
from trioserve.types import SampleRow, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _uniform_kernel(seed_ptr, index_ptr, out_ptr, R, BLOCK_R: tl.constexpr):
    rows = tl.arange(0, BLOCK_R)
    live = rows < R
    seed = tl.load(seed_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    index = tl.load(index_ptr + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    tl.store(out_ptr + rows, uniform(seed, index, BLOCK_R), mask=live)


@triton.jit
def _sum_kernel(x_ptr, out_ptr, R, n, BLOCK_R: tl.constexpr):
    rows = tl.arange(0, BLOCK_R)
    live = rows < R
    tl.store(out_ptr + rows, torch_order_sum(x_ptr + rows.to(tl.int64) * n, n, live, BLOCK_R), mask=live)


def test_the_kernel_draws_sampling_uniform():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**63 - 1, 2**64 - 1] + [int(v) for v in rng.integers(0, 2**63, 60, dtype=np.uint64)]
    indices = [0, 2**64 - 1, 1, 2**32] + [int(v) for v in rng.integers(0, 2**63, 30, dtype=np.uint64)] + list(range(30))
    out = torch.empty(len(seeds), dtype=torch.float64, device=DEVICE)
    _uniform_kernel[(1,)](gpu._as_int64(seeds, DEVICE), gpu._as_int64(indices, DEVICE), out, len(seeds), BLOCK_R=64)
    assert out.tolist() == [sampling.uniform(s, i) for s, i in zip(seeds, indices, strict=True)]


@pytest.mark.parametrize("n", [*range(1, 41), 63, 64, 65, 255, 256, 257, 300, 513, 1000, 8200])
def test_the_kernel_sums_float32_in_torchs_order(n):
    """Bit for bit torch's CPU sum of a row, on values spread over many
    binades so that any other order rounds differently; 8,200 floats reach
    the second level of torch's cascade."""
    gen = torch.Generator().manual_seed(n)
    x = torch.exp(torch.randn(4, n, generator=gen) * 8)
    out = torch.empty(4, dtype=torch.float32, device=DEVICE)
    _sum_kernel[(1,)](x.to(DEVICE), out, 4, n, BLOCK_R=4)
    assert out.cpu().tolist() == [float(row.sum()) for row in x]


# -- 1,000 random cases ---------------------------------------------------------


def _logits(rng: np.random.Generator, vocab: int) -> np.ndarray:
    kind = rng.integers(0, 7)
    if kind == 0:
        x = rng.standard_normal(vocab) * 3
    elif kind == 1:  # few distinct values: ties everywhere
        x = rng.integers(-3, 3, vocab).astype(np.float64)
    elif kind == 2:  # all equal
        x = np.full(vocab, float(rng.standard_normal()))
    elif kind == 3:  # extremes: a few huge, a few vanishing, some -inf
        x = rng.standard_normal(vocab) * 20
        x[rng.integers(0, vocab, 5)] = 1e4
        x[rng.integers(0, vocab, 5)] = -1e30
        x[rng.integers(0, vocab, 3)] = -np.inf
    elif kind == 4:  # nearly flat
        x = rng.standard_normal(vocab) * 0.01
    elif kind == 5:  # a third of the row tied at the top
        x = rng.standard_normal(vocab) * 5
        x[rng.integers(0, vocab, vocab // 3)] = x.max()
    else:  # a peaked model-like row
        x = rng.standard_normal(vocab) * 2
        x[rng.integers(0, vocab)] += 12
    return x.astype(np.float32)


def _params(rng: np.random.Generator, vocab: int, host_steps: bool) -> SamplingParams:
    bias: tuple[tuple[int, float], ...] = ()
    penalties = {}
    if host_steps and rng.random() < 0.2:
        ids = rng.choice(vocab, 3, replace=False)
        bias = tuple((int(i), float(rng.uniform(-100, 100))) for i in ids)
    if host_steps and rng.random() < 0.2:
        penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.05, 0.5, 0.7, 1.0, 1.3, 2.0])),
        top_k=int(rng.choice([0, 0, 1, 2, 5, 40, vocab - 1, vocab, vocab + 3])),
        top_p=float(rng.choice([1.0, 1.0, 0.9, 0.5, 0.999, 1e-9, 1.0 - float(rng.random())])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3, 1.0, float(rng.random()) * 0.2])),
        logit_bias=bias,
        **penalties,
    )


def _cases(vocab: int, count: int, seed: int, host_steps: bool):
    """logits [count, V], rows, and an allow mask (bool [count, V]) that
    restricts about a third of the rows (to a single token now and then)."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(np.stack([_logits(rng, vocab) for _ in range(count)]))
    rows = []
    for _ in range(count):
        params = _params(rng, vocab, host_steps)
        index = int(rng.integers(0, 2**40)) if rng.random() < 0.5 else int(rng.integers(0, 10))
        history = tuple(int(t) for t in rng.integers(0, vocab, 12)) if params.penalized else ()
        rows.append(SampleRow(params=params, seed=int(rng.integers(0, 2**63)), draw_index=index, history=history))
    allow = torch.ones(count, vocab, dtype=torch.bool)
    for r in np.flatnonzero(rng.random(count) < 0.35):
        keep = rng.random(vocab) < rng.choice([0.02, 0.5, 0.9])
        keep[rng.choice(np.flatnonzero(np.isfinite(logits[r].numpy())))] = True  # one finite logit at least
        allow[r] = torch.from_numpy(keep)
    return logits, rows, allow


def _bitmask(allow: torch.Tensor) -> torch.Tensor:
    """models.guided's int32 bitmask of a bool mask."""
    words = -(-allow.shape[1] // 32)
    bits = np.zeros((allow.shape[0], words * 32), dtype=bool)
    bits[:, : allow.shape[1]] = allow.numpy()
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


@pytest.mark.parametrize(("vocab", "host_steps"), [(50, True), (131, False), (256, True), (257, False), (300, True)])
def test_the_kernel_picks_the_reference_token(vocab, host_steps):
    """200 cases a launch, 1,000 over the five. With host steps (bias and
    penalties on some rows) through `sample_rows` and the int32 bitmask;
    without, through `sample_tokens` and a bool mask."""
    logits, rows, allow = _cases(vocab, 200, seed=vocab, host_steps=host_steps)
    masks = _bitmask(allow)
    expected = [s.token for s in sampling.sample_rows(logits, rows, masks, numerics=TORCH)]
    if host_steps:
        got = [s.token for s in gpu.sample_rows(logits.to(DEVICE), rows, masks)]
    else:
        p = [row.params for row in rows]
        got = gpu.sample_tokens(
            logits.to(DEVICE),
            temperature=[q.temperature for q in p],
            top_k=[q.top_k for q in p],
            top_p=[q.top_p for q in p],
            min_p=[q.min_p for q in p],
            seed=[row.seed for row in rows],
            draw_index=[row.draw_index for row in rows],
            allow=allow.to(DEVICE),
        ).tolist()
    wrong = [(i, rows[i].params, expected[i], got[i]) for i in range(len(rows)) if expected[i] != got[i]]
    assert not wrong, wrong[:3]


def test_gpu_blocking_gives_the_same_tokens(monkeypatch):
    """1024-wide tiles (the GPU's; it runs one row per program, here two to
    save the interpreter's time) on a vocabulary of three tiles, the last
    one ragged."""
    logits, rows, allow = _cases(2100, 6, seed=3, host_steps=False)
    expected = [s.token for s in sampling.sample_rows(logits, rows, _bitmask(allow), numerics=TORCH)]
    monkeypatch.setattr(gpu, "launch_blocks", lambda rows, vocab, device: (2, 1024, 4))
    assert [s.token for s in gpu.sample_rows(logits.to(DEVICE), rows, _bitmask(allow))] == expected


# -- cases built on the edge ----------------------------------------------------


def _exp_agrees(x: torch.Tensor) -> bool:
    """torch's float32 exp equals the correctly rounded one (the kernel's) here."""
    return torch.equal(x.exp(), torch.from_numpy(np.exp(x.double().numpy()).astype(np.float32)))


def _absorbing_block() -> torch.Tensor:
    """256 logits: eight 0s (weight 1) at ids 0-7, then weights just under
    half a unit of 1.0, which torch's lane sums drop where they meet a 1: its
    float32 sum is several units below the exact one."""
    x = torch.full((256,), math.log(0.99 * 2**-24), dtype=torch.float32)
    x[:8] = 0.0
    return x


def test_top_p_mass_is_summed_in_torchs_order():
    """The cut falls exactly on the running sum of the eight 1s: a top_p a
    hair above 8 / mass keeps the 0.25-weight token at id 8, a hair below
    drops it. Both hairs are inside one float32 unit of the mass, so a sum in
    any other order flips one of them; draws above 0.975 then pick id 8 or 7."""
    x = _absorbing_block()
    x[8] = math.log(0.25)
    assert _exp_agrees(x)
    mass = np.float32((x - x.max()).exp().sum())
    above, below = (float(np.nextafter(mass, np.float32(d))) for d in (np.inf, 0))
    mass = float(mass)
    drop, keep = (8 / mass + 8 / above) / 2, (8 / mass + 8 / below) / 2
    assert drop * mass <= 8 < drop * above and below * keep <= 8 < keep * mass
    seed = 12345
    draws = [i for i in range(2000) if sampling.uniform(seed, i) > 0.975][:10]
    rows = [SampleRow(params=SamplingParams(top_p=p), seed=seed, draw_index=i) for p in (drop, keep) for i in draws]
    logits = x.expand(len(rows), -1).contiguous()
    expected = [s.token for s in sampling.sample_rows(logits, rows, numerics=TORCH)]
    assert expected == [7] * len(draws) + [8] * len(draws)
    assert [s.token for s in gpu.sample_rows(logits.to(DEVICE), rows)] == expected


def test_the_draws_block_sums_are_summed_in_torchs_order():
    """Block 0 is the absorbing block, block 1 holds one token (id 300) whose
    weight w is picked, with the draw, so that u * (S + w) lands at or just
    above torch's float32 sum S of block 0: the draw goes to block 1 (id
    300); had block 0 summed to one float32 unit more (as the exact sum
    does, rounded), it would stay in block 0, on a token near its end."""
    x = torch.cat([_absorbing_block(), torch.full((256,), -math.inf)])
    block0 = float(x[:256].exp().sum())
    larger = float(np.nextafter(np.float32(block0), np.float32(np.inf)))
    assert larger < float(np.float32(x[:256].exp().double().sum()))  # the exact sum is larger still

    def flips(u: float, w: float) -> bool:
        return block0 <= u * (block0 + w) and u * (larger + w) < larger

    seed, found = 7, None
    for index in range(3000):
        u = sampling.uniform(seed, index)
        if not 0.85 < u < 0.99:
            continue
        logit = np.float32(math.log(block0 * (1 - u) / u))
        for _ in range(4):
            x[300] = float(logit)
            if flips(u, float(x[300:301].exp())) and _exp_agrees(x[300:301]):
                found = index
                break
            logit = np.nextafter(logit, np.float32(np.inf))
        if found is not None:
            break
    assert found is not None, "no draw lands between the two sums"
    rows = [SampleRow(params=SamplingParams(), seed=seed, draw_index=found)]
    assert [s.token for s in sampling.sample_rows(x[None], rows, numerics=TORCH)] == [300]
    assert [s.token for s in gpu.sample_rows(x[None].to(DEVICE), rows)] == [300]


def test_ties_keep_the_lowest_ids():
    flat = torch.zeros(4, 64)
    rows = [SampleRow(params=SamplingParams(temperature=0.0), seed=1, draw_index=0)]
    rows += [SampleRow(params=SamplingParams(top_k=3), seed=2, draw_index=i) for i in range(3)]
    tokens = [s.token for s in gpu.sample_rows(flat.to(DEVICE), rows)]
    assert tokens[0] == 0 and set(tokens[1:]) <= {0, 1, 2}
    assert tokens == [s.token for s in sampling.sample_rows(flat, rows, numerics=TORCH)]


def test_the_wrapper_returns_what_the_reference_returns():
    """Draw counts and logprobs too (computed with torch from the raw logits)."""
    logits = _cases(90, 6, seed=11, host_steps=True)[0]
    rows = [
        SampleRow(params=SamplingParams(temperature=t, logprobs=True, top_logprobs=n), seed=5, draw_index=i)
        for i, (t, n) in enumerate([(0.0, 0), (0.0, 3), (1.0, 5), (0.7, 0), (1.0, 20), (2.0, 1)])
    ]
    assert gpu.sample_rows(logits.to(DEVICE), rows) == sampling.sample_rows(logits, rows, numerics=TORCH)


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 10, device=DEVICE)
    one = dict(temperature=[1.0] * 2, top_k=[0] * 2, top_p=[1.0] * 2, min_p=[0.0] * 2, seed=[0] * 2, draw_index=[0] * 2)
    with pytest.raises(RuntimeError, match="float32"):
        gpu.sample_tokens(logits.double(), **one)
    with pytest.raises(RuntimeError, match="values of seed"):
        gpu.sample_tokens(logits, **{**one, "seed": [0]})
    with pytest.raises(RuntimeError, match="allow mask"):
        gpu.sample_tokens(logits, **one, allow=torch.ones(2, 9, dtype=torch.bool, device=DEVICE))
    assert gpu.sample_tokens(logits[:0], **{k: [] for k in one}).shape == (0,)
