"""The speculator protocol: a pytree (params + static settings) and four pure functions.

A speculator never mutates Python state inside the loop. Its
per-generation state is a pytree it creates in `init` and threads through:

  init(target_config, batch, capacity)            -> state
  prefill(state, PrefillChunk, target_params)     -> state   (once per prompt chunk)
  propose(state, ProposeContext, target_params)   -> (DraftTree, state)
  commit(state, CommitContext, target_params)     -> state   (after each verification)

What the loop tells a speculator, in "pairs": a target input at position i with its
hidden state h_i, and the token x_{i+1} that follows it. Prefill hands over the pairs of
the prompt (all but the last, whose follower is not sampled yet); every commit hands
over the pairs of the verified inputs that were kept: the root and the accepted nodes,
each with the token after it (the next accepted token, or the bonus). So after a commit
the speculator has seen every pair up to the new root, and its next `propose` drafts
the root's children. Draft models and EAGLE heads keep their own paged caches in the
state; n-gram reads the token buffer of the context.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig
from specjax.models.transformer import Hidden
from specjax.sampling import Sampling
from specjax.tree import DraftTree


@struct.dataclass
class PrefillChunk:
    tokens: jax.Array  # [B, C] target inputs of this chunk
    next_tokens: jax.Array  # [B, C] the token after each input (valid for pairs only)
    positions: jax.Array  # [B, C] their positions
    num_pairs: jax.Array  # [B] leading entries of this chunk that are complete pairs
    hidden: Hidden  # target hidden states of the chunk's inputs


@struct.dataclass
class ProposeContext:
    tokens: jax.Array  # [B, S] every token so far (prompt + generated), 0 after lengths
    lengths: jax.Array  # [B] tokens so far; the root is tokens[b, lengths[b] - 1]
    active: jax.Array  # [B] bool rows still generating
    sampling: Sampling
    key: jax.Array  # [B] one key per row (`specjax.rng`): a row's draws are its own
    # [B] int32: the loop keeps only nodes with depth <= depth_limit (adaptive length);
    # a speculator may skip draft work beyond max(depth_limit) to save its cost.
    depth_limit: jax.Array


@struct.dataclass
class CommitContext:
    tokens: jax.Array  # [B, Dm+1] inputs kept: root then accepted nodes (0 padding)
    next_tokens: jax.Array  # [B, Dm+1] the token after each kept input
    positions: jax.Array  # [B, Dm+1] their positions
    num_pairs: jax.Array  # [B] kept inputs (0 for inactive rows)
    hidden: Hidden  # target hidden states of the kept inputs, [B, Dm+1, ...]
    num_accepted: jax.Array  # [B] accepted draft tokens this step
    lengths: jax.Array  # [B] tokens so far after the commit (new root at lengths - 1)


class Speculator:
    """Base class; subclasses are `flax.struct.dataclass`es (pytrees) implementing the four
    functions. Static fields (`pytree_node=False`) are part of the compiled program."""

    #: target decoder layers whose outputs `prefill`/`commit` need (EAGLE-3: low/mid/high)
    hidden_layers: tuple[int, ...] = ()
    #: verification method for sampled decoding: "rejection" (lossless), "block" (chains,
    #: lossless) or "typical" (lossy); `generate(verification=)` overrides it
    verification: str = "rejection"

    @property
    def proposes_chains(self) -> bool:
        """Whether every proposed tree is a chain (parents -1, 0, 1, ...): what block
        verification needs (static)."""
        return False

    @property
    def num_nodes(self) -> int:
        """N: nodes in every proposed tree (static)."""
        raise NotImplementedError

    @property
    def max_depth(self) -> int:
        raise NotImplementedError

    @property
    def depth_widths(self) -> tuple[int, ...]:
        """W[d], d = 0..max_depth (static): every node of depth <= d of a proposed tree is
        among its first W[d] nodes. When no kept node is deeper than d, the loop verifies
        only those W[d] nodes (a cheaper target forward; W[0] = 0 is a plain decode
        step). The default knows nothing of the layout: all nodes, or none."""
        return (0,) + (self.num_nodes,) * self.max_depth

    def for_decoding(self, layout: str = "auto") -> "Speculator":
        """This speculator with its weights in the layer layout `generate` decodes with
        (`specjax.model.decode_params`); `generate` calls it off-mesh."""
        return self

    def check_target(self, target_config: ModelConfig) -> None:
        """Raises a clear error if this speculator cannot serve `target_config`."""

    def cost_ratio(self, target_config: ModelConfig) -> float:
        """Estimated cost of one draft call relative to one one-token target forward
        (for the analytical speedup and adaptive length); 0 for free drafts like n-gram.
        `specjax.calibrate.measured_cost_ratio` measures it."""
        return 0.0

    def draft_calls_per_step(self) -> int:
        """Draft calls of a full-depth step; drafting k positions makes min(k, this) (a
        chain draft: one per position; Medusa: one). `cost_ratio` is per call."""
        return 0

    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> Any:
        """The speculator's state for `batch` rows of up to `capacity` tokens. kv_dtype: the
        pages of its own KV cache, if it has one (None: its model's dtype; int8: quantized
        with per-token scales, `specjax.kv_quant`), as `generate(kv_cache_dtype=)` asks."""
        return ()

    def prefill(self, state: Any, chunk: PrefillChunk, target_params: Any) -> Any:
        return state

    def propose(self, state: Any, ctx: ProposeContext,
                target_params: Any) -> tuple[DraftTree, Any]:
        raise NotImplementedError

    def commit(self, state: Any, ctx: CommitContext, target_params: Any) -> Any:
        return state

    def can_skip(self, state: Any) -> jax.Array:
        """[] bool: whether the loop may run a plain step with no `propose` call, then
        `commit` its one pair after `skip(state)` (speculators with a pending queue:
        while the queue has room)."""
        return jnp.bool_(True)

    def skip(self, state: Any) -> Any:
        """The state after a step that made no draft call (see `can_skip`)."""
        return state


# Queue slots beyond a step's kept pairs, for speculators with their own cache: while no
# row drafts they skip their call and the kept pairs pile up, to be consumed in one call
# (a forward of Q + 1 rows costs about what 2 do on CPU) when a row drafts again or the
# queue is full (`requeue(append=True)`).
QUEUE_SLACK = 8


def requeue(ctx: CommitContext, cache, queue: tuple, count: jax.Array,
            kept: tuple, append: jax.Array | bool = False) -> tuple[Any, tuple, jax.Array]:
    """The pending queue of a speculator with its own cache (draft model, EAGLE head).

    After a commit, a row's kept pairs (root and accepted nodes, `kept` arrays [B, J, ...])
    become its queue ([B, Q, ...], zero-padded), and its cache rolls back to the old
    root's position: what the draft wrote for tree nodes is dropped, and the next
    `propose` feeds queue + new root in one call. Rows without pairs keep everything.

    append ([] bool): the last propose made no draft call, so nothing was consumed: the
    kept pairs go after the queue and the cache stays where it is.
    Returns (cache, queue, count).
    """
    act = ctx.num_pairs > 0
    b, q = count.shape[0], queue[0].shape[1]
    j = jnp.arange(kept[0].shape[1])[None, :]
    slot = jnp.where(j < ctx.num_pairs[:, None], count[:, None] + j, q)  # past Q: dropped
    rows = jnp.arange(b)[:, None]

    def put(old, new):
        new = new.astype(old.dtype)
        pad = [(0, 0), (0, old.shape[1] - new.shape[1])] + [(0, 0)] * (new.ndim - 2)
        sel = act.reshape((-1,) + (1,) * (old.ndim - 1))
        replaced = jnp.where(sel, jnp.pad(new, pad), old)
        appended = old.at[rows, slot].set(new, mode="drop")
        return jnp.where(append, appended, replaced)

    rolled = jnp.where(act, ctx.positions[:, 0], cache.lengths)
    lengths = jnp.where(append, cache.lengths, rolled)
    new_count = jnp.where(act, ctx.num_pairs + jnp.where(append, count, 0), count)
    return (cache.replace(lengths=lengths), tuple(put(o, n) for o, n in zip(queue, kept)),
            new_count)


def queue_has_room(state) -> jax.Array:
    """[] bool: every row's pending queue can take one more pair (`requeue`)."""
    return jnp.all(state.pending_count + 1 < state.pending.shape[1])


