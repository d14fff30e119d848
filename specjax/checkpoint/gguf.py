"""GGUF files (llama.cpp's format) in: architecture metadata, dequantized tensors, tokenizer.

Read with the `gguf` package, llama.cpp's own reader: every type `gguf.quants` can
dequantize is accepted. llama.cpp's converter renames tensors (`blk.0.attn_q.weight`)
and, for the Llama architecture, permutes the rows of Q and K to its interleaved RoPE
layout; both are undone here so the params equal those of the Hugging Face checkpoint
the file was converted from. The tokenizer is rebuilt from the metadata
(`gguf_tokenizer.py`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoint.hf import check_hf_tensors, empty_params, hf_names, place_tensor
from specjax.config import ModelConfig
from specjax.model import Model

# general.architecture -> specjax model_type. Mistral files usually say "llama".
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose converter permutes Q/K rows (llama.cpp's LLAMA_ROPE_TYPE_NORM);
# qwen2/qwen3 keep HF's rotate-half layout (NEOX) and are stored as they are.
PERMUTED_QK = {"llama", "mistral"}

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def find_gguf(directory: Path) -> Path | None:
    """The one `.gguf` file in `directory` (None if there is none)."""
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds {len(files)} .gguf files "
                         f"({', '.join(f.name for f in files)}); pass the file itself")
    return files[0] if files else None


@functools.cache
def reader_class():
    """`gguf.GGUFReader`, its byte slicing on a plain ndarray view of its memory map.

    The reader slices `self.data` (an `np.memmap`) twice per metadata string; numpy's
    memmap subclass runs Python on every slice, which for SmolLM2's 49,152 tokens and
    48,900 merges is ~3.5 of the ~5 s it takes to open the file. The view reads the same
    mapped bytes (read-only) without it. Only the attribute changes: the parsing is the
    library's."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._bytes

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._mapped = mapped  # the map itself, as the library holds it
            self._bytes = mapped.view(np.ndarray)

    return Reader


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path`; a truncated or corrupt file is a clear error."""
    try:
        return reader_class()(str(path))
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as e:
        # GGUFReader raises bare ValueError/IndexError from its struct parsing, or
        # numpy's memmap error when a tensor runs past the end of the file.
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from e


def metadata(reader) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (str, int, float, bool, lists).
    float32 scalars come back as the shortest decimal that rounds to them (1e-06, not
    9.99999997e-07), which is what the converted config.json said."""
    import gguf

    out = {}
    for k, f in reader.fields.items():
        value = f.contents()
        if f.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        out[k] = value
    return out


def _get(meta: Mapping[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise ValueError(f"{source}: metadata key {key!r} is missing")
    return default


def config_from_metadata(meta: Mapping[str, Any], tensor_names: set[str],
                         source: str) -> ModelConfig:
    """GGUF metadata (and which tensors exist) -> `ModelConfig`."""
    arch = _get(meta, "general.architecture", source)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: general.architecture={arch!r} is not supported; "
                         f"specjax reads {sorted(ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1's RoPE scaling is stored as precomputed per-frequency factors, not
        # as the rope_scaling parameters ModelConfig takes.
        raise ValueError(f"{source}: tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling) "
                         "is not supported; load the Hugging Face checkpoint instead")
    g = lambda key, default=...: _get(meta, f"{arch}.{key}", source, default)  # noqa: E731
    num_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // num_heads))
    vocab = g("vocab_size", None)
    if vocab is None:
        vocab = len(_get(meta, "tokenizer.ggml.tokens", source))
    scaling = None
    rope_type = g("rope.scaling.type", "none")
    if rope_type not in ("none", None):
        if rope_type not in ("linear", "yarn"):
            raise ValueError(f"{source}: {arch}.rope.scaling.type={rope_type!r} is not "
                             "supported; expected linear or yarn")
        scaling = {"rope_type": rope_type, "factor": float(g("rope.scaling.factor"))}
        if rope_type == "yarn":
            scaling["original_max_position_embeddings"] = int(
                g("rope.scaling.original_context_length"))
        scaling = tuple(sorted(scaling.items()))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=num_heads, num_kv_heads=int(g("attention.head_count_kv", num_heads)),
        head_dim=head_dim, max_position_embeddings=int(g("context_length", 2048)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        sliding_window=(int(g("attention.sliding_window")) if f"{arch}.attention.sliding_window"
                        in meta else None),
        model_type=ARCHITECTURES[arch],
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos))


def hf_name(gguf_name: str, source: str) -> str:
    """llama.cpp's tensor name -> the Hugging Face name (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"{source}: tensor {gguf_name!r} has no Hugging Face counterpart in a "
                     "Llama-family model")


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rows [heads, 2, H/2] (HF's rotate-half order) to
    [heads, H/2, 2] (interleaved pairs). w: [heads*H, ...] (weight or bias)."""
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, heads)`: rows [heads, H/2, 2] back to HF's
    [heads, 2, H/2] (rotate-half) order. w: [heads*H, ...] (weight or bias)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def dequantize(tensor, source: str) -> np.ndarray:
    """One `gguf.ReaderTensor` -> float32 numpy array in numpy (row-major) order."""
    from gguf import quants

    qtype = tensor.tensor_type
    try:
        out = quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"{source}: tensor {tensor.name!r} has quantization type "
                         f"{qtype.name}, which gguf.quants cannot dequantize") from e
    # The reader gives shapes in numpy order (ne reversed); 1-D tensors come out [n].
    want = tuple(int(n) for n in reversed(tensor.shape))
    out = np.asarray(out, np.float32)
    if out.shape != want:
        out = out.reshape(want)
    return out


