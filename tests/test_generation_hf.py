"""specjax.generate vs transformers' greedy `generate`, token for token; generate's input errors.

HF runs each prompt alone (no padding); specjax runs them as one ragged batch. The
seeds are chosen so outputs vary (no single repeated token) and llama row 0 stops on
its EOS after two tokens, so the EOS handling is compared too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import specjax
from specjax.checkpoint import hf_to_params
from specjax.config import ModelConfig
from tests.hf_models import VOCAB, state_dict_np, tiny_hf

NEW = 16
PROMPTS = [[int(x) for x in np.random.default_rng(0).integers(3, VOCAB, n)] for n in (5, 1, 12, 8)]
MODELS = {  # name -> (family, seed, HF overrides)
    "llama": ("llama", 1, {}),
    "mistral-window8": ("mistral", 2, {"sliding_window": 8}),  # 12 + 16 tokens > window
    "qwen3": ("qwen3", 2, {"head_dim": 16}),
}


@functools.lru_cache(maxsize=None)
def _pair(name):
    family, seed, overrides = MODELS[name]
    hf = tiny_hf(family, seed=seed, **overrides)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    return hf, specjax.Model(config, hf_to_params(config, state_dict_np(hf)))


def _hf_greedy(hf, prompt, n=NEW, **kwargs):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", MODELS)
def test_ragged_batch_of_4_equals_transformers(name):
    hf, model = _pair(name)
    got = specjax.generate(model, PROMPTS, max_new_tokens=NEW).tokens
    assert got == [_hf_greedy(hf, p) for p in PROMPTS]
    if name == "llama":
        assert got[0][-1] == model.config.eos_token_id and len(got[0]) < NEW


def test_batch_1_equals_transformers():
    """Row 0 alone, its EOS ignored on both sides (transformers: eos_token_id=None)."""
    hf, model = _pair("llama")
    got = specjax.generate(model, [PROMPTS[0]], max_new_tokens=NEW, ignore_eos=True).tokens
    assert len(got[0]) == NEW and model.config.eos_token_id in got[0]
    assert got == [_hf_greedy(hf, PROMPTS[0], eos_token_id=None)]
    flat = specjax.generate(model, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True).tokens
    assert flat == got  # a single prompt may be passed bare


@pytest.mark.parametrize("prompts, kwargs, error, match", [
    ([[]], {}, ValueError, r"prompt 0 is empty"),
    ([[1, 2], []], {}, ValueError, r"prompt 1 is empty"),
    ([], {}, ValueError, r"non-empty list"),
    ([[1] * 120], {"max_new_tokens": 9}, ValueError,
     r"prompt 0 has 120 tokens; with max_new_tokens=9 .* context of 128"),
    ([[1, VOCAB]], {}, ValueError, rf"prompt 0 token id {VOCAB} is outside"),
    ([[1], [-3, 2]], {}, ValueError, r"prompt 1 token id -3 is outside"),
    ([[1]], {"max_new_tokens": 0}, ValueError, r"max_new_tokens=0 must be an integer >= 1"),
    ([[1]], {"max_new_tokens": -2}, ValueError, r"max_new_tokens=-2"),
    ([[1]], {"max_new_tokens": 2.5}, ValueError, r"max_new_tokens=2.5"),
    ([[1]], {"temperature": -0.5}, ValueError, r"temperature=-0.5 must be >= 0"),
    ([[1]], {"top_p": 0.0}, ValueError, r"top_p=0.0 must be in \(0, 1\]"),
    ([[1]], {"top_p": 1.5}, ValueError, r"top_p=1.5 must be in \(0, 1\]"),
    ([[1, 2, 3], [4]], {"num_pages": 2, "page_size": 4}, specjax.OutOfPagesError,
     r"out of cache pages: sequence 1 needs .* raise num_pages"),
    (["a string"], {}, ValueError, r"prompt 0 is a string but the model has no tokenizer"),
])
def test_generate_rejects_bad_input(prompts, kwargs, error, match):
    _, model = _pair("llama")
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        specjax.generate(model, prompts, **kwargs)
