"""Medusa heads in the Medusa repository's layout (FasterDecoding/Medusa).

`config.json`: `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`.
`medusa_lm_head.safetensors`: the state dict of its `medusa_head` ModuleList, head i an
`nn.Sequential` of `medusa_num_layers` ResBlocks (`{i}.{j}.linear.weight` [D, D] and
`.bias`, computing x + silu(linear(x))) and its LM head `{i}.{num_layers}.weight` [V, D].
The repository builds a head's ResBlocks as one module repeated, so heads whose ResBlocks
differ cannot be written in its layout and are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.heads.formats import files
from specjax.heads.io import HeadCheckpoint
from specjax.heads.medusa import MedusaConfig

WEIGHTS = "medusa_lm_head.safetensors"


def medusa_tensors(config: MedusaConfig, params: Any) -> dict[str, np.ndarray]:
    """specjax Medusa params -> the Medusa repository's state dict (float32)."""
    w = np.asarray(jax.device_get(params["res_kernel"]), np.float32)  # [M, R, D, D] in->out
    b = np.asarray(jax.device_get(params["res_bias"]), np.float32)  # [M, R, D]
    lm = np.asarray(jax.device_get(params["lm_head"]), np.float32)  # [M, D, V]
    r = config.num_residual_layers
    out = {}
    for i in range(config.num_heads):
        for j in range(r):
            out[f"{i}.{j}.linear.weight"] = np.ascontiguousarray(w[i, j].T)
            out[f"{i}.{j}.linear.bias"] = b[i, j]
        out[f"{i}.{r}.weight"] = np.ascontiguousarray(lm[i].T)
    return out


def write_medusa(path, config: MedusaConfig, params: Any, target_config: ModelConfig, *,
                 base_model_name_or_path: str | None = None, dtype: str = "float32") -> Path:
    """Writes Medusa heads to directory `path` in the Medusa repository's layout, weights
    as `dtype`."""
    w, b = np.asarray(params["res_kernel"]), np.asarray(params["res_bias"])
    if config.num_residual_layers > 1 and not (np.all(w == w[:, :1]) and np.all(b == b[:, :1])):
        raise ValueError(f"num_residual_layers={config.num_residual_layers} with distinct "
                         "ResBlocks per head: the Medusa repository repeats one ResBlock "
                         "module per head, so these heads cannot be written in its layout")
    cfg = {"medusa_num_heads": config.num_heads,
           "medusa_num_layers": config.num_residual_layers,
           "base_model_name_or_path": base_model_name_or_path,
           **files.fingerprint(target_config)}
    return files.write_dir(path, cfg, medusa_tensors(config, params), WEIGHTS, dtype)


def is_medusa(raw: dict[str, Any]) -> bool:
    return "medusa_num_heads" in raw


def read_medusa(path, target_config: ModelConfig) -> HeadCheckpoint:
    """Reads a Medusa-repository head directory as heads for `target_config`; a missing,
    unexpected or wrongly shaped tensor, or heads for another target, is a ValueError."""
    path = Path(path)
    raw = files.read_config(path)
    source = str(path / files.CONFIG)
    try:
        config = MedusaConfig(int(raw["medusa_num_heads"]), int(raw["medusa_num_layers"]))
    except KeyError as e:
        raise ValueError(f"{source}: {e.args[0]} is missing") from None
    tensors = files.read_tensors(path, (WEIGHTS,))
    files.check_target(raw, target_config, source)
    m, r = config.num_heads, config.num_residual_layers
    d, v = target_config.hidden_size, target_config.vocab_size
    want = {}
    for i in range(m):
        for j in range(r):
            want[f"{i}.{j}.linear.weight"] = (d, d)
            want[f"{i}.{j}.linear.bias"] = (d,)
        want[f"{i}.{r}.weight"] = (v, d)
    extra = sorted(set(tensors) - set(want))
    missing = sorted(set(want) - set(tensors))
    if extra or missing:
        raise ValueError(f"{path}: tensors do not match {m} Medusa heads of {r} ResBlocks: "
                         f"missing {missing[:4]}, unexpected {extra[:4]}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ValueError(f"{path}: tensor {k!r} has shape {tuple(tensors[k].shape)}, "
                             f"expected {shape} for a target of hidden_size={d}, "
                             f"vocab_size={v}")
    w, b = np.zeros((m, r, d, d), np.float32), np.zeros((m, r, d), np.float32)
    lm = np.zeros((m, d, v), np.float32)
    for i in range(m):
        for j in range(r):
            w[i, j] = np.asarray(tensors[f"{i}.{j}.linear.weight"], np.float32).T
            b[i, j] = tensors[f"{i}.{j}.linear.bias"]
        lm[i] = np.asarray(tensors[f"{i}.{r}.weight"], np.float32).T
    params = {"res_kernel": jnp.asarray(w), "res_bias": jnp.asarray(b), "lm_head": jnp.asarray(lm)}
    return HeadCheckpoint("medusa", config, params)
