"""How a speculative step commits the kept nodes' KV: one static choice of the loop.

`WriteThenCompact`: the verify forward writes the whole tree into the cache, and commit
moves the accepted nodes' slots into place (the Pallas kernels read new tokens from the
pages; meshes). `WriteKept`: the verify forward leaves the cache alone and commit writes
only the kept inputs' keys and values (the reference attention off-mesh), because a cache
written inside the verify `lax.switch` comes out in a new buffer that XLA copies into the
loop carry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.attention import resolve_backend
from specjax.cache import PagedKVCache, StepKV, write_slots
from specjax.sharding import rules as shard
from specjax.sharding.per_shard import move_slots


@dataclasses.dataclass(frozen=True)
class WriteThenCompact:
    name = "compact"
    write_in_verify = True  # the verify forward writes every tree node's KV

    def carry(self, out: StepKV, pad):
        """What a verify branch hands on: the cache with the tree written."""
        return out.cache

    def kept(self, carried: PagedKVCache, path_inputs: jax.Array):
        return carried

    def split(self, cache: PagedKVCache, out):
        """(cache, kept_kv) after the verify switch."""
        return out, None

    def apply(self, cache: PagedKVCache, kept_kv, accepted, lens, emit):
        """Accepted node at tree slot L + node moves to slot L + depth - 1, for the
        emitted ones."""
        dm = accepted.shape[1]
        src = lens[:, None] + jnp.maximum(accepted, 0)
        dst = lens[:, None] + jnp.arange(dm)[None, :]
        keep = (accepted >= 0) & (jnp.arange(dm)[None, :] < (emit - 1)[:, None])
        return move_slots(cache, src, dst, keep)


@dataclasses.dataclass(frozen=True)
class WriteKept:
    name = "write-kept"
    write_in_verify = False  # the verify forward attends to the tree beside the pages

    def carry(self, out: StepKV, pad):
        """What a verify branch hands on: the forward's new (keys, values), each
        [L, B, T, K, H] padded by `pad` along T to the whole tree's."""
        return pad(out.k), pad(out.v)

    def kept(self, carried, path_inputs: jax.Array):
        """The kept inputs' (keys, values) [L, B, Dm+1, K, H] of the forward's new ones."""
        idx = path_inputs[None, :, :, None, None]
        return tuple(jnp.take_along_axis(x, idx, axis=2, mode="clip") for x in carried)

    def split(self, cache: PagedKVCache, out):
        return cache, out

    def apply(self, cache: PagedKVCache, kept_kv, accepted, lens, emit):
        """Writes the root and the emitted accepted nodes, in order, from slot L - 1."""
        return write_slots(cache, *kept_kv, lens - 1, emit)


COMPACT, WRITE_KEPT = WriteThenCompact(), WriteKept()
STRATEGIES = {s.name: s for s in (COMPACT, WRITE_KEPT)}
Commit = WriteThenCompact | WriteKept


def default_commit(backend: str | None) -> Commit:
    """`WriteKept` with the reference attention off-mesh (the mesh active now), else
    `WriteThenCompact`."""
    if resolve_backend(backend) == "reference" and shard.active_mesh() is None:
        return WRITE_KEPT
    return COMPACT


def resolve(kv_commit: str | None, backend: str | None) -> Commit:
    """generate's `kv_commit` checked (None: `default_commit`)."""
    if kv_commit is None:
        return default_commit(backend)
    if kv_commit not in STRATEGIES:
        raise ValueError(f"kv_commit={kv_commit!r} must be one of {sorted(STRATEGIES)}")
    if kv_commit == WRITE_KEPT.name and default_commit(backend) is not WRITE_KEPT:
        raise ValueError("kv_commit='write-kept' needs the reference attention off-mesh")
    return STRATEGIES[kv_commit]
