"""Tiny random models for the foundation tests: Hugging Face ones built from configs (never
downloaded) and specjax params of the same scale, plus the one tolerance table.

Weights are redrawn at O(1) scale (kernels ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2),
biases ~ N(0, 0.2)) so logits are O(1): with the default N(0, 0.02) init every logit is
~0 and a wrong RoPE, mask or transpose would hide below any tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

# Max abs difference allowed, keyed by dtype: one table, never loosened.
PARITY_ATOL = {"float32": 1e-4}  # specjax vs transformers (PyTorch CPU); expect ~1e-6
CACHE_ATOL = {"float32": 1e-5}  # specjax paged/chunked vs specjax one-shot

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6)


def tiny_hf(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A float32 eval-mode `*ForCausalLM` of `family` with O(1) random weights."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    return model


def state_dict_np(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model, tokens: np.ndarray, **kwargs):
    """transformers' output for int tokens [B, T] (no grad)."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long), **kwargs)


def random_params(config, seed: int = 0):
    """specjax params for `config` at the O(1) scale of `tiny_hf` (jax arrays, float32)."""
    from specjax.model import param_shapes

    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, s), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(key, s.shape, jnp.float32)
        if name.endswith("['weight']"):  # RMSNorm
            out.append(1 + 0.2 * noise)
        elif name.endswith("['bias']"):
            out.append(0.2 * noise)
        elif name.endswith("['kernel']"):  # [(L,) in, out]
            out.append(noise / s.shape[-2] ** 0.5)
        else:  # embedding [V, D]
            out.append(noise)
    return jax.tree_util.tree_unflatten(treedef, out)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
