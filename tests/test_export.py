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
from specjax.heads.eagle import (
    EagleConfig,
    eagle_logits,
    eagle_step,
    fuse_features,
    init_eagle_params,
)
from specjax.heads.formats import eagle3_original, medusa_format, read_heads
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
    return Eagle.create(params, config, target=target, vocab_map=d2t)


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
        jobs.append({"op": "init_save", "verifier": str(verifier),
                     "dir": str(work / f"saved_{name}"),
                     "seed": 30 + i, "draft_vocab_size": VD, "layer_ids": [j + 1 for j in LAYERS],
                     "flags": flags, "inputs": str(work / f"in_saved_{name}.npz"),
                     "out": str(work / f"saved_{name}.npz")})
    # bfloat16 weights, as heads are usually served
    specjax.export.export_speculators(heads["plain"], work / "spec_bf16", target=target,
                                      verifier=str(verifier), dtype="bfloat16")
    jobs.append({"op": "forward", "dir": str(work / "spec_bf16"),
                 "inputs": str(work / "in_plain.npz"), "out": str(work / "fwd_bf16.npz")})
    # a Qwen3 target: the head's layer has q/k norms (speculators' qwen3 layer class)
    qwen3 = _target(seed=5, model_type="qwen3", qk_norm=True)
    specjax.save_hf(qwen3, work / "verifier_qwen3")
    heads["qwen3"], inputs["qwen3"] = _eagle(qwen3, seed=15), _inputs(qwen3, 25)
    np.savez(work / "in_qwen3.npz", **inputs["qwen3"])
    specjax.export.export_speculators(heads["qwen3"], work / "spec_qwen3", target=qwen3,
                                      verifier=str(work / "verifier_qwen3"))
    jobs.append({"op": "forward", "dir": str(work / "spec_qwen3"),
                 "inputs": str(work / "in_qwen3.npz"), "out": str(work / "fwd_qwen3.npz")})
    orig = specjax.export.export_eagle3(heads["plain"], work / "original", target=target)
    ids = [i + 1 for i in json.loads((orig / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]]  # as speculators counts them
    jobs.append({"op": "convert", "dir": str(orig), "verifier": str(verifier), "layer_ids": ids,
                 "to": str(work / "converted"), "out": str(work / "convert.npz")})
    jobs.append({"op": "forward", "dir": str(work / "converted"),
                 "inputs": str(work / "in_plain.npz"), "out": str(work / "fwd_converted.npz")})
    run_jobs(jobs, work)
    return {"work": work, "heads": heads, "inputs": inputs, "verifier": verifier,
            "qwen3": qwen3}


@pytest.mark.parametrize("name", [*VARIANTS, "qwen3"])
def test_speculators_runs_specjax_export(interop, target, name):
    """speculators' Eagle3DraftModel loads the export (its config validation passes) and its
    forward gives specjax's draft logits."""
    theirs = np.load(interop["work"] / f"fwd_{name}.npz")["logits"][0]
    tgt = interop["qwen3"] if name == "qwen3" else target
    ours = specjax_logits(interop["heads"][name], tgt, interop["inputs"][name])[0]
    assert theirs.shape == ours.shape == (T, interop["heads"][name].config.draft_vocab_size)
    assert np.abs(ours).max() > 1.0  # logits a wrong layout would change
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(SAVED))
def test_specjax_runs_speculators_saved_head(interop, target, name):
    """A head speculators initialises (from_training_args) and saves loads into `Eagle` and
    gives the logits speculators computed; its own embedding (the verifier's) is kept."""
    path = interop["work"] / f"saved_{name}"
    eagle = Eagle.load(path, target=target)
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


def test_bfloat16_export(interop, target):
    """Weights written as bfloat16 (the maps stay integer) read back as the rounded
    float32 params, and speculators' forward on them gives specjax's logits on them."""
    import ml_dtypes

    path = interop["work"] / "spec_bf16"
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["fc.weight"].dtype == ml_dtypes.bfloat16
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool
    raw = json.loads((path / "config.json").read_text())
    assert raw["transformer_layer_config"]["torch_dtype"] == "bfloat16"
    back, eagle = Eagle.load(path, target=target), interop["heads"]["plain"]
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16)
                           .astype(np.float32), eagle.params)
    assert not np.array_equal(rounded["fc"]["kernel"], np.asarray(eagle.params["fc"]["kernel"]))
    _same_tree({k: v for k, v in back.params.items() if k != "embed_tokens"}, rounded)
    theirs = np.load(interop["work"] / "fwd_bf16.npz")["logits"][0]
    ours = specjax_logits(back, target, interop["inputs"]["plain"])[0]
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


