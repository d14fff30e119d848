"""The block-paged KV cache (a pytree) and the host-side page pool that hands out pages.

`PagedKVCache` holds every layer's key/value pages, one page table per row and one
committed length per row. It is immutable: writes return a new cache (`.at[].set`,
`mode="drop"` for padding), so a whole generation can run inside `lax.while_loop` with
the cache donated. Page 0..P-1 are shared by all rows; which page holds which tokens is
the page table's business, so rows can grow, shrink and be recycled independently.

Axis letters: L layers, K KV heads, P pages, Z page size, H head_dim, B rows, M pages
per row, T new tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.config import ModelConfig


class OutOfPagesError(ValueError):
    """The page pool cannot hold the requested tokens."""


@struct.dataclass
class PagedKVCache:
    k_pages: jax.Array  # [L, K, P, Z, H]
    v_pages: jax.Array  # [L, K, P, Z, H]
    page_table: jax.Array  # [B, M] int32
    lengths: jax.Array  # [B] int32, committed tokens per row

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def capacity(self) -> int:
        """Tokens one row can hold: pages per row × page size."""
        return self.page_table.shape[1] * self.page_size

    @classmethod
    def create(cls, config: ModelConfig, page_table: jax.Array, *, num_pages: int,
               page_size: int, dtype=None, lengths: jax.Array | None = None) -> "PagedKVCache":
        """Zeroed pages for `config`; `page_table` [B, M] from a `PagePool`.

        Under an active mesh (`jax.set_mesh`) the cache is laid out by the sharding rules
        (KV heads over `model`, rows over `data`); call it inside `jax.jit` so the pages
        are created shard by shard rather than on one device first.
        """
        from specjax.sharding.rules import constrain_cache

        dtype = dtype or config.dtype
        shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
        page_table = jnp.asarray(page_table, jnp.int32)
        if lengths is None:
            lengths = jnp.zeros((page_table.shape[0],), jnp.int32)
        return constrain_cache(cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), page_table,
                                   jnp.asarray(lengths, jnp.int32)))


def slot_pages(page_table: jax.Array, slots: jax.Array, valid: jax.Array, page_size: int,
               num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page id, offset) of each row's KV slot [B, T]; invalid slots map past the pool (dropped)."""
    m = page_table.shape[1]
    page_idx = jnp.clip(slots // page_size, 0, m - 1)
    page = jnp.take_along_axis(page_table, page_idx, axis=1)
    valid = valid & (slots >= 0) & (slots < m * page_size)
    return jnp.where(valid, page, num_pages), slots % page_size


def write_kv(
    pages: jax.Array,  # [L, K, P, Z, H]
    layer: jax.Array,  # [] int32
    new: jax.Array,  # [B, T, K, H]
    page: jax.Array,  # [B, T] int32 (P = drop)
    offset: jax.Array,  # [B, T] int32
) -> jax.Array:
    """Writes `new` into layer `layer` at (page, offset); out-of-range pages are dropped."""
    return pages.at[layer, :, page, offset].set(new.astype(pages.dtype), mode="drop")


def move_slots(cache: PagedKVCache, src: jax.Array, dst: jax.Array,
               valid: jax.Array) -> PagedKVCache:
    """Copies KV of slots `src` [B, T] to slots `dst` [B, T] of the same row, in every layer.

    Used by tree commit: accepted nodes are compacted from their tree slots into the
    contiguous slots that follow the committed prefix.
    """
    z, p = cache.page_size, cache.num_pages
    sp, so = slot_pages(cache.page_table, src, valid, z, p)
    dp, do = slot_pages(cache.page_table, dst, valid, z, p)
    sp = jnp.minimum(sp, p - 1)

    def move(pages):  # [L, K, P, Z, H]
        vals = pages[:, :, sp, so]  # [L, K, B, T, H]
        return pages.at[:, :, dp, do].set(vals, mode="drop")

    return cache.replace(k_pages=move(cache.k_pages), v_pages=move(cache.v_pages))


@dataclasses.dataclass
class PagePool:
    """Host-side allocator of cache pages to sequences (what continuous batching uses).

    Pages are plain ints; a sequence owns a list of them. `allocate` grows a sequence to
    hold `num_tokens`, `release` returns its pages. Running out raises `OutOfPagesError`
    naming how many pages were asked for and how many are free.
    """

    num_pages: int
    page_size: int

    def __post_init__(self):
        if self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages} must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._owned: dict[object, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Ensures `seq_id` owns pages for `num_tokens` tokens; returns its page list."""
        owned = self._owned.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(owned)
        if need > len(self._free):
            raise OutOfPagesError(
                f"out of cache pages: sequence {seq_id!r} needs {need} more page(s) of "
                f"{self.page_size} tokens for {num_tokens} tokens, but only "
                f"{len(self._free)} of {self.num_pages} are free; raise num_pages")
        for _ in range(max(need, 0)):
            owned.append(self._free.pop())
        return list(owned)

    def release(self, seq_id) -> None:
        self._free.extend(reversed(self._owned.pop(seq_id, [])))

    def page_table(self, seq_ids, pages_per_row: int) -> np.ndarray:
        """[B, pages_per_row] int32 table; unused entries point at page 0 (never read)."""
        table = np.zeros((len(seq_ids), pages_per_row), np.int32)
        for row, sid in enumerate(seq_ids):
            pages = self._owned.get(sid, [])
            if len(pages) > pages_per_row:
                raise ValueError(
                    f"sequence {sid!r} owns {len(pages)} pages > pages_per_row={pages_per_row}")
            table[row, :len(pages)] = pages
        return table
