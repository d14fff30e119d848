"""A checkpoint directory (Hugging Face or orbax layout) loaded on one device, or straight
onto a mesh (`sharded.load_params`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp

from specjax.checkpoint.hf import (
    _read_safetensors,
    _read_tokenizer,
    _read_tokenizer_config,
    hf_to_params,
    restore_orbax,
)
from specjax.checkpoint.sharded import load_params
from specjax.config import ModelConfig
from specjax.model import Model


def load_dir(path: str | os.PathLike, dtype=None, *, mesh=None) -> Model:
    """Loads a Hugging Face directory (or an orbax directory saved by `save_orbax`);
    `dtype` and `mesh` as in `specjax.load`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a checkpoint directory needs config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from e
    config = ModelConfig.from_hf_dict(raw, source=str(cfg_file))
    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = str(jnp.dtype(dtype)) if dtype is not None else ckpt_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    config = config.replace(dtype=dtype)
    if mesh is not None:
        return Model(config, load_params(path, config, mesh), _read_tokenizer(path),
                     **_read_tokenizer_config(path))
    if (path / "params").is_dir():  # orbax layout written by save_orbax
        params = restore_orbax(path / "params", config)
    else:
        tensors, origin = _read_safetensors(path)
        params = hf_to_params(config, tensors, origin, dtype=jnp.dtype(dtype))
    return Model(config, params, _read_tokenizer(path), **_read_tokenizer_config(path))
