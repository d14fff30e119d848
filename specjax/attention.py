"""The one attention entry point of specjax: picks the Pallas kernel or its plain-jnp
reference, both in `specjax.pallas_kernels.ragged_paged_attention` (`pallas_kernels/`);
the reference reads long query chunks (prefill) block by block (`blockwise.py` there).

Every model call (decode T=1, chain verify T=k+1, tree verify T=nodes, prefill chunk)
goes through `paged_attention`. Its contract, shared by both backends:

* Row b has `kv_lens[b]` valid KV slots in its pages, the last `q_lens[b]` of which are
  the new tokens this call wrote; query t of row b sits at slot
  `kv_lens[b] - q_lens[b] + t`. Queries t >= q_lens[b] are padding; their output is
  unspecified (finite) and callers ignore it.
* A query sees every prefix slot (`j < kv_lens - q_lens`) and, among the new tokens,
  those its mask allows: causal (`j <= t`) when `mask` is None, else `mask[b, t, j]`
  (a tree mask: a node sees itself and its ancestors).
* Slots at or past `kv_lens[b]`, and pages the table does not name, are never read into
  the output, even if they hold NaN.
* int8 pages come with float32 scales [K, P, Z] (`k_scales`, `v_scales`; one per token
  and KV head, `specjax.kv_quant`) and are attended as `dequantize`d to q's dtype.
* With `new_kv=(k, v)` ([B, T, K, H] each) the new tokens are not in the pages: their
  slots `kv_lens - q_lens + t` may hold anything and are never read; the keys/values
  come from `new_kv` (reference backend, off-mesh: how verify forwards skip writing
  a tree the loop mostly throws away, `reference_attention_with_new`). They are seen
  as the pages would hand them back (`kv_quant.as_cached`: int8 quantized, a narrower
  float dtype rounded), so the output is that of writing them and attending.

Axis letters and the shape aliases in the signatures: `specjax.typing`.
"""

from __future__ import annotations

import os
from typing import Callable

import jax

from specjax import cpu_attention, kv_quant
from specjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from specjax.pallas_kernels.ragged_paged_attention.blockwise import (
    blockwise_ragged_paged_attention,
)
from specjax.pallas_kernels.ragged_paged_attention.reference import (
    allowed_mask,
    attend,
    attend_parts,
    reference_attention_with_new,
    reference_ragged_paged_attention as reference_paged_attention,
)
from specjax.typing import (
    LayerIndex,
    LayerPages,
    LayerScales,
    NewKV,
    PageTable,
    Queries,
    RowLengths,
    TreeMask,
)

__all__ = ["BACKENDS", "allowed_mask", "attend", "attend_parts", "default_backend", "kernel",
           "one_layer", "paged_attention", "reads_used_slots",
           "reference_attention_with_new", "reference_paged_attention", "resolve_backend"]

BACKENDS = ("reference", "pallas")
_ENV = "SPECJAX_ATTENTION"
# Calls with at least this many query tokens (prefill chunks) take the reference backend's
# blockwise form, which reads only the pages before the batch's end; fewer (decode,
# verify) gather the whole table in one piece, where the loop over blocks measured
# slower (docs/benchmarks.md, "Prompt processing")
BLOCKWISE_MIN_QUERIES = 64


def default_backend() -> str:
    """`SPECJAX_ATTENTION` if set, else Pallas on GPU/TPU and the reference on CPU."""
    env = os.environ.get(_ENV)
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{_ENV}={env!r} must be one of {BACKENDS}")
        return env
    return "reference" if jax.default_backend() == "cpu" else "pallas"


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} must be one of {BACKENDS}")
    return backend


def kernel(backend: str | None) -> Callable:
    """The function `backend` names, both of the same signature: the plain-jnp reference
    or the Pallas kernel."""
    if resolve_backend(backend) == "reference":
        return reference_paged_attention
    return ragged_paged_attention


def _reference_for(queries: int) -> Callable:
    """The reference backend's form for `queries` tokens per row (`BLOCKWISE_MIN_QUERIES`)."""
    if queries >= BLOCKWISE_MIN_QUERIES:
        return blockwise_ragged_paged_attention
    return reference_paged_attention


def reads_used_slots(backend: str | None, head_dim: int | None = None,
                     kv_dtype=None) -> bool:
    """Whether decode and verify calls read only each row's cached tokens (the Pallas
    kernels; on CPU the paged-attention kernel `paged_attention` hands them to) rather
    than every slot of the page table (the jnp reference's one-piece form): on CPU,
    pages of `head_dim` and `kv_dtype` the kernel `cpu_attention.takes`."""
    if resolve_backend(backend) != "reference":
        return True
    return cpu_attention.takes(head_dim, kv_dtype)


def one_layer(layer: LayerIndex, *stacked):
    """Each of the stacked [L, ...] arrays (pages, scales; None stays None) at `layer`."""
    return tuple(None if x is None else x[layer] for x in stacked)


def paged_attention(
    q: Queries,
    k_pages: LayerPages,
    v_pages: LayerPages,
    page_table: PageTable,
    kv_lens: RowLengths,
    q_lens: RowLengths,
    mask: TreeMask | None = None,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
    new_kv: tuple[NewKV, NewKV] | None = None,
    k_scales: LayerScales | None = None,  # float32 when the pages are int8
    v_scales: LayerScales | None = None,
    layer: LayerIndex | None = None,  # given: the pages (and scales) are all layers'
) -> Queries:
    """Attention of T new query tokens per row against a paged KV cache (see module doc),
    on one device or within one shard; on a mesh `specjax.sharding.per_shard
    .paged_attention` runs it once per shard. With `layer`, the pages are all layers'
    and this attends over that one (the CPU kernel reads it in place)."""
    backend = resolve_backend(backend)
    if new_kv is not None:
        if backend != "reference":
            raise ValueError("new_kv (keys/values beside the pages) needs the reference "
                             f"backend off-mesh (got backend={backend!r})")
        # as a write to the pages and a read would see them
        new_kv = tuple(kv_quant.as_cached(x, k_pages.dtype) for x in new_kv)
    if (backend == "reference" and q.shape[1] < BLOCKWISE_MIN_QUERIES
            and cpu_attention.applies(q, k_pages, k_scales)):
        if layer is None:  # one layer's pages: a stack of one
            k_pages, v_pages, k_scales, v_scales = (
                None if x is None else x[None] for x in (k_pages, v_pages, k_scales, v_scales))
            layer = 0
        return cpu_attention.paged_attention(
            q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, mask, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, new_kv=new_kv,
            k_scales=k_scales, v_scales=v_scales)
    if layer is not None:
        k_pages, v_pages, k_scales, v_scales = one_layer(layer, k_pages, v_pages, k_scales,
                                                         v_scales)
    if new_kv is not None:
        return reference_attention_with_new(
            q, *new_kv, q_lens, mask, k_pages, v_pages, page_table, kv_lens - q_lens,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
            k_scales=k_scales, v_scales=v_scales)
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if k_scales is not None:
        opts.update(k_scales=k_scales, v_scales=v_scales)
    run = _reference_for(q.shape[1]) if backend == "reference" else kernel(backend)
    return run(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, **opts)
