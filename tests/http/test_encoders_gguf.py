"""BERT encoders from GGUF: tests/families.py's random BertModel, saved as an
HF directory, converted by llama.cpp's own converter (F32), loaded by
trioserve and served for embeddings. The file must give what the directory
gives: the same weights and settings, the same ids ([CLS] text [SEP], as
the HF tokenizer wraps an input and as llama.cpp does), and through the
server the same /v1/embeddings vectors (within 1e-5), which are
transformers' pooled final hidden states; /tokenize and /detokenize on it
agree with the HF tokenizer. Where llama.cpp is built, llama-server's own
embeddings of the same file are a third opinion.

The directory's tokenizer_config.json names all five special tokens, as a
real BERT's does (tests/families.py's names only [CLS] and [SEP]; from
that the converter writes no unknown_token_id, and llama.cpp, as trioserve
now, falls back to id 100, which is not [UNK] there).

Without llama-cpp-python 0.3.36's sdist unpacked in ~/.cache/trioserve
(.ci/llama-cpp-sdist, `make test-tools`) these tests skip."""

from __future__ import annotations

import attrs
import httpx
import numpy as np
import pytest
import torch
import trio

from tests.families import build_bert
from tests.http.conftest import make_settings, start_server
from tests.models.test_wpm_tokenizer import LLAMA_SERVER, LlamaServer, convert_bert, name_special_tokens, needs_converter
from trioserve.models.checkpoint import load_checkpoint

pytestmark = needs_converter
TIMEOUT = 60.0
TEXTS = [
    "the quick brown fox",
    "a tokenizer turns text into numbers",
    "hello, world! how are you today?",
    "The Café served CRÈME brûlée; naïve résumé.",
    "zxqv blorptastic 我想 🦙 [SEP] written as text",
]


@pytest.fixture(scope="module", params=["cls", None], ids=["cls-pooling", "no-pooling-module"])
def bert(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-gguf")
    built = build_bert(root, pooling=request.param)
    name_special_tokens(built["hf"])
    built["tokenizer"].encode_special_tokens = True  # special text in an input is text
    built["gguf"] = convert_bert(built["hf"], root / "bert-f32.gguf")
    return built, request.param


def reference(built, pooling: str | None, text: str) -> np.ndarray:
    ids = built["tokenizer"].encode(text).ids  # with [CLS] and [SEP]
    with torch.no_grad():
        states = built["model"](torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = states[0] if pooling == "cls" else states.mean(0)
    return vector / np.linalg.norm(vector)


def test_the_gguf_loads_as_the_directory(bert):
    """The same tensors bit for bit, the same settings (but two, below),
    the same ids for an input."""
    built, pooling = bert
    gguf, hf = load_checkpoint(built["gguf"], dtype=torch.float32), load_checkpoint(built["hf"], dtype=torch.float32)
    assert sorted(gguf.weights) == sorted(hf.weights)
    for name in hf.weights:
        assert torch.equal(gguf.weights[name], hf.weights[name]), name
    # The file keeps the epsilon as float32 (1e-12 -> 9.99999996e-13), and
    # bert.py's GGUF settings leave tie_embeddings at its default (an
    # encoder has no output head: it reads neither).
    assert gguf.config.rms_eps == float(np.float32(hf.config.rms_eps))
    assert (gguf.config.tie_embeddings, hf.config.tie_embeddings) == (True, False)
    same = attrs.evolve(gguf.config, rms_eps=hf.config.rms_eps, tie_embeddings=hf.config.tie_embeddings)
    assert same == hf.config
    assert gguf.config.architecture == "bert" and gguf.config.pooling == ("cls" if pooling else None)
    for text in TEXTS:
        assert gguf.tokenizer.encode_input(text) == hf.tokenizer.encode_input(text) == built["tokenizer"].encode(text).ids


async def _embed(url: str, texts: list[str]) -> tuple[list[list[float]], dict, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        together = await client.post("/v1/embeddings", json={"input": texts})
        assert together.status_code == 200, together.text
        card = (await client.get("/v1/models")).json()["data"][0]
    body = together.json()
    return [item["embedding"] for item in body["data"]], body["usage"], card


async def test_embeddings_from_the_gguf_are_the_directorys(nursery, bert):
    built, pooling = bert
    from_gguf = await start_server(nursery, make_settings(built["gguf"]))
    from_hf = await start_server(nursery, make_settings(built["hf"]))
    with trio.fail_after(TIMEOUT):
        vectors, usage, card = await _embed(from_gguf, TEXTS)
        theirs, their_usage, _ = await _embed(from_hf, TEXTS)
    for text, vector, other in zip(TEXTS, vectors, theirs):
        np.testing.assert_allclose(np.array(vector), np.array(other), atol=1e-5, err_msg=text)
        np.testing.assert_allclose(np.array(vector), reference(built, pooling, text), atol=1e-5, err_msg=text)
    assert usage == their_usage
    assert usage["prompt_tokens"] == sum(len(built["tokenizer"].encode(t).ids) for t in TEXTS)
    assert card["family"] == "bert" and card["routes"] == ["/v1/embeddings", "/v1/rerank", "/v1/score"]


async def test_tokenize_and_detokenize_on_the_gguf(nursery, bert):
    built, _ = bert
    hf = built["tokenizer"]
    url = await start_server(nursery, make_settings(built["gguf"]))
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for text in TEXTS:
                made = await client.post("/tokenize", json={"prompt": text})
                bare = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
                assert made.status_code == bare.status_code == 200, made.text
                assert made.json()["tokens"] == hf.encode(text).ids
                assert bare.json()["tokens"] == hf.encode(text, add_special_tokens=False).ids
                back = await client.post("/detokenize", json={"tokens": made.json()["tokens"]})
                assert back.json()["prompt"] == hf.decode(hf.encode(text).ids, skip_special_tokens=False)


@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason=f"no llama.cpp build at {LLAMA_SERVER.parent} (llama-server)")
async def test_llama_cpp_embeds_the_file_alike(nursery, bert):
    """llama-server --embedding on the same file (with the file's pooling;
    mean where the file names none, as trioserve then pools), its vectors
    scaled to length 1: trioserve's within 1e-3, with the same number of
    input tokens. Not closer: llama.cpp's BERT graph runs the MLP's GELU as
    the tanh approximation, looked up in a float16 table (ggml-cpu's
    GGML_GELU_FP16), where BertModel and trioserve run erf (about 1e-4
    apart here). The texts spell no
    special token: llama-server's embeddings read "[SEP]" in an input as
    the id, trioserve's as text."""
    built, pooling = bert
    texts = [t.replace(" [SEP]", "") for t in TEXTS]
    url = await start_server(nursery, make_settings(built["gguf"]))
    with trio.fail_after(TIMEOUT):
        vectors, _, _ = await _embed(url, texts)
    extra = () if pooling else ("--pooling", "mean")

    def ask_llama_cpp() -> tuple[list[list[float]], list[int]]:
        with LlamaServer(built["gguf"], "-c", "128", *extra) as server:
            return server.embeddings(texts), [len(server.tokenize(t, add_special=True, parse_special=True)) for t in texts]

    theirs, counts = await trio.to_thread.run_sync(ask_llama_cpp)
    assert counts == [len(built["tokenizer"].encode(t).ids) for t in texts]
    for text, vector, other in zip(texts, vectors, theirs):
        other = np.array(other) / np.linalg.norm(other)
        np.testing.assert_allclose(np.array(vector), other, atol=1e-3, err_msg=text)