def test_speculators_round_trip_is_exact(interop, target, tmp_path):
    for name, eagle in interop["heads"].items():
        path = interop["work"] / f"spec_{name}"
        tgt = interop["qwen3"] if name == "qwen3" else target
        back = Eagle.load(path, target=tgt)
        _same_head(back, eagle, tgt)
        verifier = interop["work"] / "verifier_qwen3" if name == "qwen3" else interop["verifier"]
        again = specjax.export.export_speculators(back, tmp_path / name, verifier=str(verifier))
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
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
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
    back = Eagle.create(ckpt.params, ckpt.config, target=target, vocab_map=ckpt.vocab_map)
    _same_head(back, interop["heads"]["plain"], target)
    again = specjax.export.export_eagle3(Eagle.load(path, target=target), tmp_path / "o")
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


def test_imported_head_drafts_losslessly(interop, target):
    """A head speculators saved (its own embedding included) drafts inside
    `specjax.generate`, and greedy output is the target's own."""
    eagle = Eagle.load(interop["work"] / "saved_plain", target=target, top_k=2, depth=2,
                       total_tokens=4)
    prompts = [[5, 17, 33, 2, 9, 71, 40, 8]]
    plain = specjax.generate(target, prompts, max_new_tokens=12, ignore_eos=True)
    out = specjax.generate(target, prompts, speculator=eagle, max_new_tokens=12,
                           ignore_eos=True)
    assert out.tokens == plain.tokens
    assert out.stats.draft_calls > 0


# ---- bad input ---------------------------------------------------------------------------


def _copy_head(src: Path, dst: Path, config=None, drop=()) -> Path:
    """A copy of an exported head with its config.json edited by `config` and tensors
    `drop` removed."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config is not None:
        config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(dst / "model.safetensors"))
    return dst


def test_head_for_another_target_is_refused(interop, tmp_path):
    src = interop["work"] / "spec_plain"
    other = _target(vocab_size=100).config
    with pytest.raises(ValueError, match=r"made for another target: vocab_size=96.*100"):
        Eagle.load(src, target=other)
    with pytest.raises(ValueError, match=r"made for another target: .*num_layers=6.*8"):
        Eagle.load(interop["work"] / "original", target=_target(num_layers=8).config)
    # a head from elsewhere (no specjax fingerprint): what the format says is checked
    bare = _copy_head(src, tmp_path / "bare", lambda c: c.pop("specjax_target"))
    with pytest.raises(ValueError, match=r"made for another target: vocab_size=96 "
                                         r"\(target has 100\)"):
        Eagle.load(bare, target=other)
    with pytest.raises(ValueError, match=r"verifier architectures=\['LlamaForCausalLM'\] "
                                         r"\(target is Qwen3ForCausalLM\)"):
        Eagle.load(bare, target=_target(model_type="qwen3", qk_norm=True).config)


def test_reduced_vocabulary_without_d2t_is_refused(interop, target, tmp_path):
    for name in ("spec_plain", "original"):
        head = _copy_head(interop["work"] / name, tmp_path / name, drop=("d2t",))
        with pytest.raises(ValueError, match=r"draft_vocab_size=48 is smaller than the "
                                             r"target's vocab_size=96, but there is no 'd2t'"):
            Eagle.load(head, target=target)


def _set_layer(key, value):
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (_set_layer("num_hidden_layers", 2), r"num_hidden_layers=2 \(specjax runs "
                                         r"num_hidden_layers=1\)"),
    (_set_layer("intermediate_size", 80), r"intermediate_size=80 \(the target's layer has 64\)"),
    (_set_layer("model_type", "gemma"), r"model_type='gemma'"),
    (lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 3, 4]),
     r"eagle_aux_hidden_state_layer_ids=\[1, 2, 3, 4\]: specjax fuses exactly 3"),
    (lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [0, 2, 4]),
     r"ids in \[1, 6\]"),
    (lambda c: c.__setitem__("speculators_model_type", "mtp"), r"speculators_model_type='mtp'"),
])
def test_fields_specjax_cannot_honour_are_refused(interop, target, tmp_path, edit, message):
    head = _copy_head(interop["work"] / "spec_plain", tmp_path / "h", edit)
    with pytest.raises(ValueError, match=message):
        Eagle.load(head, target=target)


def test_unknown_layout_and_unwritable_heads_are_refused(interop, target, tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(target.config.to_json())
    with pytest.raises(ValueError, match=r"describes no head format specjax reads "
                                         r"\(architectures=\['LlamaForCausalLM'\]\)"):
        read_heads(tmp_path / "llama", target.config)
    with pytest.raises(ValueError, match=r"original EAGLE-3 layout cannot express "
                                         r"\['norm_before_residual', 'norm_output'\]"):
        specjax.export.export_eagle3(interop["heads"]["residual_output"], tmp_path / "o")
    with pytest.raises(ValueError, match=r"a qwen3 layer \(q/k norms: True\); this layout "
                                         r"holds only llama layers"):
        specjax.export.export_eagle3(interop["heads"]["qwen3"], tmp_path / "q3")
    clamped = Eagle.random(target, version=3, hidden_layers=(1, 1, 4), draft_vocab_size=VD)
    with pytest.raises(ValueError, match=r"hidden_layers=\(1, 1, 4\) repeats a layer"):
        specjax.export.export_speculators(clamped, tmp_path / "s")
    qwen2 = _target(model_type="qwen2", qkv_bias=True)
    with pytest.raises(ValueError, match=r"q/k/v biases only \(qkv_bias=True\)"):
        specjax.export.export_speculators(Eagle.random(qwen2, version=3, hidden_layers=LAYERS),
                                          tmp_path / "q")
    with pytest.raises(ValueError, match=r"EAGLE-3 heads; this is a version-1 head"):
        specjax.export.export_speculators(Eagle.random(target, version=1), tmp_path / "v1")


# ---- Medusa ------------------------------------------------------------------------------


def _medusa_keys(m, r):
    """The Medusa repository's `medusa_head` state dict names."""
    keys = set()
    for i in range(m):
        keys |= {f"{i}.{j}.linear.{w}" for j in range(r) for w in ("weight", "bias")}
        keys.add(f"{i}.{r}.weight")
    return keys


