"""Every GGUF type trioserve reads as codes or 16-bit bits (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16), written by the tests from
the tiny random Llama, served through the real HTTP server on 127.0.0.1:
the greedy tokens of the tiny model's test prompts agree with those of the
float32 reference, an F32 GGUF of the same file's tensors as the gguf
package dequantizes them, served the same way.

Every 2-D tensor, the embedding and the output head included, is in the
type under test (as `llama-quantize --pure` writes a file): the head runs on
that type's codes too. Norms stay F32. The K-quants take rows of a multiple
of 256 inputs, so their model is the tiny one widened to hidden and FFN 256
(`tiny_weights(shape=...)`); the other types use the tiny model's shape."""

from __future__ import annotations

import gguf
import httpx
import numpy as np
import pytest
import trio

from tests.http.conftest import MAX_MODEL_LEN, MODEL_NAME, make_settings, start_server
from tests.http.test_server import PROMPTS
from tests.tiny_model import TINY, tiny_weights, write_gguf
from tests.tiny_tokenizer import train_tiny_tokenizer
from trioserve.kernels import native, native_build

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS, Q.F16, Q.BF16)
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 256}  # the smallest K-quant rows: one super-block
# How each type's layer matrices and head are held ("compute" in /v1/models).
KIND = {Q.Q4_0: "4-bit", Q.Q4_1: "4-bit", Q.Q4_K: "4-bit", Q.Q8_0: "8-bit", Q.F16: "16-bit", Q.BF16: "16-bit"}
MAX_TOKENS = 12
TOP = 5  # alternatives asked for with each token
# With int8 activations (the default wherever their C kernels run) the codes
# do not compute float32's logits exactly: each row's inputs are rounded to 8
# bits a block of 32 (docs/kernels.md). On this tiny model that moves a
# token's log-probability by up to 0.14 (measured over three seeds and every
# quantized type; Q8_0 0.04), and its distributions are flat (the best token
# ~3%, the runner-up often within 0.05), so a greedy reply may leave
# float32's at a near tie. As tests/models/test_k_quants.py and
# test_q8_0_codes.py accept (logits within the 8-bit inputs' reach, float32's
# pick at 7 of 8 teacher-forced steps), a reply is compared token by token up
# to where it first differs (until there both servers saw the same context):
# the shared alternatives' log-probabilities agree within REACH, the pick
# that differs is one float32 itself nearly ties (within REACH of its best;
# 0.10 the most measured), and at least 7 of 8 compared picks are float32's
# (seed 0: 58 of 63 the fewest, Q4_1). A wrong block layout or scale moves
# the logits by far more. F16 and BF16 run float32 arithmetic on the file's
# own values: their replies are float32's, token for token.
REACH = 0.25
EXACT = 1e-3  # F16/BF16: float32 rounding only (the 16-bit kernel sums in another order)


def _kv_cache_bytes(shape: dict) -> int:
    """Room for two full-context requests of ``shape`` in float32."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 4
    return 2 * MAX_MODEL_LEN * per_token


def _dequantized_copy(source, path):
    """An F32 GGUF of ``source``: the same metadata, and every tensor as
    `gguf.quants.dequantize` reads it (the file's Q/K row order kept)."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype, field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(n) for n in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per type: (its GGUF, the F32 GGUF of its dequantized tensors, the model's shape)."""
    tokenizer = train_tiny_tokenizer()
    vocab = tokenizer.get_vocab_size()
    weights = {"tiny": tiny_weights(vocab, seed=0), "wide": tiny_weights(vocab, seed=0, shape=WIDE)}
    root = tmp_path_factory.mktemp("types")
    out = {}
    for qtype in TYPES:
        which, shape = ("wide", WIDE) if qtype in K_QUANTS else ("tiny", TINY)
        path = write_gguf(root / f"tiny-{qtype.name}.gguf", weights[which], tokenizer, qtype=qtype, shape=shape)
        out[qtype] = (path, _dequantized_copy(path, root / f"tiny-{qtype.name}-dequantized-f32.gguf"), shape)
    return out


async def _serve_greedy(path, shape: dict) -> tuple[dict, list[list[dict]]]:
    """Serve ``path`` on a server of its own, send every prompt as a greedy
    chat request, stop the server; its compute card, and each reply's
    logprobs entries (a token's bytes, its log-probability, the best TOP)."""
    async with trio.open_nursery() as nursery:
        url = await start_server(nursery, make_settings(path, kv_cache_bytes=_kv_cache_bytes(shape)))
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            response = await client.get(f"/v1/models/{MODEL_NAME}")
            assert response.status_code == 200, response.text
            card = response.json()["compute"]
            replies = []
            for prompt in PROMPTS:
                body = {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": True,
                    "top_logprobs": TOP,
                }
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                replies.append(response.json()["choices"][0]["logprobs"]["content"])
        nursery.cancel_scope.cancel()
    return card, replies


def _top(entry: dict) -> dict[bytes, float]:
    return {bytes(t["bytes"]): t["logprob"] for t in entry["top_logprobs"]}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
async def test_a_served_file_of_each_type_picks_the_float32_models_greedy_tokens(files, qtype):
    exact = qtype in (Q.F16, Q.BF16)
    if native_build.library() is None:
        pytest.skip("the C kernels do not build here (no C compiler)")
    if not exact and not native.int4_q8_supported(16, 32):
        pytest.skip("no int8-activation C kernel here: the codes would run dense")
    path, reference_path, shape = files[qtype]
    with trio.fail_after(60):
        card, got = await _serve_greedy(path, shape)
        reference_card, want = await _serve_greedy(reference_path, shape)
    # The file ran on its own codes (or 16-bit bits), head included; the reference dense.
    kind = KIND.get(qtype, "6-bit")  # Q5_0, Q5_1, Q5_K and Q6_K: the 5- and 6-bit codes' kernel
    assert card["weights"] == {"layers": {kind: 4 * shape["num_hidden_layers"]}, "head": kind}, card
    assert reference_card["weights"] == {"layers": {"dense": 4 * shape["num_hidden_layers"]}, "head": "dense"}, reference_card
    assert card["activations"] == ("bf16" if exact else "int8") and reference_card["activations"] == "bf16"
    assert all(len(reply) == MAX_TOKENS for reply in got + want)
    compared = agreed = 0
    parted = []  # (prompt, where, float32's log-probability gap to the pick that differs)
    for p, (reply, reference) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(reply, reference)):  # the same context at every step compared
            compared += 1
            mine, theirs = _top(a), _top(b)
            shared = mine.keys() & theirs.keys()
            assert len(shared) >= 2, f"prompt {p} token {i}: the two servers' best {TOP} share {len(shared)} tokens"
            drift = max(abs(mine[t] - theirs[t]) for t in shared)
            assert drift <= (EXACT if exact else REACH), f"prompt {p} token {i}: log-probabilities {drift:.4f} apart"
            if a["bytes"] == b["bytes"]:
                agreed += 1
                continue
            pick = bytes(a["bytes"])
            assert pick in theirs, f"prompt {p} token {i}: {pick!r} is not among float32's best {TOP}: {b}"
            parted.append((p, i, round(b["logprob"] - theirs[pick], 4)))
            break
    print(f"{qtype.name}: {agreed} of {compared} compared picks float32's; parted (prompt, token, gap): {parted}")
    if exact:
        assert not parted and agreed == MAX_TOKENS * len(PROMPTS), parted
        return
    assert all(gap <= REACH for _, _, gap in parted), f"a pick float32 does not nearly tie: {parted}"
    assert agreed * 8 >= 7 * compared, f"float32's pick at {agreed} of {compared} steps; parted: {parted}"
