"""`DraftModel`: a second, smaller specjax model drafting a chain of k tokens.

The draft keeps its own paged KV cache in the speculator state. It consumes the loop's
pairs lazily: `commit` rolls its cache back to before the old root and queues the kept
inputs; the next `propose` feeds the queue plus the new root in one forward (the first
draft call), then k - 1 single-token calls. At temperature > 0 drafts are sampled from
the draft's processed distribution and handed to the verifier with it (Leviathan
rejection sampling); at temperature 0 they are the draft's argmax.

Tree mode (`tree_top_k > 0`): instead of a chain, an EAGLE-2-style dynamic tree of
`total_tokens` nodes and depth k (`dynamic_tree`): the tree_top_k most likely children of
each frontier node, the best tree_top_k frontier nodes kept per depth, the best nodes
overall by cumulative draft log-probability. Nodes are deterministic picks (point masses,
no draft_probs), lossless under greedy and rejection-sampling verification alike. Still
k draft calls per step (the queue call, then one per further depth).

Trimmed vocabulary (`vocab=`): the draft's LM head keeps only the rows of `vocab`
(target ids, e.g. the corpus's most frequent, as EAGLE-3 picks its draft vocabulary),
so a draft call reads those rows instead of the whole head; on a small draft with a
large vocabulary the head is most of a call's bytes. A chain samples over the kept ids
only (the softmax and the sampling noise cover Vd entries, not V) and hands the verifier
that distribution spread over the whole vocabulary, zero elsewhere; a tree ranks the
kept logits with -inf elsewhere. Either way it proposes only ids in `vocab` and its
distribution is zero elsewhere: verification is unchanged and stays lossless.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import rng, rows_matmul, sampling as sampling_lib
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.model import Model, decode_params, module_for, step, transposes_denses
from specjax.models.transformer import Transformer, is_decode_layout
from specjax.sharding.rules import cache_for_rows
from specjax.speculators import queue as queue_lib
from specjax.speculators.base import (
    CommitContext,
    DraftCost,
    PrefillChunk,
    ProposeContext,
    Speculator,
    TreeShape,
)
from specjax.speculators.dynamic_tree import Nodes, dynamic_depth_widths, dynamic_tree
from specjax.speculators.queue import PairQueue, propose_lazily
from specjax.tree import DraftTree, chain, empty_tree


@struct.dataclass
class DraftState:
    cache: PagedKVCache
    queue: PairQueue  # items: ([B, Q] kept target inputs the draft has not consumed yet,)


@struct.dataclass
class DraftModel(Speculator):
    params: Any
    config: ModelConfig = struct.field(pytree_node=False)
    k: int = struct.field(pytree_node=False, default=4)
    page_size: int = struct.field(pytree_node=False, default=16)
    tree_top_k: int = struct.field(pytree_node=False, default=0)
    total_tokens: int = struct.field(pytree_node=False, default=0)
    vocab_ids: jax.Array | None = None  # [Vd] int32 sorted target ids a trimmed head keeps
    vocab_head: jax.Array | None = None  # [D, Vd] the trimmed LM head (rows of vocab_ids)
    # vocab_head stored [Vd, D] for the transposed-weight kernel (`for_decoding`)
    vocab_head_t: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, model: Model, k: int = 4, *, target: Model | None = None,
               page_size: int = 16, tree_top_k: int = 0,
               total_tokens: int | None = None, vocab=None) -> "DraftModel":
        """`DraftModel.create(draft, k=4)`; pass `target=` to check vocabularies up front.

        Tree mode: `tree_top_k=2` (branching), `total_tokens` nodes (default
        k * tree_top_k), depth k; `tree_top_k=0` is the chain of k drafts.
        vocab: distinct target ids [Vd] the draft may propose (its LM head trimmed to
        them, see the module docstring); None keeps the whole vocabulary.
        """
        if not isinstance(getattr(model, "config", None), ModelConfig):
            raise ValueError(f"DraftModel needs model=<specjax Model>; got {type(model).__name__}")
        if k < 1:
            raise ValueError(f"DraftModel k={k} must be >= 1")
        if tree_top_k < 0:
            raise ValueError(f"DraftModel tree_top_k={tree_top_k} must be >= 0 (0 = chain)")
        if tree_top_k:
            total_tokens = k * tree_top_k if total_tokens is None else total_tokens
            n_cand = tree_top_k + (k - 1) * tree_top_k ** 2
            if not k <= total_tokens <= n_cand or tree_top_k > model.config.vocab_size:
                raise ValueError(
                    f"DraftModel tree mode needs k <= total_tokens <= tree_top_k + (k - 1) * "
                    f"tree_top_k**2 = {n_cand} and tree_top_k <= vocab_size; got {k=}, "
                    f"{tree_top_k=}, {total_tokens=}")
        if target is not None:
            _check_tokenizers(model, target)
        head = None
        if vocab is not None:
            vocab = check_vocab(vocab, model.config.vocab_size, max(1, tree_top_k))
            head = trimmed_head(model.config, model.params, vocab)
        spec = cls(model.params, model.config, k, page_size, tree_top_k, total_tokens or 0,
                   vocab, head)
        spec.shape  # validates the tree's shape once
        if target is not None:
            spec.check_target(target.config)
        return spec

    @property
    def shape(self) -> TreeShape:
        if self.tree_top_k:  # the dynamic tree's depth-major candidates
            widths = dynamic_depth_widths(self.tree_top_k, self.k, self.total_tokens)
            return TreeShape(self.total_tokens, self.k, widths)
        return TreeShape.chain(self.k)

    @property
    def cost(self) -> DraftCost:
        params = self.config.param_count()
        if self.vocab_ids is not None:  # the head's rows not kept are never read
            params -= (self.config.vocab_size - self.vocab_ids.shape[0]) * self.config.hidden_size
        return DraftCost(params, self.k)

    def for_decoding(self, layout: str = "auto") -> "DraftModel":
        """The draft in the target's decode layout (`specjax.model.decode_params`), its
        trimmed head [Vd, D] where the target's layout would store it so
        (`transposes_denses` and the transposed-weight kernel winning its shape)."""
        out = self.replace(params=decode_params(self.config, self.params, layout))
        head = self.vocab_head
        if (head is None or self.vocab_head_t
                or not transposes_denses(self.config, self.params, layout)
                or not rows_matmul.transposed_wins(head.shape, head.dtype)):
            return out
        return out.replace(vocab_head=jax.jit(jnp.transpose)(head), vocab_head_t=True)

    def check_target(self, target_config: ModelConfig) -> None:
        if self.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"draft vocab_size={self.config.vocab_size} differs from the target's "
                f"vocab_size={target_config.vocab_size}; a draft must share the target's "
                "vocabulary")

    can_skip, skip = queue_lib.can_skip, queue_lib.skip

    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> DraftState:
        extra = (self.k - 1) * self.tree_top_k  # tree nodes written past the root
        m = -(-(capacity + extra) // self.page_size)
        cache = cache_for_rows(self.config, batch, m, self.page_size, dtype=kv_dtype)
        return DraftState(cache, PairQueue.zeros(batch, self.k, ((), jnp.int32)))

    def prefill(self, state: DraftState, chunk: PrefillChunk, target_params) -> DraftState:
        _, _, cache = step(self.config, self.params, state.cache, chunk.tokens, chunk.positions,
                           q_lens=chunk.num_pairs, return_logits=False)
        return state.replace(cache=cache)

    def propose(self, state: DraftState, ctx: ProposeContext,
                target_params) -> tuple[DraftTree, DraftState]:
        """Drafts; while no row drafts, no draft call at all (`propose_lazily`)."""
        return propose_lazily(state, ctx, self._empty(ctx.lengths.shape[0]),
                              lambda: self._propose(state, ctx))

    def _empty(self, batch: int) -> DraftTree:
        vocab = None if self.tree_top_k else self.config.vocab_size  # chains carry probs
        return empty_tree(batch, self.shape.num_nodes, self.shape.max_depth, vocab)

    def _propose(self, state: DraftState, ctx: ProposeContext) -> tuple[DraftTree, DraftState]:
        (pending,), c = state.queue.items, state.queue.count
        b, q = pending.shape
        rows = jnp.arange(b)
        root = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)[:, 0]
        inp = jnp.concatenate([pending, jnp.zeros((b, 1), jnp.int32)], axis=1)
        inp = inp.at[rows, c].set(root)  # [B, Q+1]: queue then root
        start = ctx.lengths - 1 - c
        pos = start[:, None] + jnp.arange(q + 1)[None, :]
        act = ctx.active.astype(jnp.int32)
        # Logits at the root only: the queue's other positions need none, and the LM head
        # over all Q + 1 positions was the costliest matmul of a non-drafting step.
        _, hidden, cache = step(self.config, self.params, state.cache, inp, pos,
                                q_lens=(c + 1) * act, return_logits=False)

        def draft():
            first = self._logits(hidden.final[rows, c])  # [B, Vd] draft logits after the root
            if self.tree_top_k:
                return self._tree(state, ctx, cache, self._full(first, -jnp.inf), act)
            return self._chain(state, ctx, cache, first, act)

        # No row drafts, but the queue was full: the call above consumed it, and the root's
        # logits (the draft's LM head, most of its cost) and sampling are not needed.
        skip = lambda: (self._empty(b), state.replace(cache=cache))  # noqa: E731
        return jax.lax.cond(ctx.levels > 0, draft, skip)

    def _chain(self, state: DraftState, ctx: ProposeContext, cache: PagedKVCache,
               first: jax.Array, act: jax.Array) -> tuple[DraftTree, DraftState]:
        """Chain mode: k sampled draft tokens, one draft call each after the first; `first`
        [B, Vd] the root's logits over the kept ids. Each token is drawn over the kept ids
        and its distribution spread over the whole vocabulary for the verifier."""
        b = first.shape[0]

        def draw(key, logits):  # [B, Vd] -> [B] target ids, [B, V] their distribution
            tok = sampling_lib.sample_rows(key, logits, ctx.sampling)
            prob = sampling_lib.probs(logits, ctx.sampling)
            if self.vocab_ids is None:
                return tok, prob
            return self.vocab_ids[tok], self._full(prob, 0.0)

        tok, prob = draw(rng.fold(ctx.key, 0), first)
        drafts = jnp.zeros((b, self.k), jnp.int32).at[:, 0].set(tok)
        dprobs = jnp.zeros((b, self.k, prob.shape[-1]), jnp.float32).at[:, 0].set(prob)
        # Further draft calls only up to the deepest depth the loop will keep this step.

        def one(i, carry):
            cache, drafts, dprobs = carry
            row_act = act * (i < ctx.depth_limit)
            _, hidden, cache = step(self.config, self.params, cache, drafts[:, i - 1, None],
                                    (ctx.lengths + i - 1)[:, None], q_lens=row_act,
                                    return_logits=False)
            nxt, prob = draw(rng.fold(ctx.key, i), self._logits(hidden.final[:, 0]))
            return cache, drafts.at[:, i].set(nxt), dprobs.at[:, i].set(prob)

        cache, drafts, dprobs = jax.lax.fori_loop(1, ctx.levels, one, (cache, drafts, dprobs))
        drafted = jnp.broadcast_to(jnp.arange(self.k) < ctx.levels, (b, self.k))  # not past
        return (chain(drafts, draft_probs=dprobs, valid=drafted, sampled=True),
                state.replace(cache=cache))

    def _tree(self, state: DraftState, ctx: ProposeContext, cache: PagedKVCache,
              first: jax.Array, act: jax.Array) -> tuple[DraftTree, DraftState]:
        """Tree mode: the dynamic tree over the draft's cache (root already written)."""
        base = cache.lengths

        def expand(cache, nodes: Nodes):
            pos = (ctx.lengths - 1)[:, None] + nodes.depth  # the root is at lengths - 1
            _, hidden, cache = step(self.config, self.params, cache.replace(lengths=base),
                                    nodes.tokens, pos, mask=nodes.mask,
                                    q_lens=nodes.count * act, return_logits=False)
            logits = self._logits(jnp.take(hidden.final, nodes.query, axis=1))
            return jax.nn.log_softmax(self._full(logits, -jnp.inf), axis=-1), cache

        tree, cache = dynamic_tree(jax.nn.log_softmax(first, axis=-1), expand, cache,
                                   top_k=self.tree_top_k, depth=self.k,
                                   total_tokens=self.total_tokens, levels=ctx.levels)
        return tree, state.replace(cache=cache.replace(lengths=base))

    def _logits(self, h: jax.Array) -> jax.Array:
        """Final-normed draft hidden [..., D] -> float32 logits [..., Vd] over the kept ids
        (all V of them when the head is not trimmed)."""
        if self.vocab_head is None:
            module = module_for(self.config, self.params)
            return module.apply({"params": self.params}, h, method=Transformer.logits)
        head = self.vocab_head.astype(h.dtype)
        if self.vocab_head_t:  # [Vd, D], few rows by the transposed-weight kernel
            with jax.named_scope("lm_head"):
                return rows_matmul.matmul_t(h, head, preferred_element_type=jnp.float32)
        if is_decode_layout(self.params):  # few rows by the kernel
            with jax.named_scope("lm_head"):
                return rows_matmul.matmul(h, head, preferred_element_type=jnp.float32)
        return jnp.einsum("...D,DV->...V", h, head, preferred_element_type=jnp.float32)

    def _full(self, x: jax.Array, fill: float) -> jax.Array:
        """[..., Vd] over the kept ids -> [..., V] over target ids, `fill` elsewhere."""
        if self.vocab_ids is None:
            return x
        full = jnp.full(x.shape[:-1] + (self.config.vocab_size,), fill, x.dtype)
        return full.at[..., self.vocab_ids].set(x)

    def commit(self, state: DraftState, ctx: CommitContext, target_params) -> DraftState:
        cache, queue = state.queue.push(ctx, state.cache, (ctx.tokens,))
        return DraftState(cache, queue)


