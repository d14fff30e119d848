"""The block-paged KV cache (a pytree) and the host-side page pool that hands out pages.

`PagedKVCache` holds every layer's key/value pages, one page table per row and one
committed length per row. It is immutable: writes return a new cache (`.at[].set`,
`mode="drop"` for padding), so a whole generation can run inside `lax.while_loop` with
the cache donated. Which page holds which tokens is the page table's business, so rows
can grow, shrink and be recycled independently.

On a mesh whose `data` axis splits the rows, the page axis is split with them: data
shard i holds pages [i·P/d, (i+1)·P/d) and its rows' page tables name them by
shard-local ids 0..P/d-1 (a `PagePool` with `num_shards=d` hands them out). This module
knows nothing of meshes: its functions are what one device (or one shard) does, and
`specjax.sharding.per_shard` runs writes, moves and attention per shard under
`shard_map`, so no page ever crosses devices and each device holds 1/d of the pool.
Without a split (one device, or rows replicated) local ids are global ids.

An int8 cache (`dtype=jnp.int8`, `generate(..., kv_cache_dtype="int8")`) holds int8
pages and one float32 scale per token and KV head beside them (`k_scales`, `v_scales`;
`specjax.kv_quant`); writes quantize, moves carry the scales along, and attention
dequantizes. Float caches leave the scales None.

Axis letters: L layers, K KV heads, P pages, Z page size, H head_dim, B rows, M pages
per row, T new tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import cpu_slot_write, kv_quant
from specjax.config import ModelConfig
from specjax.typing import LayerIndex, NewKV, PageTable, RowLengths, SlotIndex, SlotValid


class OutOfPagesError(ValueError):
    """The page pool cannot hold the requested tokens."""


@struct.dataclass
class PagedKVCache:
    k_pages: jax.Array  # [L, K, P, Z, H]
    v_pages: jax.Array  # [L, K, P, Z, H]
    page_table: jax.Array  # [B, M] int32
    lengths: jax.Array  # [B] int32, committed tokens per row
    k_scales: jax.Array | None = None  # [L, K, P, Z] float32 for int8 pages, else None
    v_scales: jax.Array | None = None  # [L, K, P, Z] float32

    @property
    def quantized(self) -> bool:
        """int8 pages with per-token scales (`specjax.kv_quant`)."""
        return self.k_scales is not None

    @property
    def kv(self) -> tuple:
        """(k_pages, v_pages, k_scales, v_scales): what a forward reads and writes."""
        return self.k_pages, self.v_pages, self.k_scales, self.v_scales

    def with_kv(self, kv: tuple) -> "PagedKVCache":
        k_pages, v_pages, k_scales, v_scales = kv
        return self.replace(k_pages=k_pages, v_pages=v_pages, k_scales=k_scales,
                            v_scales=v_scales)

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
    def create(cls, config: ModelConfig, page_table: PageTable, *, num_pages: int,
               page_size: int, dtype=None,
               lengths: RowLengths | None = None) -> "PagedKVCache":
        """Zeroed pages for `config`; `page_table` [B, M] from a `PagePool`.

        dtype: of the pages (default the config's); `jnp.int8` makes an int8 cache with
        float32 scales beside the pages. On a mesh: `specjax.sharding.create_cache`.
        """
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
        page_table = jnp.asarray(page_table, jnp.int32)
        if lengths is None:
            lengths = jnp.zeros((page_table.shape[0],), jnp.int32)
        scales = ((jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32))
                  if kv_quant.is_quantized(dtype) else (None, None))
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), page_table,
                   jnp.asarray(lengths, jnp.int32), *scales)

    @classmethod
    def for_rows(cls, config: ModelConfig, batch: int, pages_per_row: int, page_size: int,
                 dtype=None, num_shards: int = 1) -> "PagedKVCache":
        """A zeroed cache giving each of `batch` rows its own `pages_per_row` pages, from
        `num_shards` pools (what a speculator's own cache uses; on a mesh:
        `specjax.sharding.cache_for_rows`)."""
        pool = PagePool(batch * pages_per_row, page_size, num_shards=num_shards)
        table = pool.allocate_rows([pages_per_row * page_size] * batch, pages_per_row)
        return cls.create(config, table, num_pages=pool.num_pages, page_size=page_size,
                          dtype=dtype)


def slot_pages(page_table: PageTable, slots: SlotIndex, valid: SlotValid,
               page_size: int, num_pages: int) -> tuple[SlotIndex, SlotIndex]:
    """(page id, offset) of each row's KV slot [B, T]; invalid slots map past the pool (dropped)."""
    m = page_table.shape[1]
    page_idx = jnp.clip(slots // page_size, 0, m - 1)
    page = jnp.take_along_axis(page_table, page_idx, axis=1)
    valid = valid & (slots >= 0) & (slots < m * page_size)
    return jnp.where(valid, page, num_pages), slots % page_size


def write_kv(
    pages: jax.Array,  # [L, K, P, Z, H] (or scales [L, K, P, Z])
    layer: jax.Array,  # [] int32
    new: jax.Array,  # [B, T, K, H] (or [B, T, K])
    page: jax.Array,  # [B, T] int32 (>= P = drop)
    offset: jax.Array,  # [B, T] int32
) -> jax.Array:
    """Writes `new` into layer `layer` at (page, offset); out-of-range pages are dropped.
    2-byte float pages on CPU are written in place by `specjax.cpu_slot_write`."""
    if cpu_slot_write.applies(pages):
        return cpu_slot_write.write(pages, layer, new, page, offset)
    return pages.at[layer, :, page, offset].set(new.astype(pages.dtype), mode="drop")


def write_layer_kv(
    kv: tuple,  # PagedKVCache.kv: (k_pages, v_pages, k_scales | None, v_scales | None)
    layer: LayerIndex,
    k: NewKV,
    v: NewKV,
    page: SlotIndex,  # >= P = drop
    offset: SlotIndex,
    write=write_kv,  # the array write (`specjax.sharding.per_shard.write_kv` on a mesh)
) -> tuple:
    """One layer's new keys and values written into `kv`; int8 pages get them quantized
    (`kv_quant.quantize`) and their scales beside them."""
    k_pages, v_pages, k_scales, v_scales = kv
    if k_scales is None:
        return (write(k_pages, layer, k, page, offset),
                write(v_pages, layer, v, page, offset), None, None)
    (kq, ks), (vq, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    return tuple(write(a, layer, new, page, offset)
                 for a, new in ((k_pages, kq), (v_pages, vq), (k_scales, ks), (v_scales, vs)))


def layer_kv(kv: tuple, layer) -> dict:
    """The attention arguments of one layer of `kv`: all layers' pages [L, K, P, Z, H]
    (and, for int8 pages, their scales [L, K, P, Z]) with the `layer` to attend over;
    the attention slices it, or reads it in place (`specjax.cpu_attention`)."""
    k_pages, v_pages, k_scales, v_scales = kv
    out = dict(k_pages=k_pages, v_pages=v_pages, layer=layer)
    if k_scales is not None:
        out.update(k_scales=k_scales, v_scales=v_scales)
    return out


def write_kv_layers(
    pages: jax.Array,  # [L, K, P, Z, H]
    new: jax.Array,  # [L, B, T, K, H]
    page: jax.Array,  # [B, T] int32 (>= P = drop)
    offset: jax.Array,  # [B, T] int32
) -> jax.Array:
    """`write_kv` for every layer at once (keys or values a forward returned, see
    `write_slots`). Single-device only, as the forwards that leave their write to the
    caller are; meshes write inside the layers (`specjax.sharding.per_shard.write_kv`)."""
    if cpu_slot_write.applies(pages):
        return cpu_slot_write.write(pages, None, new, page, offset)
    vals = jnp.moveaxis(new, 3, 1).astype(pages.dtype)  # [L, K, B, T, H] (or [L, K, B, T])
    return pages.at[:, :, page, offset].set(vals, mode="drop")


def write_slots(cache: "PagedKVCache", k_new: jax.Array, v_new: jax.Array,
                start: jax.Array, count: jax.Array) -> "PagedKVCache":
    """Writes k_new/v_new [L, B, T, K, H] entries t < count[b] at slots start[b] + t of
    every layer (lengths unchanged): the one write of keys/values a forward returned
    instead of writing them (`commit_step`; the speculative loop's kept tokens)."""
    t = k_new.shape[2]
    slots = start[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < count[:, None]
    page, offset = slot_pages(cache.page_table, slots, valid, cache.page_size,
                              cache.num_pages)
    if not cache.quantized:
        return cache.replace(k_pages=write_kv_layers(cache.k_pages, k_new, page, offset),
                             v_pages=write_kv_layers(cache.v_pages, v_new, page, offset))
    (kq, ks), (vq, vs) = kv_quant.quantize(k_new), kv_quant.quantize(v_new)
    return cache.replace(k_pages=write_kv_layers(cache.k_pages, kq, page, offset),
                         v_pages=write_kv_layers(cache.v_pages, vq, page, offset),
                         k_scales=write_kv_layers(cache.k_scales, ks, page, offset),
                         v_scales=write_kv_layers(cache.v_scales, vs, page, offset))


@struct.dataclass
class StepKV:
    """What a model forward hands back about its T new tokens: their keys/values as
    computed (float, also over int8 pages: the write quantizes) and the cache as the
    forward left it, lengths as given. `written`: the forward wrote the tokens into the
    pages inside its layers (before attending); else the pages are untouched."""

    k: jax.Array  # [L, B, T, K, H]
    v: jax.Array  # [L, B, T, K, H]
    cache: PagedKVCache | None  # None: a plain forward without a cache
    q_lens: jax.Array  # [B] int32 valid new tokens per row
    written: bool = struct.field(pytree_node=False, default=True)


def commit_step(out: StepKV) -> PagedKVCache | None:
    """The cache with all of a forward's valid new tokens written and its lengths grown
    by them: the tokens written here unless the forward's layers did."""
    if out.cache is None:
        return None
    cache = out.cache
    if not out.written:
        cache = write_slots(cache, out.k, out.v, cache.lengths, out.q_lens)
    return cache.replace(lengths=cache.lengths + out.q_lens)


def move_slot_arrays(page_table, src, dst, valid, *arrays) -> tuple:
    """`move_slots` on the cache's arrays (pages, then scales if int8) as a tuple."""
    z, p = arrays[0].shape[3], arrays[0].shape[2]  # this shard's pages
    sp, so = slot_pages(page_table, src, valid, z, p)
    dp, do = slot_pages(page_table, dst, valid, z, p)
    sp = jnp.minimum(sp, p - 1)

    def move(pages):  # [L, K, P, Z, H] pages or [L, K, P, Z] scales
        if cpu_slot_write.applies(pages):
            return cpu_slot_write.move(pages, sp, so, dp, do)
        vals = pages[:, :, sp, so]  # [L, K, B, T, H] or [L, K, B, T]
        return pages.at[:, :, dp, do].set(vals, mode="drop")

    return tuple(move(a) for a in arrays)


def move_slots(cache: PagedKVCache, src: jax.Array, dst: jax.Array,
               valid: jax.Array) -> PagedKVCache:
    """Copies KV of slots `src` [B, T] to slots `dst` [B, T] of the same row, in every layer.

    Used by tree commit: accepted nodes are compacted from their tree slots into the
    contiguous slots that follow the committed prefix (on a mesh:
    `specjax.sharding.per_shard.move_slots`).
    """
    arrays = tuple(a for a in cache.kv if a is not None)  # pages, then scales if int8
    return with_moved(cache, move_slot_arrays(cache.page_table, src, dst, valid, *arrays))


def with_moved(cache: PagedKVCache, moved: tuple) -> PagedKVCache:
    """`cache` with the arrays `move_slot_arrays` returned."""
    scales = tuple(moved[2:]) if cache.quantized else (None, None)
    return cache.with_kv(tuple(moved[:2]) + scales)


@dataclasses.dataclass
class PagePool:
    """Host-side allocator of cache pages to sequences (what continuous batching uses).

    Pages are plain ints; a sequence owns a list of them. `allocate` grows a sequence to
    hold `num_tokens`, `release` returns its pages. Running out raises `OutOfPagesError`
    naming how many pages were asked for and how many are free.

    num_shards: data shards (`specjax.sharding.page_shards`). Each owns an equal block of
    `num_pages // num_shards` pages, and a sequence lives on one shard: its page ids are
    local to that block, as the per-shard cache reads them. A batch's rows split into
    `num_shards` equal contiguous blocks, as `batch` splits over `data`, so row r of B
    belongs to shard r // (B / num_shards) (`shard_of_row`).
    """

    num_pages: int
    page_size: int
    num_shards: int = 1

    def __post_init__(self):
        if self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages} must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        if self.num_shards < 1 or self.num_pages % self.num_shards:
            raise ValueError(f"num_pages={self.num_pages} must be a multiple of num_shards="
                             f"{self.num_shards} (each data shard owns an equal block of pages)")
        per = self.pages_per_shard
        self._free = [list(range(per - 1, -1, -1)) for _ in range(self.num_shards)]
        self._owned: dict[object, list[int]] = {}
        self._shard: dict[object, int] = {}

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.num_shards

    @property
    def free_pages(self) -> int:
        return sum(len(f) for f in self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def shard_of_row(self, row: int, batch: int) -> int:
        """The data shard that holds row `row` of a `batch`-row page table."""
        if batch % self.num_shards:
            raise ValueError(f"batch={batch} rows do not split over num_shards="
                             f"{self.num_shards} data shards")
        return row // (batch // self.num_shards)

    def allocate(self, seq_id, num_tokens: int, shard: int = 0) -> list[int]:
        """Ensures `seq_id` owns pages for `num_tokens` tokens on data shard `shard`;
        returns its page ids (local to that shard's block)."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard={shard} must be in [0, num_shards={self.num_shards})")
        home = self._shard.setdefault(seq_id, shard)
        if home != shard:
            raise ValueError(f"sequence {seq_id!r} owns pages on data shard {home}, not "
                             f"shard={shard}")
        owned = self._owned.setdefault(seq_id, [])
        free = self._free[shard]
        need = self.pages_for(num_tokens) - len(owned)
        if need > len(free):
            where = f" on data shard {shard}" if self.num_shards > 1 else ""
            raise OutOfPagesError(
                f"out of cache pages{where}: sequence {seq_id!r} needs {need} more page(s) "
                f"of {self.page_size} tokens for {num_tokens} tokens, but only {len(free)} "
                f"of {self.pages_per_shard} are free; raise num_pages")
        for _ in range(max(need, 0)):
            owned.append(free.pop())
        return list(owned)

    def release(self, seq_id) -> None:
        pages = self._owned.pop(seq_id, [])
        self._free[self._shard.pop(seq_id, 0)].extend(reversed(pages))

    def page_table(self, seq_ids, pages_per_row: int) -> np.ndarray:
        """[B, pages_per_row] int32 table of shard-local ids; unused entries point at page
        0 (never read). Row r's sequence must live on `shard_of_row(r, B)`."""
        table = np.zeros((len(seq_ids), pages_per_row), np.int32)
        for row, sid in enumerate(seq_ids):
            pages = self._owned.get(sid, [])
            if len(pages) > pages_per_row:
                raise ValueError(
                    f"sequence {sid!r} owns {len(pages)} pages > pages_per_row={pages_per_row}")
            if pages and self._shard[sid] != self.shard_of_row(row, len(seq_ids)):
                raise ValueError(
                    f"sequence {sid!r} owns pages on data shard {self._shard[sid]} but sits in "
                    f"row {row}, which data shard {self.shard_of_row(row, len(seq_ids))} holds")
            table[row, :len(pages)] = pages
        return table

    def allocate_rows(self, num_tokens, pages_per_row: int) -> np.ndarray:
        """Allocates row r (sequence id r) `num_tokens[r]` tokens on the data shard that
        holds it; returns the [B, pages_per_row] page table."""
        b = len(num_tokens)
        for row, n in enumerate(num_tokens):
            self.allocate(row, n, shard=self.shard_of_row(row, b))
        return self.page_table(list(range(b)), pages_per_row)