def read_params(reader, config: ModelConfig, arch: str, source: str, dtype) -> Any:
    """The params as host (numpy) arrays of `dtype`, filled one tensor at a time
    (dequantized, renamed to HF, un-permuted, cast), so that loading holds one float32
    tensor beside the params rather than the whole model in float32. Names and shapes
    are checked before anything is dequantized."""
    named = {hf_name(t.name, source): t for t in reader.tensors}
    check_hf_tensors(config, {k: tuple(int(n) for n in reversed(t.shape))
                              for k, t in named.items()}, {k: source for k in named})
    names = hf_names(config)
    params = empty_params(config, dtype)
    for name, t in named.items():
        if name not in names:  # what check_hf_tensors lets pass: a tied model's lm_head
            continue
        x = dequantize(t, source)
        if arch in PERMUTED_QK:
            if ".q_proj." in name:
                x = unpermute_qk(x, config.num_heads)
            elif ".k_proj." in name:
                x = unpermute_qk(x, config.num_kv_heads)
        place_tensor(params, names, name, x)
    return params


def load_gguf(path: str | os.PathLike, dtype=None, *, mesh=None) -> Model:
    """A GGUF file -> `Model` (params dequantized, then cast to `dtype`, float32 by
    default). `mesh` shards the loaded params as `specjax.shard_model` does."""
    path = Path(path)
    source = str(path)
    reader = open_gguf(path)
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, names, source)
    dtype = "float32" if dtype is None else str(jnp.dtype(dtype))
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    config = config.replace(dtype=dtype)
    params = read_params(reader, config, meta["general.architecture"], source,
                         jnp.dtype(dtype))
    tok = None
    if "tokenizer.ggml.model" in meta:
        from specjax.checkpoint.gguf_tokenizer import tokenizer_from_metadata
        tok = tokenizer_from_metadata(meta, source)
    if mesh is None:
        params = jax.tree.map(jnp.asarray, params)
    else:  # each host buffer straight onto its shards, never whole on one device
        from specjax.sharding.rules import shard_params
        params = shard_params(params, mesh, config=config)
    return Model(config, params, tok.tokenizer if tok else None,
                 chat_template=tok.chat_template if tok else None)
