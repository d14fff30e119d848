"""Heads exported to and imported from the layouts servers load, checked by their own code.

speculators (vllm-project/speculators, PyTorch) runs in its own venv built by
tests/speculators_env.py (its transformers pin clashes with ours); every job of this module
runs in one subprocess there (`interop` below): its model classes load specjax's exports and
give the same draft logits, a head it initialises and saves loads into specjax with the same
logits, and its legacy converter takes the original EAGLE-3 layout without key problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specjax
from specjax.config import tiny_llama
from specjax.export import eagle3_original, medusa_format, read_heads
from specjax.heads.eagle import (EagleConfig, eagle_logits, eagle_step, fuse_features,
                                 init_eagle_params)
from specjax.speculators import Eagle, Medusa
from tests.speculators_env import run_jobs

ATOL = 1e-4
T = 12  # tokens per forward
LAYERS = (0, 2, 4)  # specjax decoder-layer outputs fused (aux ids 1, 3, 5)
VD = 48  # reduced draft vocabulary


def _target(seed=0, **overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=6,
               num_heads=4, num_kv_heads=2, head_dim=8)
    cfg.update(overrides)
    return specjax.init_model(tiny_llama(**cfg), seed=seed)


@pytest.fixture(scope="module")
def target():
    return _target()


def _d2t(vocab, vd, seed):
    return np.sort(np.random.default_rng(seed).choice(vocab, vd, replace=False)).astype(np.int32)


def _perturbed(params, seed):
    """Every tensor random (norms near 1, kernels O(0.2)): a wrong layout cannot hide."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [1.0 + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1
           else 0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


def _eagle(target, seed, vd=VD, **flags):
    config = EagleConfig(3, LAYERS, vd, **flags).resolved(target.config)
    params = _perturbed(init_eagle_params(config, target.config, seed), seed)
    d2t = _d2t(target.config.vocab_size, vd, seed) if vd < target.config.vocab_size else None
    return Eagle(params, config, target=target, vocab_map=d2t)


def _inputs(target, seed):
    rng = np.random.default_rng(seed)
    d = target.config.hidden_size
    return {"hidden_states": rng.standard_normal((1, T, 3 * d)).astype(np.float32),
            "input_ids": rng.integers(0, target.config.vocab_size, (1, T)),
            "position_ids": np.arange(T)[None]}


def specjax_logits(eagle: Eagle, target, inputs) -> np.ndarray:
    """The head's draft logits on fused features and tokens, as `Eagle` computes them."""
    cfg, tc, p = eagle.config, eagle.target_config, eagle.params
    fused = fuse_features(cfg, tc, p, jnp.asarray(inputs["hidden_states"]))
    out, _ = eagle_step(cfg, tc, p, target.params, None, jnp.asarray(inputs["input_ids"]),
                        fused, jnp.asarray(inputs["position_ids"]))
    return np.asarray(eagle_logits(cfg, tc, p, target.params, out))


# variants of the exported head: the norm placements speculators' config can name
VARIANTS = {"plain": {}, "residual_output": {"norm_before_residual": True, "norm_output": True},
            "fc_norm": {"fc_norm": True}, "norm_before_fc_full_vocab": {"norm_before_fc": True}}
# heads speculators initialises and saves
SAVED = {"plain": {}, "residual_output": {"norm_before_residual": True, "norm_output": True}}