@pytest.mark.parametrize("r", [0, 1])
def test_medusa_round_trip_and_key_names(target, tmp_path, r):
    heads = Medusa.random(target, num_heads=4, num_residual_layers=r, seed=4)
    heads = Medusa.create(_perturbed(heads.params, 4), heads.config, target=target)
    path = specjax.export.export_medusa(heads, tmp_path / "m", base_model_name_or_path="t")
    tensors = load_file(str(path / "medusa_lm_head.safetensors"))
    assert set(tensors) == _medusa_keys(4, r)
    assert tensors[f"3.{r}.weight"].shape == (96, 32)  # [V, D]: nn.Linear(D, V, bias=False)
    raw = json.loads((path / "config.json").read_text())
    assert (raw["medusa_num_heads"], raw["medusa_num_layers"],
            raw["base_model_name_or_path"]) == (4, r, "t")
    back = Medusa.load(path, target=target)
    assert back.config == heads.config
    _same_tree(back.params, heads.params)
    again = specjax.export.export_medusa(back, tmp_path / "again", base_model_name_or_path="t")
    assert json.loads((again / "config.json").read_text()) == raw
    for k, v in load_file(str(again / "medusa_lm_head.safetensors")).items():
        np.testing.assert_array_equal(v, tensors[k], err_msg=k)
    if r:  # the ResBlock computes x + silu(linear(x)) with linear.weight [out, in]
        x = np.random.default_rng(0).standard_normal(32).astype(np.float32)
        w, b = tensors["0.0.linear.weight"], tensors["0.0.linear.bias"]
        y = x + (x @ w.T + b) / (1 + np.exp(-(x @ w.T + b)))
        ours = medusa_logits_np(heads, target, x)[0]
        np.testing.assert_allclose(ours, y @ tensors[f"0.{r}.weight"].T, atol=1e-4, rtol=0)


def medusa_logits_np(heads: Medusa, target, x):
    from specjax.heads.medusa import medusa_logits
    return np.asarray(medusa_logits(heads.config, target.config, heads.params,
                                    jnp.asarray(x)[None, None]))[0, 0]


