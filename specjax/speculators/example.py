"""`Bigram`: the worked example of docs/speculators.md, a speculator in one screen.

Each row keeps a table of the token seen to follow each token (learned from the pairs
`prefill` and `commit` hand over) and drafts a chain by walking that table from the
root. No model and no cost; lossless whatever it drafts, since the target verifies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig
from specjax.speculators.base import (
    CommitContext,
    PrefillChunk,
    ProposeContext,
    Speculator,
    TreeShape,
)
from specjax.tree import DraftTree, chain


@struct.dataclass
class BigramState:
    follower: jax.Array  # [B, V] int32: a token seen after each token; -1 = none yet


@struct.dataclass
class Bigram(Speculator):
    k: int = struct.field(pytree_node=False, default=4)  # drafts per step

    def __post_init__(self):  # only static fields: safe to check on every rebuild
        if self.k < 1:
            raise ValueError(f"Bigram k={self.k} must be >= 1")

    @property
    def shape(self) -> TreeShape:
        return TreeShape.chain(self.k)  # every tree: a chain of k nodes

    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> BigramState:
        return BigramState(jnp.full((batch, target_config.vocab_size), -1, jnp.int32))

    def prefill(self, state: BigramState, chunk: PrefillChunk, target_params) -> BigramState:
        return _learn(state, chunk.tokens, chunk.next_tokens, chunk.num_pairs)

    def commit(self, state: BigramState, ctx: CommitContext, target_params) -> BigramState:
        return _learn(state, ctx.tokens, ctx.next_tokens, ctx.num_pairs)

    def propose(self, state: BigramState, ctx: ProposeContext,
                target_params) -> tuple[DraftTree, BigramState]:
        rows = jnp.arange(ctx.lengths.shape[0])
        tok = ctx.tokens[rows, ctx.lengths - 1]  # the root: its children come first
        known = jnp.ones_like(tok, bool)
        drafts, valid = [], []
        for _ in range(self.k):  # static k: unrolled into the compiled step
            tok = state.follower[rows, jnp.maximum(tok, 0)]
            known = known & (tok >= 0)  # a chain stops at its first unknown token
            drafts.append(jnp.maximum(tok, 0))
            valid.append(known)
        return chain(jnp.stack(drafts, 1), valid=jnp.stack(valid, 1)), state


def _learn(state: BigramState, tokens, next_tokens, num_pairs) -> BigramState:
    """Records follower[token] = next token for the first num_pairs entries of each row."""
    b, c = tokens.shape
    vocab = state.follower.shape[1]
    is_pair = jnp.arange(c)[None, :] < num_pairs[:, None]
    col = jnp.where(is_pair, tokens, vocab)  # past the table: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))
    return BigramState(state.follower.at[rows, col].set(next_tokens, mode="drop"))
