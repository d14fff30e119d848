"""`PairQueue`: the pairs a speculator with its own cache has not consumed yet.

After a commit, a row's kept pairs (root and accepted nodes) become its queue and its
cache rolls back to the old root's position: what the draft wrote for tree nodes is
dropped, and the next `propose` feeds queue + new root in one call. While no row drafts,
a speculator may skip that call (`propose_lazily`, `can_skip`): the kept pairs then
pile up behind the queue, to be consumed in one call when a row drafts again or the
queue is full.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.speculators.base import CommitContext, ProposeContext
from specjax.tree import DraftTree

# Queue slots beyond a step's kept pairs: a forward of Q + 1 rows costs about what 2 do
# on CPU, so the pairs of skipped steps wait for one call.
QUEUE_SLACK = 8


@struct.dataclass
class PairQueue:
    items: tuple  # arrays [B, Q, ...]: what each queued pair carries (tokens, features)
    count: jax.Array  # [B] queued pairs per row
    skipped: jax.Array  # [] bool: the last propose made no draft call (commits append)

    @classmethod
    def zeros(cls, batch: int, max_depth: int, *items: tuple) -> "PairQueue":
        """An empty queue with room for a full step's pairs plus `QUEUE_SLACK`; items:
        (trailing shape, dtype) of each array a pair carries."""
        q = max_depth + 1 + QUEUE_SLACK
        return cls(tuple(jnp.zeros((batch, q) + tuple(shape), dt) for shape, dt in items),
                   jnp.zeros((batch,), jnp.int32), jnp.bool_(False))

    def has_room(self) -> jax.Array:
        """[] bool: every row's queue can take one more pair."""
        return jnp.all(self.count + 1 < self.items[0].shape[1])

    def mark_skipped(self, skipped: bool = True) -> "PairQueue":
        return self.replace(skipped=jnp.bool_(skipped))

    def push(self, ctx: CommitContext, cache, kept: tuple) -> tuple[Any, "PairQueue"]:
        """A commit's kept pairs (`kept` arrays [B, J, ...]) -> (cache, queue).

        Rows with pairs replace their queue with them and roll the cache back to the old
        root; after a skipped propose nothing was consumed, so they go after the queue
        and the cache stays where it is. Rows without pairs keep everything.
        """
        act = ctx.num_pairs > 0
        b, q = self.count.shape[0], self.items[0].shape[1]
        j = jnp.arange(kept[0].shape[1])[None, :]
        slot = jnp.where(j < ctx.num_pairs[:, None], self.count[:, None] + j, q)  # past Q: dropped
        rows = jnp.arange(b)[:, None]

        def put(old, new):
            new = new.astype(old.dtype)
            pad = [(0, 0), (0, old.shape[1] - new.shape[1])] + [(0, 0)] * (new.ndim - 2)
            sel = act.reshape((-1,) + (1,) * (old.ndim - 1))
            replaced = jnp.where(sel, jnp.pad(new, pad), old)
            appended = old.at[rows, slot].set(new, mode="drop")
            return jnp.where(self.skipped, appended, replaced)

        rolled = jnp.where(act, ctx.positions[:, 0], cache.lengths)
        lengths = jnp.where(self.skipped, cache.lengths, rolled)
        count = jnp.where(act, ctx.num_pairs + jnp.where(self.skipped, self.count, 0),
                          self.count)
        items = tuple(put(o, n) for o, n in zip(self.items, kept))
        return cache.replace(lengths=lengths), self.replace(items=items, count=count)


def propose_lazily(state, ctx: ProposeContext, empty: DraftTree,
                   run: Callable[[], tuple[DraftTree, Any]]) -> tuple[DraftTree, Any]:
    """`run()` (a propose that consumes `state.queue`), or, when no row drafts this step
    and the queue has room for one more pair, no call at all: the `empty` tree, and the
    next commit appends."""
    def go():
        tree, new = run()
        return tree, new.replace(queue=new.queue.mark_skipped(False))

    idle = (ctx.levels == 0) & state.queue.has_room()
    return jax.lax.cond(idle, lambda: (empty, skip(None, state)), go)


def can_skip(spec, state) -> jax.Array:
    """`Speculator.can_skip` of a speculator whose state holds a `queue`."""
    return state.queue.has_room()


def skip(spec, state):
    """`Speculator.skip` of a speculator whose state holds a `queue`."""
    return state.replace(queue=state.queue.mark_skipped())
