"""specjax.load on GGUF files: metadata -> config, every quant type dequantized as
gguf.quants does, Q/K un-permuted, logits equal to the HF directory of the same weights
(and to transformers' own GGUF loader), and errors that name the file and tensor or key."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

import specjax
from specjax.checkpoint import gguf as sg
from tests.gguf_files import QT, TINY, write_gguf
from tests.hf_models import FAMILIES, PARITY_ATOL, hf_logits, state_dict_np, tiny_hf

TOKENS = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 11))
# Every type the loader is asked to read (the list, plus Q5_0/Q5_1).
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def _hf_dir(path, hf_config: dict, tensors: dict[str, np.ndarray], family: str):
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config, model_type=family, architectures=[FAMILIES[family][1].__name__],
               torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path


def _pair(tmp_path, family="llama", qtype="F32", seed=0, **overrides):
    """(gguf file, HF directory) holding the same weights."""
    hf = tiny_hf(family, seed=seed, **{**TINY, **overrides})
    cfg = {**TINY, **overrides}
    if hf.config.tie_word_embeddings:
        cfg["tie_word_embeddings"] = True
    tensors = {k: v for k, v in state_dict_np(hf).items()
               if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")}
    arch = "llama" if family == "mistral" else family
    extra = {"sliding_window": cfg["sliding_window"]} if cfg.get("sliding_window") else None
    exact = write_gguf(tmp_path / f"{family}-{qtype}.gguf", tensors, cfg, arch, QT[qtype],
                       seed, permute_qk=arch == "llama", extra=extra)
    return tmp_path / f"{family}-{qtype}.gguf", _hf_dir(tmp_path / "hf", cfg, exact, family)


def _same_params(a, b):
    import jax
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_quant_type_matches_hf_dir(tmp_path, qtype):
    path, hf_dir = _pair(tmp_path, qtype=qtype)
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:  # the loader's dequantization is gguf.quants' own
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed([int(n) for n in t.shape])))
        np.testing.assert_array_equal(sg.dequantize(t, str(path)), want)
    from_gguf, from_hf = specjax.load(path), specjax.load(hf_dir)
    assert from_gguf.config == from_hf.config.replace(
        max_position_embeddings=from_gguf.config.max_position_embeddings)
    _same_params(from_gguf.params, from_hf.params)
    np.testing.assert_array_equal(np.asarray(specjax.forward(from_gguf, TOKENS)),
                                  np.asarray(specjax.forward(from_hf, TOKENS)))


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
])
def test_families_match_transformers(tmp_path, family, overrides):
    """Config from metadata and the forward, against transformers on the HF weights."""
    path, hf_dir = _pair(tmp_path, family, "Q8_0", **overrides)
    model = specjax.load(path)
    c = model.config
    assert (c.qkv_bias, c.qk_norm, c.tie_word_embeddings) == (
        family == "qwen2", family == "qwen3", bool(overrides.get("tie_word_embeddings")))
    assert c.sliding_window == overrides.get("sliding_window")
    assert c.head_dim == overrides.get("head_dim", TINY["hidden_size"] // 4)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    np.testing.assert_allclose(np.asarray(specjax.forward(model, TOKENS)),
                               hf_logits(ref, TOKENS).logits.numpy(),
                               atol=PARITY_ATOL["float32"], rtol=0)


def test_llama_permutation_matches_transformers_gguf_loader(tmp_path):
    """transformers reads the same file with its own un-permutation: the convention the
    test writer follows is llama.cpp's."""
    path, _ = _pair(tmp_path, "llama", "F32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    np.testing.assert_allclose(np.asarray(specjax.forward(specjax.load(path), TOKENS)),
                               hf_logits(ref, TOKENS).logits.numpy(),
                               atol=PARITY_ATOL["float32"], rtol=0)


def test_unpermute_inverts_permute():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    np.testing.assert_array_equal(sg.unpermute_qk(sg.permute_qk(w, 8), 8), w)
    assert not np.array_equal(sg.permute_qk(w, 8), w)


def test_directory_with_one_gguf_and_dtype(tmp_path):
    path, _ = _pair(tmp_path, qtype="Q8_0")
    shutil.rmtree(tmp_path / "hf")
    model = specjax.load(tmp_path, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert model.params["norm"]["weight"].dtype == np.dtype("bfloat16")
    shutil.copy(path, tmp_path / "second.gguf")
    with pytest.raises(ValueError, match="2 .gguf files"):
        specjax.load(tmp_path)


def test_truncated_and_corrupt_files(tmp_path):
    path, _ = _pair(tmp_path, qtype="Q4_0")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf.*truncated or corrupt"):
        specjax.load(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + data[7:200])
    with pytest.raises(ValueError, match="bad.gguf.*truncated or corrupt"):
        specjax.load(bad)
    with pytest.raises(ValueError, match="not a .gguf file"):
        specjax.load(tmp_path / "hf" / "config.json")


def _rewrite(src, dst, *, arch=None, drop_key=None, add_tensor=None, retype=None):
    """A copy of `src` with its architecture, one key, or tensors changed."""
    reader = gguf.GGUFReader(str(src))
    meta = sg.metadata(reader)
    writer = gguf.GGUFWriter(str(dst), arch or meta["general.architecture"])
    old_arch = meta["general.architecture"]
    for k, field in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k == drop_key:
            continue
        key = k.replace(f"{old_arch}.", f"{arch}.", 1) if arch else k
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), vtype)
    for t in reader.tensors:
        qtype = t.tensor_type
        data = np.asarray(t.data)
        if retype and t.name == retype[0]:
            qtype = retype[1]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows = int(np.prod([int(n) for n in t.shape[1:]]))
            data = np.zeros((rows, int(t.shape[0]) // block * size), np.uint8)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    if add_tensor:
        writer.add_tensor(add_tensor, np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture_quant_and_keys_are_named(tmp_path):
    path, _ = _pair(tmp_path, qtype="Q8_0")
    with pytest.raises(ValueError, match="general.architecture='gemma3' is not supported"):
        specjax.load(_rewrite(path, tmp_path / "a.gguf", arch="gemma3"))
    with pytest.raises(ValueError, match="'llama.block_count' is missing"):
        specjax.load(_rewrite(path, tmp_path / "b.gguf", drop_key="llama.block_count"))
    with pytest.raises(ValueError, match="c.gguf: tensor 'blk.0.attn_q.weight' has "
                                         "quantization type Q8_K"):
        specjax.load(_rewrite(path, tmp_path / "c.gguf",
                              retype=("blk.0.attn_q.weight", QT.Q8_K)))
    with pytest.raises(ValueError, match="d.gguf: tensor 'blk.0.ssm_a' has no Hugging Face"):
        specjax.load(_rewrite(path, tmp_path / "d.gguf", add_tensor="blk.0.ssm_a"))
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        specjax.load(_rewrite(path, tmp_path / "e.gguf", add_tensor="rope_freqs.weight"))