@pytest.fixture(scope="module")
def interop(target, tmp_path_factory):
    """Writes every export, runs all speculators jobs in one subprocess, returns paths."""
    work = tmp_path_factory.mktemp("interop")
    verifier = work / "verifier"
    specjax.save_hf(target, verifier)
    jobs, heads, inputs = [], {}, {}
    for i, (name, flags) in enumerate(VARIANTS.items()):
        eagle = _eagle(target, seed=10 + i, vd=target.config.vocab_size
                       if name.endswith("full_vocab") else VD, **flags)
        heads[name] = eagle
        inputs[name] = _inputs(target, 20 + i)
        np.savez(work / f"in_{name}.npz", **inputs[name])
        out = specjax.export.export_speculators(eagle, work / f"spec_{name}", target=target,
                                                verifier=str(verifier))
        jobs.append({"op": "forward", "dir": str(out), "inputs": str(work / f"in_{name}.npz"),
                     "out": str(work / f"fwd_{name}.npz")})
    for i, (name, flags) in enumerate(SAVED.items()):
        ins = _inputs(target, 30 + i)
        ins["d2t"] = _d2t(target.config.vocab_size, VD, 30 + i)
        np.savez(work / f"in_saved_{name}.npz", **ins)
        inputs[f"saved_{name}"] = ins
        jobs.append({"op": "init_save", "verifier": str(verifier), "dir": str(work / f"saved_{name}"),
                     "seed": 30 + i, "draft_vocab_size": VD, "layer_ids": [j + 1 for j in LAYERS],
                     "flags": flags, "inputs": str(work / f"in_saved_{name}.npz"),
                     "out": str(work / f"saved_{name}.npz")})
    orig = specjax.export.export_eagle3(heads["plain"], work / "original", target=target)
    ids = json.loads((orig / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    jobs.append({"op": "convert", "dir": str(orig), "verifier": str(verifier), "layer_ids": ids,
                 "to": str(work / "converted"), "out": str(work / "convert.npz")})
    jobs.append({"op": "forward", "dir": str(work / "converted"),
                 "inputs": str(work / "in_plain.npz"), "out": str(work / "fwd_converted.npz")})
    run_jobs(jobs, work)
    return {"work": work, "heads": heads, "inputs": inputs, "verifier": verifier}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculators_runs_specjax_export(interop, target, name):
    """speculators' Eagle3DraftModel loads the export (its config validation passes) and its
    forward gives specjax's draft logits."""
    theirs = np.load(interop["work"] / f"fwd_{name}.npz")["logits"][0]
    ours = specjax_logits(interop["heads"][name], target, interop["inputs"][name])[0]
    assert theirs.shape == ours.shape == (T, interop["heads"][name].config.draft_vocab_size)
    assert np.abs(ours).max() > 1.0  # logits a wrong layout would change
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(SAVED))
def test_specjax_runs_speculators_saved_head(interop, target, name):
    """A head speculators initialises (from_training_args) and saves loads into `Eagle` and
    gives the logits speculators computed; its own embedding (the verifier's) is kept."""
    path = interop["work"] / f"saved_{name}"
    eagle = Eagle(heads=path, target=target)
    ins = interop["inputs"][f"saved_{name}"]
    np.testing.assert_array_equal(np.asarray(eagle.d2t), ins["d2t"])
    assert eagle.config.hidden_layers == LAYERS
    assert all(getattr(eagle.config, f) == v for f, v in SAVED[name].items())
    np.testing.assert_array_equal(np.asarray(eagle.params["embed_tokens"]["embedding"]),
                                  np.asarray(target.params["embed_tokens"]["embedding"]))
    theirs = np.load(interop["work"] / f"saved_{name}.npz")["logits"][0]
    np.testing.assert_allclose(specjax_logits(eagle, target, ins)[0], theirs, atol=ATOL, rtol=0)


def _same_head(back: Eagle, eagle: Eagle, target):
    """`back` is `eagle` read back: same config, params and d2t, and the target's
    embedding (written beside the head) as its own."""
    assert back.config == eagle.config
    params = dict(back.params)
    np.testing.assert_array_equal(np.asarray(params.pop("embed_tokens")["embedding"]),
                                  np.asarray(target.params["embed_tokens"]["embedding"]))
    _same_tree(params, eagle.params)
    np.testing.assert_array_equal(np.asarray(back.d2t), np.asarray(eagle.d2t))


def test_speculators_round_trip_is_exact(interop, target, tmp_path):
    for name, eagle in interop["heads"].items():
        path = interop["work"] / f"spec_{name}"
        back = Eagle(heads=path, target=target)
        _same_head(back, eagle, target)
        again = specjax.export.export_speculators(back, tmp_path / name,
                                                  verifier=str(interop["verifier"]))
        _same_files(path, again)


def test_speculators_config_fields(interop, target):
    raw = json.loads((interop["work"] / "spec_residual_output" / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3Speculator"]
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert raw["norm_before_residual"] and raw["norm_output"] and not raw["fc_norm"]
    assert raw["target_hidden_size"] == 32 and raw["draft_vocab_size"] == VD
    assert raw["speculators_config"]["verifier"] == {
        "name_or_path": str(interop["verifier"]), "architectures": ["LlamaForCausalLM"]}
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 1
    keys = set(load_file(str(interop["work"] / "spec_plain" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
            "embed_tokens.weight"} <= keys


# ---- the original EAGLE-3 layout (SGLang's LlamaForCausalLMEagle3) ----------------------

# what SGLang's LlamaForCausalLMEagle3.load_weights maps (d2t becomes hot_token_id)
SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
               *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
               "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight"}


def test_original_layout_keys_and_config(interop):
    path = interop["work"] / "original"
    assert set(load_file(str(path / "model.safetensors"))) == SGLANG_KEYS
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["model_type"] == "llama" and raw["num_hidden_layers"] == 1
    assert raw["draft_vocab_size"] == VD and raw["vocab_size"] == 96
    assert raw["hidden_size"] == raw["target_hidden_size"] == 32
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert raw["tie_word_embeddings"] is False


def test_speculators_converter_takes_original_layout(interop, target):
    """speculators' legacy converter reports no missing or unexpected key, and the head it
    writes gives specjax's logits in speculators' own forward."""
    report = np.load(interop["work"] / "convert.npz")
    assert int(report["key_problems"]) == 0, str(report["report"])
    theirs = np.load(interop["work"] / "fwd_converted.npz")["logits"][0]
    ours = specjax_logits(interop["heads"]["plain"], target, interop["inputs"]["plain"])[0]
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


def test_original_layout_round_trip_is_exact(interop, target, tmp_path):
    path = interop["work"] / "original"
    ckpt = eagle3_original.read_eagle3(path, target.config)
    back = Eagle(ckpt.params, ckpt.config, target=target, vocab_map=ckpt.vocab_map)
    _same_head(back, interop["heads"]["plain"], target)
    again = specjax.export.export_eagle3(Eagle(heads=path, target=target), tmp_path / "o")
    _same_files(path, again)


def _same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _same_files(a: Path, b: Path):
    assert json.loads((a / "config.json").read_text()) == \
        json.loads((b / "config.json").read_text())
    ta = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    tb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