def check_vocab(vocab, vocab_size: int, at_least: int = 1,
                what: str = "DraftModel vocab") -> jax.Array:
    """`vocab` as sorted [Vd] int32 after checking it: 1-D, distinct ids in
    [0, vocab_size), at least `at_least` of them (a tree's branching). Sorted, so the
    draft's argmax breaks ties toward the lower id, as over the whole vocabulary.
    `what` names the argument in the errors."""
    ids = np.asarray(vocab)
    if ids.ndim != 1 or ids.shape[0] < at_least or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D array of at least {at_least} integer "
                         f"target ids; got shape {ids.shape}, dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{what} holds ids outside [0, {vocab_size}): {bad[:5].tolist()}")
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what} repeats ids: {uniq[counts > 1][:5].tolist()}")
    return jnp.asarray(uniq, jnp.int32)


VOCAB_FILE = "vocab.npy"  # a trimmed draft vocabulary on disk: [Vd] int32 target ids


def save_vocab(path, vocab) -> None:
    """Writes the target ids a trimmed draft keeps (`DraftModel.create(vocab=)`) as .npy."""
    np.save(path, np.asarray(vocab, np.int32), allow_pickle=False)


def load_vocab(path) -> np.ndarray:
    """The ids `save_vocab` wrote; a clear error for a missing or malformed file."""
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a draft vocabulary (.npy of target ids): {e}") from e
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{path}: a draft vocabulary is a 1-D array of integer ids; got "
                         f"shape {ids.shape}, dtype {ids.dtype}")
    return ids


def trimmed_head(config: ModelConfig, params: Any, vocab: jax.Array) -> jax.Array:
    """The LM head's columns [D, Vd] for target ids `vocab` (the embedding's rows when
    tied), from params in the stored layout."""
    if config.tie_word_embeddings:
        return jnp.take(params["embed_tokens"]["embedding"], vocab, axis=0).T
    return jnp.take(params["lm_head"]["kernel"], vocab, axis=1)


def _check_tokenizers(draft: Model, target: Model) -> None:
    if draft.tokenizer is None or target.tokenizer is None:
        return
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError("draft and target tokenizers differ; a draft must share the target's "
                         "vocabulary (same tokenizer.json)")
