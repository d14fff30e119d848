"""Checkpoints in and out: Hugging Face directories, hub ids, GGUF files and orbax.

`load` is the one entry point. It takes
  - a Hugging Face directory (`config.json`, safetensors, `tokenizer.json`) or an orbax
    directory written by `save_orbax` (`directory.py`, `hf.py`; onto a mesh: `sharded.py`);
  - a `.gguf` file, or a directory holding one and no `config.json` (`gguf.py`);
  - a hub id such as `"HuggingFaceTB/SmolLM2-135M-Instruct"`, resolved in the local
    Hugging Face cache as transformers resolves it (`hub.py`). Nothing is downloaded
    while `HF_HUB_OFFLINE` is set.
"""

from __future__ import annotations

import os
from pathlib import Path

from specjax.checkpoint.directory import load_dir
from specjax.checkpoint.gguf_write import save_gguf
from specjax.checkpoint.hf import (
    check_hf_tensors,
    hf_names,
    hf_to_params,
    params_to_hf,
    restore_orbax,
    safetensors_files,
    save_hf,
    save_orbax,
)
from specjax.model import Model

__all__ = ["check_hf_tensors", "hf_names", "hf_to_params", "load", "params_to_hf",
           "restore_orbax", "safetensors_files", "save_gguf", "save_hf", "save_orbax"]


def load(path: str | os.PathLike, dtype=None, *, mesh=None) -> Model:
    """Loads a checkpoint: a HF or orbax directory, a GGUF file (or a directory holding
    one), or a hub id from the local Hugging Face cache.

    `dtype` ("float32", "bfloat16", ...) casts params and sets the compute dtype; None
    keeps the checkpoint's (float32 if it does not say; GGUF files are dequantized to
    float32). `mesh` (a `jax.sharding.Mesh`, e.g. `specjax.make_mesh({'data': -1,
    'model': 2})`) places every param straight onto its shards by the sharding rules.
    """
    from specjax.checkpoint import gguf, hub

    p = Path(path)
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{str(p)!r} is a file but not a .gguf file; pass a GGUF file "
                             "or a checkpoint directory")
        return gguf.load_gguf(p, dtype, mesh=mesh)
    if p.is_dir():
        found = None if (p / "config.json").exists() else gguf.find_gguf(p)
        if found is not None:
            return gguf.load_gguf(found, dtype, mesh=mesh)
        return load_dir(p, dtype, mesh=mesh)
    if hub.looks_like_repo_id(str(path)):
        return load(hub.resolve(str(path)), dtype, mesh=mesh)
    raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist (not a file, a "
                            "directory or a hub id such as 'Org/name')")
