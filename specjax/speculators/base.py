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
state (a `PairQueue`, `specjax.speculators.queue`); n-gram reads the token buffer of
the context.

Besides the four functions a speculator declares the static `shape` of its trees
(`TreeShape`) and what drafting `cost`s (`DraftCost`). docs/speculators.md walks through
writing one (`specjax.speculators.example`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig
from specjax.models.transformer import Hidden
from specjax.sampling import Sampling
from specjax.tree import DraftTree, depth_widths, is_chain, static_tree


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """The static shape of every tree a speculator proposes: part of the compiled program.

    depth_widths: W[d], d = 0..max_depth: every node of depth <= d is among the first W[d]
    nodes. When no kept node is deeper than d, the loop verifies only those W[d] nodes (a
    cheaper target forward; W[0] = 0 is a plain decode step).
    proposes_chains: every tree is a chain (parents -1, 0, 1, ...), what block
    verification needs.
    """
    num_nodes: int
    max_depth: int
    depth_widths: tuple[int, ...]
    proposes_chains: bool = False

    def __post_init__(self):
        w = tuple(int(x) for x in self.depth_widths)
        object.__setattr__(self, "depth_widths", w)
        if (self.num_nodes < 1 or self.max_depth < 1 or len(w) != self.max_depth + 1
                or w[0] != 0 or w[-1] != self.num_nodes or list(w) != sorted(w)):
            raise ValueError(f"TreeShape depth_widths={w} must rise from 0 to num_nodes="
                             f"{self.num_nodes} over depths 0..max_depth={self.max_depth} "
                             "(both >= 1)")

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        """A chain of k drafts: depth d is node d - 1."""
        return cls(k, k, tuple(range(k + 1)), proposes_chains=True)

    @classmethod
    def of_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeShape":
        """A static tree of Medusa-style paths (`specjax.tree.static_tree`)."""
        parents, depth, _ = static_tree(paths)
        return cls(len(paths), int(depth.max()), depth_widths(depth), is_chain(parents))


@dataclasses.dataclass(frozen=True)
class DraftCost:
    """What drafting costs, for the analytical speedup and adaptive length.

    params_per_call: parameters one draft call runs through (0 for free drafts like
    n-gram); `ratio` turns it into a cost relative to one one-token target forward
    (`specjax.calibrate.measured_cost_ratio` measures it instead).
    calls_per_step: draft calls of a full-depth step; drafting k positions makes
    min(k, this) (a chain draft: one per position; Medusa: one).
    """
    params_per_call: int = 0
    calls_per_step: int = 0

    def ratio(self, target_config: ModelConfig) -> float:
        """One draft call's estimated cost in one-token target forwards."""
        return self.params_per_call / target_config.param_count()


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
    # [B] int32: the loop keeps nodes with depth <= depth_limit (adaptive length), and
    # any other valid node the verify bucket of that depth holds
    # (`decoding.speculate.node_levels`); a speculator may skip draft work beyond
    # `levels` (their max) to save its cost, and marks the nodes it skips invalid.
    depth_limit: jax.Array

    @property
    def levels(self) -> jax.Array:
        """[] int32: the deepest depth the loop keeps this step over all active rows (0: no
        row drafts); the one name for it, so a speculator stops drafting there."""
        return deepest_kept(self.active, self.depth_limit)


def deepest_kept(active: jax.Array, depth_limit: jax.Array) -> jax.Array:
    """[] int32: the largest depth_limit [B] over the active [B] rows (0: none drafts)."""
    return jnp.max(jnp.where(active, depth_limit, 0))


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
    functions. Static fields (`pytree_node=False`) are part of the compiled program.
    Construction goes through classmethods, so that `__init__` stays jax's unflatten."""

    #: target decoder layers whose outputs `prefill`/`commit` need (EAGLE-3: low/mid/high)
    hidden_layers: tuple[int, ...] = ()
    #: verification method for sampled decoding: "rejection" (lossless), "block" (chains,
    #: lossless) or "typical" (lossy); `generate(verification=)` overrides it
    verification: str = "rejection"
    #: what one step of drafting costs (free unless a subclass says otherwise)
    cost: DraftCost = DraftCost()
    #: whether `has_draft` tells, at next to no cost (a prompt lookup, not a model call),
    #: which rows would get a draft now: the loop then runs plain steps until a row that
    #: may draft has one, and the rule prices drafting for the steps that have a draft
    #: (`policy.decide_from`), so the rate of finding one no longer weighs against it
    peeks: bool = False

    @property
    def shape(self) -> TreeShape:
        """The static shape of every proposed tree."""
        raise NotImplementedError

    def for_decoding(self, layout: str = "auto") -> "Speculator":
        """This speculator with its weights in the layer layout `generate` decodes with
        (`specjax.model.decode_params`); `generate` calls it off-mesh."""
        return self

    def check_target(self, target_config: ModelConfig) -> None:
        """Raises a clear error if this speculator cannot serve `target_config`."""

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
        `commit` its one pair after `skip(state)` (speculators with a `PairQueue`: while
        the queue has room)."""
        return jnp.bool_(True)

    def skip(self, state: Any) -> Any:
        """The state after a step that made no draft call (see `can_skip`)."""
        return state

    def has_draft(self, state: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        """[B] bool: the rows for which `propose` would find a draft now, from their
        tokens [B, S] and lengths [B]; only speculators that set `peeks`."""
        raise NotImplementedError(f"{type(self).__name__} does not peek (`peeks`)")
