"""Memory planner: bytes per device for params, KV cache, draft and activations.

Params come from `jax.eval_shape` of the model's init (no memory is touched) laid out by
the same rules `load(..., mesh=)` uses, so the plan is exactly what loading places. The
KV cache and activations are arithmetic, written out in `plan_memory`'s docstring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax import kv_quant
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.models.transformer import param_shapes
from specjax.sharding.rules import RULES, axis_size, cache_specs, mesh_axis, param_specs

_GIB = 1 << 30


class DoesNotFitError(ValueError):
    """The plan needs more memory per device than the device has."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, by part (the most-loaded device; shards are equal by construction)."""

    mesh_shape: dict[str, int]
    params: int
    kv_cache: int
    draft_params: int
    draft_kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return (self.params + self.kv_cache + self.draft_params + self.draft_kv_cache
                + self.activations)

    def __str__(self) -> str:
        parts = [f"{f.name} {getattr(self, f.name) / _GIB:.2f}" for f in dataclasses.fields(self)
                 if f.name != "mesh_shape" and getattr(self, f.name)]
        return (f"{self.total / _GIB:.2f} GiB per device on mesh {self.mesh_shape} "
                f"({', '.join(parts)} GiB)")


def _shards(spec: P, mesh_shape: Mapping[str, int]) -> int:
    return math.prod(axis_size(mesh_shape, entry) for entry in spec)


def _bytes_per_device(shapes: Any, specs: Any, mesh_shape, itemsize=None) -> int:
    total = 0
    specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for s, spec in zip(jax.tree.leaves(shapes), specs):
        size = itemsize or jnp.dtype(s.dtype).itemsize
        total += math.prod(s.shape) // _shards(spec, mesh_shape) * size
    return total


def params_bytes(config: ModelConfig, mesh_shape: Mapping[str, int], dtype, *,
                 rules=RULES) -> int:
    """Param bytes on one device, each param stored in `dtype`, laid out by `rules`."""
    return _bytes_per_device(param_shapes(config), param_specs(config, mesh_shape, rules=rules),
                             mesh_shape, jnp.dtype(dtype).itemsize)


def cache_bytes(config: ModelConfig, mesh_shape: Mapping[str, int], *, batch: int,
                max_len: int, page_size: int, dtype, rules=RULES) -> int:
    """Paged KV cache bytes on one device: `batch` rows of `max_len` tokens each (int8
    pages: plus a float32 scale per token, KV head and layer, for K and for V)."""
    m = -(-max_len // page_size)
    pages = (config.num_layers, config.num_kv_heads, batch * m, page_size, config.head_dim)
    sds = jax.ShapeDtypeStruct
    scales = ((sds(pages[:-1], jnp.float32),) * 2 if kv_quant.is_quantized(dtype)
              else (None, None))
    shapes = PagedKVCache(sds(pages, jnp.dtype(dtype)), sds(pages, jnp.dtype(dtype)),
                          sds((batch, m), jnp.int32), sds((batch,), jnp.int32), *scales)
    return _bytes_per_device(shapes, cache_specs(shapes, mesh_shape, rules=rules), mesh_shape)


def plan_memory(
    config: ModelConfig,
    mesh_shape: Mapping[str, int],
    *,
    batch: int,
    max_len: int,
    page_size: int,
    dtype=None,
    draft_config: ModelConfig | None = None,
    prefill_chunk: int = 256,
    kv_cache_dtype=None,
    rules=RULES,
) -> MemoryPlan:
    """Bytes per device to generate `batch` rows of up to `max_len` tokens (prompt + new).

    dtype: of params, cache and activations (default: the config's compute dtype).
    params: every param's elements / its shard count × itemsize (rules as in `load`).
    kv_cache: K and V pages [L, K, P, Z, H] with P = batch × ceil(max_len / page_size),
      Z = page_size, K split over `model` when the rules shard it and P over `data` when
      the rows are (each data shard owns its rows' pages), plus the int32 page table and
      lengths (rows over `data`); pages of `kv_cache_dtype` (default `dtype`; "int8" adds
      float32 scales [L, K, P, Z] for K and for V).
    draft_*: the same for `draft_config` (a `DraftModel`) with the same batch, length and
      `kv_cache_dtype` (as `generate` gives the draft's cache the target's).
    activations (one layer live at a time, a prefill chunk of C = min(prefill_chunk,
      max_len) tokens, b = rows per data shard, N', K', F', V' = per-shard counts,
      S = ceil(max_len / page_size) × page_size):
        itemsize·b·C·(4·D + (N' + 2·K')·H + 2·F')   residual, norm, attn/mlp out; q/k/v; gate/up
      + 4·b·C·V'                                      float32 logits of the chunk
      + 4·b·N'·C·S                                    float32 attention scores of one layer
    """
    dtype = jnp.dtype(dtype or config.dtype)
    shape = dict(mesh_shape)
    kw = dict(batch=batch, max_len=max_len, page_size=page_size, dtype=dtype, rules=rules)
    kv_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype) or dtype

    def per_shard(logical: str, count: int) -> int:
        axis = mesh_axis(logical, count, shape, rules=rules)
        return count // (shape[axis] if axis else 1)

    c = config
    b = per_shard("batch", batch)
    chunk = min(prefill_chunk, max_len)
    s = -(-max_len // page_size) * page_size
    n, k = per_shard("heads", c.num_heads), per_shard("kv_heads", c.num_kv_heads)
    f, v = per_shard("mlp", c.intermediate_size), per_shard("vocab", c.vocab_size)
    acts = (dtype.itemsize * b * chunk * (4 * c.hidden_size + (n + 2 * k) * c.head_dim + 2 * f)
            + 4 * b * chunk * v + 4 * b * n * chunk * s)
    draft_p = draft_kv = 0
    if draft_config is not None:
        draft_p = params_bytes(draft_config, shape, dtype, rules=rules)
        draft_kv = cache_bytes(draft_config, shape, **kw | dict(dtype=kv_dtype))
    return MemoryPlan(shape, params_bytes(config, shape, dtype, rules=rules),
                      cache_bytes(config, shape, **kw | dict(dtype=kv_dtype)), draft_p,
                      draft_kv, acts)


def check_fits(config: ModelConfig, mesh_shape: Mapping[str, int], *, device_bytes: int,
               **plan_kwargs) -> MemoryPlan:
    """`plan_memory(...)`, raising `DoesNotFitError` if it needs more than `device_bytes`."""
    plan = plan_memory(config, mesh_shape, **plan_kwargs)
    if plan.total > device_bytes:
        raise DoesNotFitError(
            f"a {config.model_type} model with {config.param_count():,} params needs "
            f"{plan} but a device has {device_bytes / _GIB:.2f} GiB; use a larger model axis, "
            f"a smaller batch or max_len, or a narrower dtype")
    return plan
