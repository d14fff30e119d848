"""`Eagle`: an EAGLE head drafting a tree from the target's features (EAGLE-1/2/3).

State (like `DraftModel`): the head's own one-layer paged KV cache, slot i holding pair
i = (feature of input i, token i+1) at position i, plus a queue of pairs the head has
not consumed. `commit` rolls the head cache back to the old root and queues the kept
pairs with the TARGET's features (re-feeding them replaces the head's own guesses);
`propose` feeds the queue in one call — its last pair is (h_{r-1}, root), whose output
drafts the root's children — then expands the tree depth by depth, each node fed with
the head's own output at its parent (see `dynamic_tree` for how tree attention runs in
the head cache).

* EAGLE-2 (default, `tree=None`): dynamic tree, `top_k` children per frontier node,
  `top_k` frontier nodes kept per depth, the best `total_tokens` nodes by cumulative
  draft log-probability, `depth` levels (EAGLE-2's defaults: 10, 60, 6).
* EAGLE-1: `tree=paths`, a static tree of Medusa-style paths (node (..., c) is the c-th
  most likely child of its parent under the head).
* EAGLE-3: `version=3` heads; the loop hands the target's low/mid/high decoder-layer
  outputs over (`hidden_layers`), children are ranked over the reduced draft vocabulary
  and mapped to target ids through `d2t`.

Nodes are deterministic top-k picks (point masses), so greedy and rejection-sampling
verification are lossless whatever the head's quality.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.heads import io as heads_io
from specjax.heads.eagle import (
    EagleConfig,
    eagle_logits,
    eagle_step,
    fuse_features,
    init_eagle_params,
    layer_config,
    layer_params,
    target_features,
)
from specjax.heads.loading import resolve_heads
from specjax.model import Model, decode_head_params
from specjax.models.transformer import is_decode_layout
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
from specjax.speculators.dynamic_tree import (
    Nodes,
    dynamic_depth_widths,
    dynamic_tree,
    static_tree_expand,
)
from specjax.speculators.queue import PairQueue, propose_lazily
from specjax.tree import DraftTree, empty_tree, static_tree


@struct.dataclass
class EagleState:
    cache: PagedKVCache  # the head's own, one layer
    # items: tokens x_{i+1} [B, Q] and fused target features h_i [B, Q, D] of queued pairs
    queue: PairQueue


@struct.dataclass
class Eagle(Speculator):
    params: Any
    d2t: jax.Array | None  # [Vd] int32 draft index -> target id (EAGLE-3), else None
    config: EagleConfig = struct.field(pytree_node=False)
    target_config: ModelConfig = struct.field(pytree_node=False)
    tree: tuple | None = struct.field(pytree_node=False, default=None)
    top_k: int = struct.field(pytree_node=False, default=10)
    depth: int = struct.field(pytree_node=False, default=6)
    total_tokens: int = struct.field(pytree_node=False, default=60)
    page_size: int = struct.field(pytree_node=False, default=16)

    @classmethod
    def create(cls, params, config: EagleConfig, target: Model | ModelConfig, *,
               vocab_map=None, tree: Sequence | None = None, top_k: int = 10,
               depth: int = 6, total_tokens: int = 60, page_size: int = 16) -> "Eagle":
        """A head from a params pytree and its `config` (`EagleConfig(version=1|3)`),
        checked against `target` (the target Model or its ModelConfig).

        tree: static paths (EAGLE-1); None = EAGLE-2's dynamic tree of `total_tokens`
          nodes, `depth` levels, `top_k` branching.
        vocab_map: EAGLE-3's d2t [Vd] (default: the first Vd target ids, or the map
          saved with the heads).
        """
        params, config, tcfg, saved_map = resolve_heads("eagle", params, config,
                                                                 target)
        vocab_map = saved_map if vocab_map is None else vocab_map
        config.check(tcfg)
        config = config.resolved(tcfg)
        if config.version == 3:
            if vocab_map is None:
                vocab_map = np.arange(config.draft_vocab_size, dtype=np.int32)
            vocab_map = jnp.asarray(vocab_map, jnp.int32)
        elif vocab_map is not None:
            raise ValueError("vocab_map (d2t) is an EAGLE-3 setting; these are version-1 heads")
        tree = None if tree is None else tuple(tuple(int(c) for c in p) for p in tree)
        check_tree(tree, top_k, depth, total_tokens)
        spec = cls(params, vocab_map, config, tcfg, tree, top_k, depth, total_tokens, page_size)
        spec.shape  # validates the tree's shape once
        spec.check_target(tcfg)
        return spec

    @classmethod
    def load(cls, path, target: Model | ModelConfig, **kwargs) -> "Eagle":
        """A head from a directory written by `save` (`specjax.heads.save_heads`) or a
        published EAGLE checkpoint (`specjax.export`); kwargs as `create`."""
        return cls.create(os.fspath(path), None, target, **kwargs)

    @classmethod
    def random(cls, target: Model, version: int = 1, seed: int = 0, *,
               hidden_layers: tuple[int, ...] = (), draft_vocab_size: int | None = None,
               vocab_map=None, **kwargs) -> "Eagle":
        """Untrained (random) heads for `target`; losslessness does not depend on them."""
        if version == 3:
            config = EagleConfig(3, tuple(hidden_layers), draft_vocab_size)
        else:
            config = EagleConfig(version)
        config.check(target.config)
        config = config.resolved(target.config)
        tree = kwargs.get("tree")
        check_tree(tree, kwargs.get("top_k", 10), kwargs.get("depth", 6),
                   kwargs.get("total_tokens", 60), config.draft_vocab_size or
                   target.config.vocab_size)  # before the (slower) init
        params = init_eagle_params(config, target.config, seed)
        return cls.create(params, config, target, vocab_map=vocab_map, **kwargs)

    def save(self, path):
        """Writes the head (its d2t for EAGLE-3, the target's fingerprint) to `path`."""
        vm = None if self.d2t is None else np.asarray(self.d2t)
        return heads_io.save_heads(path, "eagle", self.config, self.params, self.target_config,
                                   vocab_map=vm)

    def for_decoding(self, layout: str = "auto") -> "Eagle":
        """The head's layer laid out as the target's decode layout lays out its own
        (`specjax.model.decode_head_params`: q/k/v fused, [O, I] weights where the
        transposed-weight kernel wins beside a float32 target in a CPU decode layout)."""
        return self.replace(params=decode_head_params(self.target_config, self.params,
                                                      layout))

    # -- shape of the tree and costs -----------------------------------------------------
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers the loop must hand over: EAGLE-3's three, each once, sorted."""
        return tuple(sorted(set(self.config.hidden_layers)))

    @property
    def _layer_index(self) -> tuple[int, ...]:
        return tuple(self.hidden_layers.index(i) for i in self.config.hidden_layers)

    @property
    def _static(self):
        return static_tree(self.tree)

    @property
    def shape(self) -> TreeShape:
        if self.tree is None:  # EAGLE-2's dynamic tree: depth-major candidates
            widths = dynamic_depth_widths(self.top_k, self.depth, self.total_tokens)
            return TreeShape(self.total_tokens, self.depth, widths, self.top_k == 1)
        return TreeShape.of_paths(self.tree)

    @property
    def _extra_slots(self) -> int:
        """Head cache slots the expansion writes past the committed pairs."""
        if self.tree is None:
            return (self.depth - 1) * self.top_k
        _, depth, _ = self._static
        return int(np.sum(depth < depth.max()))

    def check_target(self, target_config: ModelConfig) -> None:
        heads_io.check_fingerprint(heads_io.target_fingerprint(self.target_config),
                                   target_config, "this EAGLE head")
        self.config.check(target_config)
        vocab = target_config.vocab_size if self.config.version == 1 else len(self.d2t)
        check_tree(self.tree, self.top_k, self.depth, self.total_tokens, vocab)
        if self.d2t is not None and self.d2t.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"d2t has shape {self.d2t.shape}; expected "
                             f"({self.config.draft_vocab_size},)")

    @property
    def cost(self) -> DraftCost:
        """The queue call, then one per further depth."""
        # a head's own embedding is a lookup, not compute: not counted
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(layer_params(self.params)))
        if self.config.version == 1:  # the target's lm_head runs on every head output
            size += self.target_config.vocab_size * self.target_config.hidden_size
        return DraftCost(size, self.shape.max_depth)

    can_skip, skip = queue_lib.can_skip, queue_lib.skip

    # -- protocol ----------------------------------------------------------------------
    def init(self, target_config: ModelConfig, batch: int, capacity: int, *,
             kv_dtype=None) -> EagleState:
        m = -(-(capacity + self._extra_slots) // self.page_size)
        cache = cache_for_rows(layer_config(target_config), batch, m, self.page_size,
                                      dtype=kv_dtype)
        d, dt = target_config.hidden_size, jnp.dtype(target_config.dtype)
        return EagleState(cache, PairQueue.zeros(batch, self.shape.max_depth, ((), jnp.int32),
                                                 ((d,), dt)))

    def _features(self, hidden, target_params):
        feats = target_features(self.config, hidden, self._layer_index)
        if self.config.version == 1:
            return feats
        return fuse_features(self.config, self.target_config, self.params, feats,
                             rows_kernel=is_decode_layout(target_params))

    def _step(self, target_params, cache, tokens, feats, positions, **kw):
        return eagle_step(self.config, self.target_config, self.params, target_params, cache,
                          tokens, feats, positions, **kw)

    def _logp(self, target_params, out):
        logits = eagle_logits(self.config, self.target_config, self.params, target_params, out)
        return jax.nn.log_softmax(logits, axis=-1)

    def prefill(self, state: EagleState, chunk: PrefillChunk, target_params) -> EagleState:
        feats = self._features(chunk.hidden, target_params)
        _, cache = self._step(target_params, state.cache, chunk.next_tokens, feats,
                              chunk.positions, q_lens=chunk.num_pairs)
        return state.replace(cache=cache)

    def propose(self, state: EagleState, ctx: ProposeContext,
                target_params) -> tuple[DraftTree, EagleState]:
        """Drafts; while no row drafts, no head call at all (`propose_lazily`)."""
        empty = self._empty(ctx.lengths.shape[0])
        return propose_lazily(state, ctx, empty, lambda: self._propose(state, ctx, target_params))

    def _empty(self, batch: int) -> DraftTree:
        return empty_tree(batch, self.shape.num_nodes, self.shape.max_depth)

    def _propose(self, state: EagleState, ctx: ProposeContext,
                 target_params) -> tuple[DraftTree, EagleState]:
        (pending, pending_feats), c = state.queue.items, state.queue.count
        b, q = pending.shape
        rows = jnp.arange(b)
        act = ctx.active.astype(jnp.int32)
        root_pos = ctx.lengths - 1  # the last queued pair is (h_{r-1}, root) at r - 1
        pos = (root_pos - c)[:, None] + jnp.arange(q)[None, :]
        out, cache = self._step(target_params, state.cache, pending, pending_feats,
                                pos, q_lens=c * act)
        root_out = out[rows, jnp.maximum(c - 1, 0)]  # [B, D]: drafts the root's children
        base = cache.lengths

        def expand(carry, nodes: Nodes):
            cache, prev = carry  # prev [B, 1 + T, D]: root output, then the last call's
            feats = jnp.take_along_axis(prev, (nodes.parents + 1)[:, :, None], axis=1)
            o, cache = self._step(target_params, cache.replace(lengths=base), nodes.tokens,
                                  feats, root_pos[:, None] + nodes.depth - 1,
                                  mask=nodes.mask, q_lens=nodes.count * act)
            logp = self._logp(target_params, jnp.take(o, nodes.query, axis=1))
            return logp, (cache, jnp.concatenate([root_out[:, None], o], axis=1))

        prev = jnp.zeros((b, 1 + self._extra_slots, root_out.shape[-1]), root_out.dtype)
        carry = (cache, prev.at[:, 0].set(root_out))
        levels = ctx.levels

        def grow():
            first = self._logp(target_params, root_out)  # [B, V']
            if self.tree is None:
                tree, (grown, _) = dynamic_tree(first, expand, carry, top_k=self.top_k,
                                                depth=self.depth,
                                                total_tokens=self.total_tokens,
                                                vocab_map=self.d2t, levels=levels)
            else:
                parents, depth, choice = self._static
                tree, (grown, _) = static_tree_expand(first, expand, carry, parents, depth,
                                                      choice, vocab_map=self.d2t, levels=levels)
            return tree, grown

        def skip():  # no row drafts, but the queue was full: the call above consumed it
            return self._empty(b), cache

        tree, cache = jax.lax.cond(levels > 0, grow, skip)
        return tree, state.replace(cache=cache.replace(lengths=base))

    def commit(self, state: EagleState, ctx: CommitContext, target_params) -> EagleState:
        feats = self._features(ctx.hidden, target_params)
        cache, queue = state.queue.push(ctx, state.cache, (ctx.next_tokens, feats))
        return EagleState(cache, queue)


def tree_label(eagle: "Eagle") -> str:
    """An EAGLE speculator's dynamic tree as "top_k,depth,nodes" (`bench suite
    --eagle-tree`'s form)."""
    return f"{eagle.top_k},{eagle.shape.max_depth},{eagle.total_tokens}"


def check_tree(tree, top_k: int, depth: int, total_tokens: int, vocab: int | None = None):
    """Static checks of the tree settings (and that the branching fits the vocabulary)."""
    if tree is None:
        n_cand = top_k + (depth - 1) * top_k * top_k
        if not (top_k >= 1 and 1 <= depth <= total_tokens <= n_cand):
            raise ValueError(f"Eagle dynamic tree needs top_k >= 1 and 1 <= depth <= "
                             f"total_tokens <= top_k + (depth-1)*top_k**2 = {n_cand}; "
                             f"got {top_k=}, {depth=}, {total_tokens=}")
        widest = top_k
    else:
        static_tree(tree)  # validates the paths
        widest = max(p[-1] for p in tree) + 1
    if vocab is not None and widest > vocab:
        raise ValueError(f"the tree asks for the top-{widest} children of a node but the "
                         f"draft vocabulary has {vocab} tokens")