class QueuedSpeculator(Speculator):
    """A speculator with its own cache and a pending queue of pairs (`requeue`; state
    fields `pending` [B, Q, ...], `pending_count` [B], `skipped` []): it may skip its
    draft call while every queue has room, and the next commit then appends."""

    def can_skip(self, state) -> jax.Array:
        return queue_has_room(state)

    def skip(self, state):
        return state.replace(skipped=jnp.bool_(True))


def propose_or_skip(state, ctx: ProposeContext, empty: DraftTree,
                    run: Callable[[], tuple[DraftTree, Any]]) -> tuple[DraftTree, Any]:
    """The propose of a speculator with its own cache and pending queue (`requeue`):
    when no row drafts this step and every queue has room for one more pair, no call
    at all (`empty` tree; the state's `skipped` flag makes the next commit append),
    else `run()`. `state` needs `pending` [B, Q, ...], `pending_count` [B], `skipped`."""
    levels = jnp.max(jnp.where(ctx.active, ctx.depth_limit, 0))
    room = queue_has_room(state)

    def go():
        tree, new = run()
        return tree, new.replace(skipped=jnp.bool_(False))

    return jax.lax.cond((levels == 0) & room,
                        lambda: (empty, state.replace(skipped=jnp.bool_(True))), go)


def set_fields(obj: Speculator, **fields) -> None:
    """Sets the fields of a frozen speculator from a custom `__init__`. Such an `__init__`
    must also accept every field by name: jax rebuilds pytrees by calling it that way."""
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
