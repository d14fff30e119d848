"""specjax.checkpoint: exact HF and orbax round trips, and errors that name file and tensor."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

import specjax
from specjax.config import ModelConfig
from tests.hf_models import FAMILIES, VOCAB, hf_logits, tiny_hf

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 9))


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


def _read_dir(path: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _assert_bitwise(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def _assert_same_params(p, q):
    assert jax.tree.structure(p) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@functools.lru_cache(maxsize=None)
def _hf_dir(root: Path, family: str, tie: bool, window: int | None = None) -> Path:
    """A save_pretrained directory of a tiny random `family` model (+ a tokenizer)."""
    path = root / f"{family}-tie{tie}-window{window}"
    overrides = {"head_dim": 16} if family == "qwen3" else {}
    if window is not None:
        overrides.update(sliding_window=window)
        if family != "mistral":
            overrides.update(use_sliding_window=True, max_window_layers=0)
    tiny_hf(family, seed=0, tie_word_embeddings=tie, **overrides).save_pretrained(
        path, safe_serialization=True)
    _tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
@pytest.mark.parametrize("family, tie, window", [
    ("llama", False, None), ("llama", True, None), ("qwen2", False, None), ("qwen3", True, None),
    ("mistral", False, 4), ("qwen2", False, 4)])
def test_hf_specjax_hf_specjax_is_exact(hf_root, tmp_path, family, tie, window, max_shard_bytes):
    src = _hf_dir(hf_root, family, tie, window)
    first = specjax.load(src)
    specjax.save_hf(first, tmp_path, max_shard_bytes=max_shard_bytes)
    _assert_bitwise(_read_dir(tmp_path), _read_dir(src))
    second = specjax.load(tmp_path)
    assert second.config == first.config
    _assert_same_params(second.params, first.params)
    assert second.tokenizer.encode("w5 w7").ids == [5, 7]
    index = tmp_path / "model.safetensors.index.json"
    if max_shard_bytes is None:
        assert not index.exists() and (tmp_path / "model.safetensors").exists()
    else:
        meta = json.loads(index.read_text())
        tensors = _read_dir(tmp_path)
        assert sorted(meta["weight_map"]) == sorted(tensors)
        assert meta["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
        shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
        assert len(shards) > 1 and {p.name for p in shards} == set(meta["weight_map"].values())
        for shard in shards:
            part = load_file(str(shard))
            assert all(meta["weight_map"][k] == shard.name for k in part)
            assert len(part) == 1 or sum(v.nbytes for v in part.values()) <= max_shard_bytes
    # transformers reads what save_hf wrote and computes the very same logits.
    model_cls = FAMILIES[family][1]
    ref = hf_logits(model_cls.from_pretrained(src).eval(), TOKENS).logits
    back = hf_logits(model_cls.from_pretrained(tmp_path).eval(), TOKENS).logits
    assert torch.equal(ref, back)


def test_orbax_save_then_load_is_exact(hf_root, tmp_path):
    model = specjax.load(_hf_dir(hf_root, "qwen2", False))
    specjax.save_orbax(model, tmp_path / "ckpt")
    back = specjax.load(tmp_path / "ckpt")
    assert back.config == model.config
    _assert_same_params(back.params, model.params)
    assert back.tokenizer.encode("w3").ids == [3]
    np.testing.assert_array_equal(np.asarray(specjax.forward(back, TOKENS)),
                                  np.asarray(specjax.forward(model, TOKENS)))
    restored = specjax.restore_orbax(tmp_path / "ckpt" / "params", model.config)
    _assert_same_params(restored, model.params)


def test_orbax_restore_with_wrong_config_names_the_path(hf_root, tmp_path):
    model = specjax.load(_hf_dir(hf_root, "llama", False))
    specjax.save_orbax(model, tmp_path)
    wrong = model.config.replace(intermediate_size=model.config.intermediate_size * 2)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'params'}: orbax params do not match "
                                         r"the config: param \['layers'\]\['mlp'\]\['down_proj'\]"
                                         r"\['kernel'\] has shape \(2, 64, 32\) in the checkpoint, "
                                         r"the config expects \(2, 128, 32\)"):
        specjax.restore_orbax(tmp_path / "params", wrong)


# --- errors ------------------------------------------------------------------------------


@pytest.fixture
def ckpt(hf_root, tmp_path) -> Path:
    """A writable copy of a llama checkpoint directory."""
    dst = tmp_path / "ckpt"
    shutil.copytree(_hf_dir(hf_root, "llama", False), dst)
    return dst


def _edit_tensors(path: Path, edit) -> Path:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return f


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture.*gpt2.*"
                                         r"GPT2LMHeadModel"):
        specjax.load(ckpt)


def test_missing_tensor_names_tensor_and_file(ckpt):
    f = _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
                                         rf".*{f}"):
        specjax.load(ckpt)


def test_extra_tensor_names_tensor_and_file(ckpt):
    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
    f = _edit_tensors(ckpt, add)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj"
                                         rf"\.weight' in {f}"):
        specjax.load(ckpt)


def test_wrong_shape_names_tensor_file_and_shapes(ckpt):
    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:8]
    f = _edit_tensors(ckpt, shrink)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in "
                                         rf"{f} has shape \(8, 32\), expected \(16, 32\)"):
        specjax.load(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(ckpt, damage):
    f = ckpt / "model.safetensors"
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    else:
        f.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ValueError, match=rf"{f}: cannot read safetensors file"):
        specjax.load(ckpt)


def test_missing_shard_named_in_index(hf_root, tmp_path):
    specjax.save_hf(specjax.load(_hf_dir(hf_root, "llama", False)), tmp_path,
                    max_shard_bytes=20_000)
    gone = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{gone} is named in the index"):
        specjax.load(tmp_path)


def test_missing_directory_config_or_weights(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        specjax.load(tmp_path / "nowhere")
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        specjax.load(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(ModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2).to_hf_dict()))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file in"):
        specjax.load(empty)


def test_old_and_new_rope_config_forms_load_equal(ckpt):
    """A config.json in the old form (rope_theta + rope_scaling) loads as the new one does."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 500000.0}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    new = specjax.load(ckpt)
    old = dict(cfg)
    scaling = dict(old.pop("rope_parameters"))
    old["rope_theta"] = scaling.pop("rope_theta")
    old["rope_scaling"] = {"type": scaling.pop("rope_type"), **scaling}
    (ckpt / "config.json").write_text(json.dumps(old))
    assert specjax.load(ckpt).config == new.config
    assert new.config.rope_theta == 500000.0
    assert new.config.rope_scaling_dict["rope_type"] == "llama3"


def test_bfloat16_checkpoint_round_trip_is_exact(tmp_path):
    """bf16 safetensors -> specjax (bf16 params, bf16 compute) -> safetensors, bitwise."""
    tiny_hf("qwen2", seed=0).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    model = specjax.load(tmp_path / "hf")
    assert model.config.dtype == "bfloat16"
    assert {str(x.dtype) for x in jax.tree.leaves(model.params)} == {"bfloat16"}
    specjax.save_hf(model, tmp_path / "out")
    _assert_bitwise(_read_dir(tmp_path / "out"), _read_dir(tmp_path / "hf"))
    assert specjax.load(tmp_path / "out").config == model.config
    # and a bfloat16 checkpoint can be loaded as float32 on request
    as_f32 = specjax.load(tmp_path / "out", dtype="float32")
    assert {str(x.dtype) for x in jax.tree.leaves(as_f32.params)} == {"float32"}
