"""`Medusa`: a static tree of top-k picks from Medusa heads on the target's last hidden.

State: the target's final-normed hidden state of the last kept input (`commit` hands it
over: `ctx.hidden.final` at index num_pairs - 1); that input's own next token is the
root. Node at depth d of the tree is drafted by head d - 1 applied to that hidden (head 0
predicts the root's child): a node with path (c_1, ..., c_d) holds the c_d-th most likely
token of head d - 1. One head call per step, no KV cache.

Drafts are deterministic picks (point masses, no `draft_probs`): greedy verification and
recursive rejection sampling are lossless. `verification="typical"` selects Medusa's
typical acceptance, which is LOSSY (faster at high temperature, not the target's
distribution).

Default tree (`DEFAULT_TREE`, 26 nodes, depth 4): the first 25 paths of Medusa's
`mc_sim_7b_63` (paths listed by estimated acceptance, so any prefix of the list is
ancestor-closed; the first 25 reach depth 3 and top-9 at the root) plus the all-top-1
path to depth 4, so a 4-head Medusa uses every head.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.config import ModelConfig
from specjax.heads import io as heads_io
from specjax.heads.loading import resolve_heads
from specjax.heads.medusa import MedusaConfig, init_medusa_params, medusa_logits
from specjax.model import Model
from specjax.speculators.base import CommitContext, DraftCost, ProposeContext, Speculator, TreeShape
from specjax.tree import DraftTree, static_tree
from specjax.verify import METHODS

DEFAULT_TREE = ((0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3),
                (4,), (0, 4), (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7),
                (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 0, 0, 0))


@struct.dataclass
class MedusaState:
    hidden: jax.Array  # [B, D] target hidden of the last kept input (whose next is the root)


def _paths(tree) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(c) for c in p) for p in tree)


@struct.dataclass
class Medusa(Speculator):
    params: Any
    config: MedusaConfig = struct.field(pytree_node=False)
    target_config: ModelConfig = struct.field(pytree_node=False)
    tree: tuple = struct.field(pytree_node=False, default=DEFAULT_TREE)
    verification: str = struct.field(pytree_node=False, default="rejection")

    @classmethod
    def create(cls, params, config: MedusaConfig, target: Model | ModelConfig, *,
               tree: Sequence = DEFAULT_TREE, verification: str = "rejection") -> "Medusa":
        """Heads from a params pytree and its `config`, checked against `target` (the
        target Model or its ModelConfig).

        tree: Medusa-style paths, each the top-k choice index per depth.
        verification: "rejection" (lossless) or "typical" (lossy) for sampled decoding.
        """
        params, config, tcfg, _ = resolve_heads("medusa", params, config, target)
        if verification not in METHODS:
            raise ValueError(f"verification={verification!r} must be one of {METHODS}")
        spec = cls(params, config, tcfg, _paths(tree), verification)
        if verification == "block" and not spec.shape.proposes_chains:
            raise ValueError("verification='block' verifies chains; this Medusa tree has "
                             "siblings")
        if spec.shape.max_depth > config.num_heads:
            raise ValueError(f"tree depth {spec.shape.max_depth} exceeds the "
                             f"{config.num_heads} Medusa heads (head d - 1 drafts depth d)")
        spec.check_target(tcfg)
        return spec

    @classmethod
    def load(cls, path, target: Model | ModelConfig, **kwargs) -> "Medusa":
        """Heads from a directory written by `save` (`specjax.heads.save_heads`; its config
        is read from there); kwargs as `create`."""
        return cls.create(os.fspath(path), None, target, **kwargs)

    @classmethod
    def random(cls, target: Model, num_heads: int = 4, seed: int = 0, *,
               num_residual_layers: int = 1, init_scale: float = 0.02, **kwargs) -> "Medusa":
        """Untrained heads: LM heads copied from the target, ResBlocks normal(init_scale)."""
        config = MedusaConfig(num_heads, num_residual_layers)
        params = init_medusa_params(config, target.config, target.params, seed, init_scale)
        return cls.create(params, config, target, **kwargs)

    def save(self, path):
        """Writes the heads (and the target's fingerprint) to directory `path`."""
        return heads_io.save_heads(path, "medusa", self.config, self.params, self.target_config)

    @property
    def shape(self) -> TreeShape:
        return TreeShape.of_paths(self.tree)

    @property
    def cost(self) -> DraftCost:
        """All heads run once per step, whatever the depth: one call."""
        return DraftCost(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params)), 1)

    def check_target(self, target_config: ModelConfig) -> None:
        heads_io.check_fingerprint(heads_io.target_fingerprint(self.target_config),
                                   target_config, "these Medusa heads")
        widest = max(p[-1] for p in self.tree) + 1
        if widest > target_config.vocab_size:
            raise ValueError(f"tree asks for the top-{widest} tokens of a head but the "
                             f"vocabulary has {target_config.vocab_size}")

    # -- protocol ----------------------------------------------------------------------
    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> MedusaState:
        del kv_dtype  # the heads keep no KV cache
        return MedusaState(jnp.zeros((batch, target_config.hidden_size),
                                     jnp.dtype(target_config.dtype)))

    def propose(self, state: MedusaState, ctx: ProposeContext,
                target_params) -> tuple[DraftTree, MedusaState]:
        b = state.hidden.shape[0]
        parents, depth, choice = static_tree(self.tree)
        n = len(self.tree)

        def heads():
            logits = medusa_logits(self.config, self.target_config, self.params,
                                   state.hidden[:, None])[:, 0]  # [B, M, V]
            _, top = jax.lax.top_k(logits, int(max(choice)) + 1)  # [B, M, K]
            return top[:, depth - 1, np.asarray(choice)].astype(jnp.int32)  # [B, N]

        # The heads are stateless: when no row drafts this step, skip their cost.
        tokens = jax.lax.cond(ctx.levels > 0, heads, lambda: jnp.zeros((b, n), jnp.int32))
        bc = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b, n))
        return DraftTree(tokens.astype(jnp.int32), bc(parents), bc(depth),
                         bc(depth) <= ctx.levels, None, max_depth=int(depth.max())), state

    def commit(self, state: MedusaState, ctx: CommitContext, target_params) -> MedusaState:
        last = jnp.maximum(ctx.num_pairs - 1, 0)
        h = jnp.take_along_axis(ctx.hidden.final, last[:, None, None], axis=1)[:, 0]
        act = ctx.num_pairs > 0
        return MedusaState(jnp.where(act[:, None], h.astype(state.hidden.dtype), state.hidden))

