"""GGUF files (llama.cpp's format) out: a `Model` written as llama.cpp's converter writes it.

The inverse of `gguf.py`: `convert_hf_to_gguf.py`'s architecture metadata and tensor names,
Q/K rows permuted to llama.cpp's interleaved RoPE layout for the llama architecture, norms and
biases kept F32, tied embeddings as no `output.weight`, and the tokenizer as `tokenizer.ggml.*`
metadata (a byte-level BPE as llama.cpp's "gpt2" model, its pre-tokenizer named as llama.cpp
names it). llama.cpp then runs the same weights specjax does.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoint.gguf import GLOBAL_NAMES, LAYER_NAMES, PERMUTED_QK, permute_qk
from specjax.checkpoint.hf import params_to_hf
from specjax.config import ModelConfig
from specjax.model import Model

__all__ = ["DTYPES", "save_gguf", "gguf_architecture", "pre_tokenizer_name"]

DTYPES = ("F32", "F16", "BF16", "Q8_0")
# specjax model_type -> general.architecture (llama.cpp's converter writes Mistral as llama).
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_TO_GGUF_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}
_TO_GGUF_LAYER = {v: k for k, v in LAYER_NAMES.items()}
# `tokenizer.ggml.pre` names written for each pre-tokenizer, first choice first: the names
# convert_hf_to_gguf.py writes. "smaug-bpe" is Llama 3's split without ignore_merges.
_PRE_NAMES = ("gpt-2", "smollm", "llama-bpe", "smaug-bpe", "qwen2", "qwen35", "tekken",
              "gpt-4o")
# llama.cpp's token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def gguf_architecture(config: ModelConfig) -> str:
    """`general.architecture` for `config`; a config llama.cpp cannot express is a ValueError."""
    arch = _ARCH.get(config.model_type)
    if arch is None:
        raise ValueError(f"model_type={config.model_type!r} has no GGUF architecture; "
                         f"supported: {sorted(_ARCH)}")
    if config.attn_logit_softcap is not None:
        raise ValueError(f"attn_logit_softcap={config.attn_logit_softcap} cannot be written to "
                         f"a {arch} GGUF file")
    if config.qk_norm and arch != "qwen3":
        raise ValueError(f"qk_norm=True with model_type={config.model_type!r}: llama.cpp's {arch} "
                         "architecture has no q/k norm (only qwen3 does)")
    rope = config.rope_scaling_dict.get("rope_type", "default")
    if rope not in ("default", "linear", "yarn"):
        raise ValueError(f"rope_scaling rope_type={rope!r} cannot be written to a GGUF file "
                         "(linear and yarn can)")
    return arch


def save_gguf(model: Model, path: str | os.PathLike, *, dtype: str = "F32") -> Path:
    """Writes `model` to the GGUF file `path` (2-D weights as `dtype`: "F32", "F16", "BF16"
    or "Q8_0"; norms and biases F32) with its tokenizer and chat template; returns the path.

    Q8_0 quantizes with `gguf.quants.quantize`; a weight whose rows are not a whole number of
    32-wide blocks is written F16, as llama.cpp's converter does."""
    import gguf
    from gguf import quants

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    path = Path(path)
    config = model.config
    arch = gguf_architecture(config)
    qtype = gguf.GGMLQuantizationType[dtype]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    # the tokenizer is checked before anything is written
    write_tokenizer = _tokenizer_writer(model, str(path)) if model.tokenizer is not None else None
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_config(writer, config)
    writer.add_file_type(int(file_type))
    if dtype == "Q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if write_tokenizer is not None:
        write_tokenizer(writer)
    if model.chat_template is not None:
        writer.add_chat_template(model.chat_template)

    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for name, x in params_to_hf(config, model.params).items():
        x = np.ascontiguousarray(np.asarray(x, np.float32))
        if arch in PERMUTED_QK:
            for proj, n in heads.items():
                if f".{proj}." in name:
                    x = permute_qk(x, n)
        if x.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), x)
        elif qtype == gguf.GGMLQuantizationType.F16 or x.shape[-1] % gguf.GGML_QUANT_SIZES[
                qtype][0]:
            writer.add_tensor(gguf_name(name), x.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quants.quantize(x, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_name(hf: str) -> str:
    """The Hugging Face tensor name -> llama.cpp's (inverse of `gguf.hf_name`)."""
    if hf in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[hf]
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _TO_GGUF_LAYER:
        return f"blk.{parts[2]}.{_TO_GGUF_LAYER[parts[3]]}"
    raise ValueError(f"tensor {hf!r} has no llama.cpp name in a Llama-family model")


def _write_config(writer, c: ModelConfig) -> None:
    """The `{arch}.*` keys `gguf.config_from_metadata` reads back (and llama.cpp needs)."""
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_layers)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    scaling = c.rope_scaling_dict
    rope = scaling.get("rope_type", "default")
    if rope in ("linear", "yarn"):
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType(rope))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if rope == "yarn":
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))


