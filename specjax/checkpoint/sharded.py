"""Loading params straight onto a mesh: each device reads only its own shard.

safetensors: every param is built with `jax.make_array_from_callback`; the callback of a
device reads that device's slice of the (memory-mapped) tensors and transposes/stacks it
into the specjax layout, so neither the host nor any device holds the whole model.
orbax: a restore whose target carries the shardings (tensorstore reads per shard).
Both use only global-array APIs: on many hosts each process reads its addressable shards.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.checkpoint.hf import check_hf_tensors, hf_names, restore_orbax, safetensors_files
from specjax.config import ModelConfig
from specjax.model import param_shapes
from specjax.sharding.memory import check_fits
from specjax.sharding.rules import RULES, auto_mesh, param_shardings


def load_params(path: Path, config: ModelConfig, mesh: Mesh, *, rules=RULES) -> Any:
    """Params of the checkpoint at `path` (HF or orbax layout), placed on `mesh`."""
    mesh = auto_mesh(mesh)
    shardings = param_shardings(config, mesh, rules=rules)  # raises before any read
    _check_device_memory(config, mesh, rules)
    if (path / "params").is_dir():  # orbax layout written by save_orbax
        dt = jnp.dtype(config.dtype)
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dt, sharding=sh),
                              param_shapes(config), shardings)
        return restore_orbax(path / "params", config, target)
    return _read_hf_sharded(path, config, shardings)


def _check_device_memory(config: ModelConfig, mesh: Mesh, rules) -> None:
    """Refuses a load whose params alone exceed a device's memory (when the backend says)."""
    stats = mesh.local_devices[0].memory_stats() or {}  # an addressable device
    limit = stats.get("bytes_limit")
    if limit:
        check_fits(config, dict(mesh.shape), device_bytes=limit, batch=0, max_len=0,
                   page_size=1, rules=rules)


def _read_hf_sharded(path: Path, config: ModelConfig, shardings: Any) -> Any:
    from safetensors import SafetensorError, safe_open

    dtype = jnp.dtype(config.dtype)
    with contextlib.ExitStack() as stack:
        files, shapes, origin = {}, {}, {}
        for fpath in safetensors_files(path):
            try:
                f = stack.enter_context(safe_open(str(fpath), framework="numpy"))
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{fpath}: cannot read safetensors file ({e})") from e
            for name in f.keys():
                files[name], origin[name] = f, str(fpath)
                shapes[name] = tuple(f.get_slice(name).get_shape())
        check_hf_tensors(config, shapes, origin)

        by_path: dict[tuple, dict] = defaultdict(dict)  # param path -> {layer: (name, T?)}
        for name, (ppath, layer, transpose) in hf_names(config).items():
            by_path[ppath][layer] = (name, transpose)

        def read(name: str, transpose: bool, index: tuple) -> np.ndarray:
            sl = files[name].get_slice(name)
            x = sl[index[::-1]].T if transpose else sl[index]
            return np.asarray(x).astype(dtype, copy=False)

        def build(ppath: tuple, shape: tuple, sharding) -> jax.Array:
            entries = by_path[ppath]
            if None in entries:  # an unstacked param

                def cb(index):
                    return read(*entries[None], tuple(index))
            else:  # stacked over layers: read each layer's slice of this shard

                def cb(index):
                    layers = range(*index[0].indices(shape[0]))
                    return np.stack([read(*entries[i], tuple(index[1:])) for i in layers])

            return jax.make_array_from_callback(shape, sharding, cb)

        return jax.tree.map_with_path(
            lambda p, s, sh: build(tuple(k.key for k in p), s.shape, sh),
            param_shapes(config), shardings)