def test_medusa_layouts_it_cannot_hold_are_refused(target, tmp_path):
    heads = Medusa.random(target, num_heads=4, num_residual_layers=2, seed=1)  # distinct
    with pytest.raises(ValueError, match=r"num_residual_layers=2 with distinct ResBlocks"):
        specjax.export.export_medusa(heads, tmp_path / "m")
    p = dict(heads.params)
    p["res_kernel"] = jnp.repeat(p["res_kernel"][:, :1], 2, axis=1)  # one ResBlock repeated
    p["res_bias"] = jnp.repeat(p["res_bias"][:, :1], 2, axis=1)
    path = specjax.export.export_medusa(Medusa.create(p, heads.config, target=target),
                                        tmp_path / "ok")
    _same_tree(Medusa.load(path, target=target).params, p)
    with pytest.raises(ValueError, match=r"made for another target: vocab_size=96"):
        Medusa.load(path, target=_target(vocab_size=100).config)
    tensors = load_file(str(path / "medusa_lm_head.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "1.2.weight"},
              str(path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['1.2.weight'\]"):
        Medusa.load(path, target=target)


# ---- training jobs and the CLI -----------------------------------------------------------


def test_training_jobs_write_the_serving_layout(interop, target, tmp_path):
    """What `specjax.train.jobs.heads` writes beside its own heads: speculators' format for EAGLE-3
    (read back exactly), Medusa's layout, and a reason where a head cannot be written."""
    from specjax.train import jobs

    eagle = interop["heads"]["plain"]
    out = jobs.serving_export(tmp_path, "eagle", eagle.config, eagle.params, target, "tgt",
                              np.asarray(eagle.d2t))
    assert out == tmp_path / "speculators"
    _same_head(Eagle.load(out, target=target), eagle, target)
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "tgt"
    medusa = Medusa.random(target, num_heads=2, num_residual_layers=1, seed=2, tree=[[0]])
    out = jobs.serving_export(tmp_path, "medusa", medusa.config, medusa.params, target, "tgt")
    assert out == tmp_path / "medusa"
    _same_tree(medusa_format.read_medusa(out, target.config).params, medusa.params)
    clamped = EagleConfig(3, (1, 1, 4), VD).resolved(target.config)
    why = jobs.serving_export(tmp_path / "c", "eagle", clamped,
                              init_eagle_params(clamped, target.config, 0), target, "tgt")
    assert why.startswith("not written: hidden_layers=(1, 1, 4) repeats a layer")
    assert not (tmp_path / "c").exists()


def _cli(*args) -> int:
    from specjax.cli import main
    return main(["export", *map(str, args)])


def test_cli_exports_a_runs_heads(interop, target, tmp_path, capsys):
    """`specjax export` reads the run's heads and its recorded target; every format writes
    what the export functions write; bad requests exit 2 naming the value."""
    from specjax.heads import save_heads

    eagle = interop["heads"]["plain"]
    run = tmp_path / "run"
    save_heads(run / "heads", "eagle", eagle.config, eagle.params, target.config,
               vocab_map=np.asarray(eagle.d2t))
    (run / "config.json").write_text(json.dumps(
        {"settings": {"target_dir": str(interop["verifier"])}}))
    assert _cli("--format", "speculators", run, tmp_path / "s") == 0
    _same_files(tmp_path / "s", interop["work"] / "spec_plain")
    assert _cli("--format", "eagle3", run / "heads", tmp_path / "o") == 0
    _same_files(tmp_path / "o", interop["work"] / "original")
    # an exported layout converts to the other one (the target named)
    assert _cli("--format", "speculators", tmp_path / "o", tmp_path / "s2", "--target",
                interop["verifier"]) == 0
    _same_files(tmp_path / "s2", interop["work"] / "spec_plain")
    capsys.readouterr()
    for args, message in [
        (("--format", "onnx", run, tmp_path / "x"), "--format 'onnx' is unknown; choose one "
                                                     "of speculators, eagle3, medusa, gguf"),
        (("--format", "medusa", run, tmp_path / "x"), "holds eagle heads; --format medusa "
                                                       "writes medusa heads"),
        (("--format", "eagle3", tmp_path / "o", tmp_path / "x"), "pass --target DIR"),
        (("--format", "speculators", tmp_path, tmp_path / "x"), "is neither a training run"),
        (("--format", "eagle3", run, tmp_path / "x", "--dtype", "Q8_0"),
         "--dtype 'Q8_0': heads are written as F32, BF16, F16"),
    ]:
        assert _cli(*args) == 2
        assert message in capsys.readouterr().err


def test_cli_exports_a_draft_as_gguf(tmp_path):
    """--format gguf writes the draft of a distillation run (its export/) as the GGUF file
    specjax.save_gguf writes, which specjax's own GGUF reader loads back exactly."""
    draft = _target(seed=3, num_layers=1)
    specjax.save_hf(draft, tmp_path / "run" / "export")
    assert _cli("--format", "gguf", tmp_path / "run", tmp_path / "d.gguf") == 0
    back = specjax.load(tmp_path / "d.gguf", dtype="float32")
    assert back.config == draft.config
    _same_tree(back.params, draft.params)
    assert _cli("--format", "gguf", tmp_path / "run", tmp_path / "q.gguf", "--dtype",
                "Q4_K") == 2


@pytest.mark.slow  # llama-cpp-python is the bench extra (built from source), not a test dep
def test_llama_cpp_runs_an_exported_draft(tmp_path):
    """A draft exported by `specjax export --format gguf` (F32) is llama.cpp's model and
    draft model: its greedy tokens are specjax's, alone and drafting for a target."""
    pytest.importorskip("llama_cpp", reason="pip install -e '.[bench]'")
    from specjax.bench import llamacpp as lc
    from tests.test_gguf_write import tiny_model

    target, draft = tiny_model("llama"), tiny_model("llama", seed=1, num_layers=1)
    specjax.save_hf(draft, tmp_path / "run" / "export")
    assert _cli("--format", "gguf", tmp_path / "run", tmp_path / "draft.gguf") == 0
    target_path = specjax.save_gguf(target, tmp_path / "target.gguf")
    prompts = [np.random.default_rng(0).integers(3, 300, 16).tolist()]
    n_ctx = lc.context_size(prompts, 16, 4)
    for model, path, method in ((draft, tmp_path / "draft.gguf", "plain"),
                                (target, target_path, "draft")):
        ours = specjax.generate(model, prompts, max_new_tokens=16, ignore_eos=True).tokens
        runner = lc.Runner(path, method, k=4, draft=tmp_path / "draft.gguf", n_ctx=n_ctx,
                           threads=1)
        tokens, _ = lc.llamacpp_pass(runner, prompts, new=16)
        runner.close()
        assert tokens == ours, (method, lc.agreement(ours, tokens))


def test_published_heads_load_by_hub_id_and_from_pytorch_bin(interop, target, tmp_path):
    """A head published on the hub loads by its id (from the local cache, offline), and the
    EAGLE repository's pytorch_model.bin reads as its safetensors do."""
    import shutil

    import torch

    from tests.test_hub import SHA, _run

    repo = tmp_path / "hub" / "models--Org--eagle3-head"
    shutil.copytree(interop["work"] / "spec_plain", repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    out = _run("import json, numpy as np, specjax\n"
               "from specjax.speculators import Eagle\n"
               f"t = specjax.load({str(interop['verifier'])!r}, dtype='float32')\n"
               "e = Eagle.load('Org/eagle3-head', target=t)\n"
               "print(json.dumps(np.asarray(e.d2t).tolist()))\n", tmp_path / "hub")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == \
        np.asarray(interop["heads"]["plain"].d2t).tolist()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(interop["work"] / "original" / "config.json", bin_dir)
    tensors = load_file(str(interop["work"] / "original" / "model.safetensors"))
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()},
               bin_dir / "pytorch_model.bin")
    back = Eagle.load(bin_dir, target=target)
    _same_head(back, interop["heads"]["plain"], target)


def test_imported_head_params_have_sharding_rules(interop, target):
    """Every param an imported head can hold (the norm flags' norms, its own embedding) has
    logical axes in the sharding rules, so it lays out on a mesh as trained heads do."""
    from specjax.sharding.rules import tree_specs

    for name in ("fc_norm", "norm_before_fc_full_vocab"):
        back = Eagle.load(interop["work"] / f"spec_{name}", target=target)
        specs = tree_specs(back.params, {"data": 1, "model": 2}, config=target.config)
        assert specs["embed_tokens"]["embedding"] == jax.sharding.PartitionSpec("model", None)
