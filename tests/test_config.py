"""specjax.config: Hugging Face config.json forms, round trips, validation, param counts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.config import ModelConfig, tiny_llama
from tests.hf_models import FAMILIES, TINY

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _old(theta, scaling):
    return {**BASE, "rope_theta": theta, "rope_scaling": scaling}


def _new(params):
    return {**BASE, "rope_parameters": params}


@pytest.mark.parametrize("forms", [
    pytest.param([_old(500000.0, {"type": "llama3", **LLAMA3}),
                  _old(500000.0, {"rope_type": "llama3", **LLAMA3}),
                  _new({"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}),
                  _new({"full_attention": {"rope_type": "llama3", "rope_theta": 500000.0,
                                           **LLAMA3}})], id="llama3"),
    pytest.param([_old(10000.0, {"type": "linear", "factor": 4.0}),
                  _new({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})],
                 id="linear"),
    pytest.param([_old(10000.0, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32}),
                  _new({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                        "rope_theta": 10000.0})], id="yarn"),
    pytest.param([_old(1e6, None), {**BASE, "rope_theta": 1e6},
                  _new({"rope_type": "default", "rope_theta": 1e6})], id="default"),
])
def test_old_and_new_rope_forms_give_equal_configs(forms):
    configs = [ModelConfig.from_hf_dict(f) for f in forms]
    assert all(c == configs[0] for c in configs)
    assert len({hash(c) for c in configs}) == 1  # hashable: a jit static argument


def test_llama3_rope_form_values():
    config = ModelConfig.from_hf_dict(_old(500000.0, {"type": "llama3", **LLAMA3}))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling_dict == {"rope_type": "llama3", **LLAMA3}
    assert config.rope_scaling == specjax.config.llama3_8b().rope_scaling


@pytest.mark.parametrize("family, overrides", [
    ("llama", {"tie_word_embeddings": True, "eos_token_id": [1, 2]}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen3", {"head_dim": 16}),
])
def test_hf_config_round_trip(family, overrides):
    hf = FAMILIES[family][0](**{**TINY, **overrides})
    config = ModelConfig.from_hf_dict(hf.to_dict())
    assert config.model_type == family
    assert config.qkv_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    # transformers reads our dict back to the same config
    again = FAMILIES[family][0](**config.to_hf_dict())
    assert ModelConfig.from_hf_dict(again.to_dict()) == config


def test_qwen_sliding_window_only_when_enabled():
    qwen2 = FAMILIES["qwen2"][0]
    off = ModelConfig.from_hf_dict(qwen2(**TINY, sliding_window=8).to_dict())
    assert off.sliding_window is None
    mixed = qwen2(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match=r"config\.json: per-layer attention types"):
        ModelConfig.from_hf_dict(mixed.to_dict())


def test_eos_ids():
    assert ModelConfig.from_hf_dict({**BASE, "eos_token_id": [3, 4]}).eos_ids == (3, 4)
    assert ModelConfig.from_hf_dict({**BASE, "eos_token_id": 3}).eos_ids == (3,)
    assert ModelConfig.from_hf_dict(BASE).eos_ids == ()


@pytest.mark.parametrize("raw, match", [
    ({**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     r"cfg\.json: unsupported architecture \(model_type='gpt2'"),
    ({k: v for k, v in BASE.items() if k != "hidden_size"},
     r"missing required keys \['hidden_size'\]"),
    (_old(10000.0, {"type": "longrope", "factor": 2.0}), r"rope_type='longrope' is not supported"),
    ({**BASE, "num_key_value_heads": 3}, r"num_heads=4 must be a multiple of num_kv_heads=3"),
])
def test_from_hf_dict_errors(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(raw, source="cfg.json")


def test_architectures_decide_when_model_type_is_unknown():
    raw = {**BASE, "model_type": "llama-custom", "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_hf_dict(raw).model_type == "mistral"


@pytest.mark.parametrize("changes, match", [
    ({"vocab_size": 0}, r"vocab_size=0 must be a positive int"),
    ({"num_heads": 3, "num_kv_heads": 2}, r"num_heads=3 must be a multiple of num_kv_heads=2"),
    ({"hidden_size": 66, "num_heads": 4}, r"hidden_size=66 is not divisible by num_heads=4"),
    ({"head_dim": 7}, r"head_dim=7 must be even"),
    ({"model_type": "gpt2"}, r"model_type='gpt2' is not supported"),
    ({"dtype": "int8"}, r"dtype='int8'"),
    ({"rope_scaling": (("rope_type", "longrope"),)}, r"rope_type='longrope' is not supported"),
])
def test_model_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        tiny_llama(**changes)


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True}, {"qkv_bias": True},
                                     {"qk_norm": True, "head_dim": 32}, {"num_kv_heads": 1}])
def test_param_count_matches_eval_shape(changes):
    config = tiny_llama(**changes)
    leaves = jax.tree.leaves(specjax.param_shapes(config))
    assert config.param_count() == sum(int(np.prod(x.shape)) for x in leaves)
