"""`Hybrid`: prompt lookup where a row's own tokens hold a match, a model's draft elsewhere.

Lookup (`NGram`) drafts for free and is right far more often where it matches (code that
quotes its prompt, repeated lines), but finds a match at only some steps; a model (an
EAGLE head, a draft model, Medusa heads) drafts at every step and is right less often.
Each step, each row takes the lookup's chain where it matches and the model's tree
elsewhere, as ArcticInference pairs suffix decoding with its speculator. The chain sits
in the first nodes of the model's tree shape, so one compiled verify serves both, and a
step whose rows all match verifies only the bucket wide enough for the chain
(`decoding.speculate.node_levels`). The model is told not to draft rows that match
(their depth limit is 0), so a step where every row matches makes no model call beyond
what its queue needs, and every step's commit hands the model the target's pairs, as
after its own drafts. The lookup's nodes are point masses (beside a sampling draft
model's chains, they carry one-hot distributions), so verification stays lossless.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig
from specjax.speculators.base import (
    CommitContext,
    DraftCost,
    PrefillChunk,
    ProposeContext,
    Speculator,
    TreeShape,
)
from specjax.speculators.ngram import NGram
from specjax.tree import DraftTree


@struct.dataclass
class Hybrid(Speculator):
    lookup: NGram
    model: Speculator

    @classmethod
    def create(cls, lookup: NGram, model: Speculator) -> "Hybrid":
        """`lookup`'s chain where it matches, `model`'s draft elsewhere; the chain must fit
        the model's tree depth (lookup.k <= its max_depth)."""
        if not isinstance(lookup, NGram):
            raise TypeError(f"Hybrid's lookup must be an NGram; got {type(lookup).__name__}")
        if not isinstance(model, Speculator) or isinstance(model, (NGram, Hybrid)):
            raise TypeError("Hybrid's model must be a model speculator (DraftModel, Eagle, "
                            f"Medusa); got {type(model).__name__}")
        depth = model.shape.max_depth
        if lookup.k > depth:
            raise ValueError(f"Hybrid: the lookup's k={lookup.k} exceeds the model's tree "
                             f"depth {depth}; give the NGram k <= {depth}")
        return cls(lookup, model)

    @classmethod
    def of(cls, model: Speculator, k: int = 4) -> "Hybrid":
        """`model` with n-gram chains of k where lookup matches, k capped at the model's
        tree depth (what the suite's and the CLI's `ngram_eagle` run)."""
        return cls.create(NGram(k=min(k, model.shape.max_depth)), model)

    @property
    def shape(self) -> TreeShape:
        # a chain's node at depth d is node d - 1, and every depth has a node, so any
        # tree's W[d] >= d holds it
        return self.model.shape

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.model.hidden_layers

    @property
    def verification(self) -> str:
        return self.model.verification

    @property
    def cost(self) -> DraftCost:
        return self.model.cost

    def for_decoding(self, layout: str = "auto") -> "Hybrid":
        return self.replace(model=self.model.for_decoding(layout))

    def check_target(self, target_config: ModelConfig) -> None:
        self.model.check_target(target_config)

    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> Any:
        return self.model.init(target_config, batch, capacity, kv_dtype=kv_dtype)

    def prefill(self, state: Any, chunk: PrefillChunk, target_params: Any) -> Any:
        return self.model.prefill(state, chunk, target_params)

    def propose(self, state: Any, ctx: ProposeContext,
                target_params: Any) -> tuple[DraftTree, Any]:
        """The lookup's chain in rows where it drafts, the model's tree in the others."""
        found, _ = self.lookup.propose((), ctx, target_params)  # chain [B, k]
        matched = found.valid[:, 0]  # [B]
        tree, state = self.model.propose(
            state, ctx.replace(depth_limit=jnp.where(matched, 0, ctx.depth_limit)),
            target_params)
        return embed_chain(found, tree, matched), state

    def commit(self, state: Any, ctx: CommitContext, target_params: Any) -> Any:
        return self.model.commit(state, ctx, target_params)

    def can_skip(self, state: Any) -> jax.Array:
        return self.model.can_skip(state)

    def skip(self, state: Any) -> Any:
        return self.model.skip(state)


def embed_chain(chain_tree: DraftTree, tree: DraftTree, rows: jax.Array) -> DraftTree:
    """`tree` [B, N] with rows [B] replaced by `chain_tree` [B, k] (k <= N) in its first k
    nodes, the rest invalid; where `tree` carries draft distributions, the chain's are
    one-hot (a point mass is a draw from its own distribution)."""
    b, n = tree.tokens.shape
    k = chain_tree.num_nodes
    pad = lambda x, v: jnp.pad(x, ((0, 0), (0, n - k)), constant_values=v)  # noqa: E731
    sel = rows[:, None]
    probs = tree.draft_probs
    if probs is not None:
        onehot = jax.nn.one_hot(pad(chain_tree.tokens, 0), probs.shape[-1], dtype=probs.dtype)
        probs = jnp.where(sel[:, :, None], onehot, probs)
    return tree.replace(
        tokens=jnp.where(sel, pad(chain_tree.tokens, 0), tree.tokens),
        parents=jnp.where(sel, pad(chain_tree.parents, -1), tree.parents),
        depth=jnp.where(sel, pad(chain_tree.depth, 1), tree.depth),
        valid=jnp.where(sel, pad(chain_tree.valid, False), tree.valid),
        draft_probs=probs)
