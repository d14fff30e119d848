"""Tiny GGUF files for the tests, written with `gguf.GGUFWriter` the way llama.cpp's
converter writes them (tensor names, Q/K row permutation for Llama, quantized 2-D
weights, F32 norms), beside the Hugging Face tensors they stand for. Unlike
`specjax.save_gguf` they take any quant type, K-quants included (random blocks)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from specjax.checkpoint.gguf import permute_qk as permute
from specjax.checkpoint.gguf_write import gguf_name

QT = gguf.GGMLQuantizationType
# The tiny model's widths are multiples of 256 so every 2-D weight splits into K-quant
# super-blocks (QK_K = 256) as well as 32-wide blocks.
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0)
# Byte offsets of the float16 scales in one block of the K-quants gguf cannot quantize
# (ggml-common.h's block_q4_K / block_q5_K / block_q6_K); the rest of a block is any bits.
_K_SCALES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
# The name map and the Q/K permutation are the library's (`gguf_write.gguf_name`,
# `gguf.permute_qk`): transformers' own GGUF loader reading these files
# (tests/test_gguf.py) is what checks that they are llama.cpp's.


def quantized(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """w [rows, cols] float32 -> GGUF block bytes of `qtype` (uint8 [rows, bytes]); for
    the K-quants gguf cannot quantize, random blocks with small finite scales."""
    if qtype in (QT.F32, QT.F16) or qtype in quants._type_traits and qtype not in _K_SCALES:
        return quants.quantize(w.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for off in _K_SCALES[qtype]:
        scale = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off:off + 2] = scale[..., None].view(np.uint8).reshape(
            *blocks.shape[:2], 2)
    return blocks.reshape(w.shape[0], -1)


def write_gguf(path: Path, hf_tensors: dict[str, np.ndarray], hf_config: dict, arch: str,
               qtype, seed: int = 0, *, permute_qk: bool = True,
               extra: dict | None = None) -> dict[str, np.ndarray]:
    """Writes `hf_tensors` as a GGUF file; returns the HF tensors the file holds exactly
    (2-D weights after quantization round trip), to write beside it as a HF directory."""
    rng = np.random.default_rng(seed)
    c = hf_config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    if c.get("head_dim"):
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    for key, value in (extra or {}).items():
        getattr(writer, f"add_{key}")(value)
    exact = {}
    for name, w in hf_tensors.items():
        if w.ndim == 2:
            q = quantized(w, qtype, rng)
            exact[name] = quants.dequantize(q, qtype).astype(np.float32).reshape(w.shape)
        else:
            q = exact[name] = w.astype(np.float32)
        heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
        for proj, n in heads.items():
            if permute_qk and f".{proj}." in name:
                q = permute(q, n)  # rows only: quant blocks lie along a row
        writer.add_tensor(gguf_name(name), q, raw_dtype=qtype if w.ndim == 2 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return exact