# --- tokenizer ------------------------------------------------------------------------------------


def _canonical(pre: Any) -> Any:
    """A pre-tokenizer's JSON without what does not change the split (trim_offsets), and a
    one-element Sequence as its element."""
    if isinstance(pre, dict):
        if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
            return _canonical(pre["pretokenizers"][0])
        return {k: _canonical(v) for k, v in pre.items() if k != "trim_offsets"}
    if isinstance(pre, list):
        return [_canonical(v) for v in pre]
    return pre


def _pre_json(pre_tokenizer) -> Any:
    import tokenizers
    from tokenizers import models

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    return json.loads(tok.to_str())["pre_tokenizer"]


def pre_tokenizer_name(tokenizer, source: str = "tokenizer") -> str:
    """The `tokenizer.ggml.pre` name of a byte-level BPE `tokenizers.Tokenizer`'s
    pre-tokenizer: the inverse of gguf_tokenizer's table, so both llama.cpp and specjax split
    text as the tokenizer does. A pre-tokenizer with no name is a ValueError showing it."""
    from specjax.checkpoint.gguf_tokenizer import BYTE_LEVEL_PRE, IGNORE_MERGES

    spec = json.loads(tokenizer.to_str())
    pre = _canonical(spec.get("pre_tokenizer"))
    ignore_merges = bool(spec["model"].get("ignore_merges", False))
    same = [n for n in _PRE_NAMES if _canonical(_pre_json(BYTE_LEVEL_PRE[n]())) == pre]
    if not same:
        raise ValueError(
            f"{source}: its pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))} has no "
            f"llama.cpp tokenizer.ggml.pre name; known: the splits of {', '.join(_PRE_NAMES)}")
    exact = [n for n in same if (n in IGNORE_MERGES) == ignore_merges]
    if not exact:
        warnings.warn(f"{source}: tokenizer.ggml.pre={same[0]!r} splits as this tokenizer does "
                      f"but {'does not ignore' if ignore_merges else 'ignores'} merges for "
                      "whole words in the vocabulary; a few words may tokenize differently",
                      stacklevel=2)
    return (exact or same)[0]


def _tokenizer_writer(model: Model, source: str):
    """A function that writes `tokenizer.ggml.*` for the model's byte-level BPE tokenizer, as
    llama.cpp's converter writes a "gpt2" vocabulary: tokens by id (padded to the model's
    vocab_size with UNUSED "[PADi]"), special added tokens CONTROL, other added tokens
    USER_DEFINED, merges, special ids. Raises ValueError for a tokenizer GGUF cannot hold."""
    tok = model.tokenizer
    spec = json.loads(tok.to_str())
    bpe = spec.get("model") or {}
    if bpe.get("type") != "BPE" or bpe.get("byte_fallback") or bpe.get(
            "continuing_subword_prefix") or bpe.get("end_of_word_suffix"):
        raise ValueError(f"{source}: only byte-level BPE tokenizers can be written to GGUF; "
                         f"this one's model is {bpe.get('type')!r} (byte_fallback="
                         f"{bpe.get('byte_fallback')}, continuing_subword_prefix="
                         f"{bpe.get('continuing_subword_prefix')!r})")
    pre = pre_tokenizer_name(tok, source)
    added = tok.get_added_tokens_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    size = model.config.vocab_size
    if max(vocab.values()) >= size:
        raise ValueError(f"{source}: the tokenizer has id {max(vocab.values())}, outside the "
                         f"model's vocab_size={size}")
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(_CONTROL if added[i].special else _USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    bos = model.config.bos_token_id
    eos = model.config.eos_ids[0] if model.config.eos_ids else None
    ids = {"bos": bos, "eos": eos,
           "pad": (tok.padding or {}).get("pad_id"),
           "unk": vocab.get(bpe["unk_token"]) if bpe.get("unk_token") is not None else None}
    # what the tokenizer's post-processor adds around a text
    with_special = tok.encode("a").ids
    plain = tok.encode("a", add_special_tokens=False).ids
    add_bos = bos is not None and with_special[:1] == [bos] != plain[:1]
    add_eos = eos is not None and with_special[-1:] == [eos] != plain[-1:]

    def write(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        for name, value in ids.items():
            if value is not None:
                getattr(writer, f"add_{name}_token_id")(int(value))
        writer.add_add_bos_token(add_bos)
        writer.add_add_eos_token(add_eos)
    return write
