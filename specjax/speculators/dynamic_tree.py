"""Tree builders shared by the drafts that expand a tree node by node (EAGLE, DraftModel).

A draft that can score the children of any node plugs into these through one function

  expand(carry, nodes: Nodes) -> (logp [B, Q, V'], carry)

which runs the draft over ALL tree nodes built so far (`Nodes`: tokens, parents indexing
these nodes with -1 = the root, depth 1 = the root's children, depth-major order; a
fixed capacity of which the first `count` are real), under their ancestor mask
`nodes.mask`, and returns the log-probabilities of the children of the nodes
`nodes.query`. Feeding every
node again at each depth (rather than only the frontier) is what lets tree attention go
through the ordinary cache contract, whose mask covers only the new tokens of a call: the
draft's cache is rolled back to the committed prefix before each call, the nodes are
rewritten in place, and the ancestor mask keeps branches apart. The extra work is the
re-run of shallower nodes (about (depth + 1) / 2 times the frontier-only cost).

* `dynamic_tree` is EAGLE-2's builder: top_k children of the root; then, depth by depth,
  the top_k children of each frontier node scored by cumulative (joint) log-probability,
  of which the best top_k form the next frontier; finally the `total_tokens` best of all
  generated nodes (a child never scores above its parent, and ties go to the earlier,
  shallower node, so the selection is ancestor-closed), in topological order.
* `static_tree_expand` follows a fixed tree of Medusa-style paths (EAGLE-1): a node with
  path (..., c) is the c-th most likely child of its parent under the draft.

Nodes are deterministic picks, so trees carry no `draft_probs` (point masses), which
recursive rejection sampling verifies losslessly. Scores are the draft's raw
log-softmax (temperature 1), independent of the sampling settings. All shapes are static
(top_k, depth, total_tokens) and the depth loop is a `lax.scan`, so compile time does
not grow with depth.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.tree import DraftTree, ancestor_mask


@struct.dataclass
class Nodes:
    """Tree nodes built so far (fixed capacity T; the first `count` are real), which a
    draft runs over to score the children of the nodes `query`."""

    tokens: jax.Array  # [B, T] int32 target ids (0 past count)
    parents: jax.Array  # [B, T] int32 index among these nodes, -1 = the root
    depth: jax.Array  # [B, T] int32, 1 = the root's children
    count: jax.Array  # [] int32 real nodes
    query: jax.Array  # [Q] int32 nodes whose children to score
    levels: int = struct.field(pytree_node=False)  # bound on the depth of any node

    @property
    def mask(self) -> jax.Array:
        """[B, T, T] bool: node i sees itself and its ancestors (not the root)."""
        return ancestor_mask(self.parents, self.levels)[:, 1:, 1:]


Expand = Callable[[Any, Nodes], tuple[jax.Array, Any]]


def _map(idx: jax.Array, vocab_map: jax.Array | None) -> jax.Array:
    return idx.astype(jnp.int32) if vocab_map is None else jnp.take(vocab_map, idx)


def _put(buf: jax.Array, new: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=1)


def dynamic_depth_widths(top_k: int, depth: int, total_tokens: int) -> tuple[int, ...]:
    """`TreeShape.depth_widths` of `dynamic_tree`'s trees: W[d] = min(N, k + (d-1)·k²).

    Its nodes are candidates in candidate order, which is depth-major (the k children
    of the root, then k² per further depth), so the nodes of depth <= d come first and
    number at most the candidates of depth <= d. A probe (depth 1) then verifies k
    nodes, not all N."""
    return (0,) + tuple(min(total_tokens, top_k + (d - 1) * top_k * top_k)
                        for d in range(1, depth + 1))


def _candidate_count(top_k: int, depth: int, total_tokens: int) -> int:
    """The number of candidates a dynamic tree scores, after refusing a shape it cannot
    fill (checked at trace time, before any op)."""
    n_cand = top_k + (depth - 1) * top_k * top_k
    if not 1 <= total_tokens <= n_cand or depth < 1 or top_k < 1 or depth > total_tokens:
        raise ValueError(f"dynamic tree needs top_k >= 1 and 1 <= depth <= total_tokens <= "
                         f"top_k + (depth - 1) * top_k**2 = {n_cand}; got {top_k=}, {depth=}, "
                         f"{total_tokens=}")
    return n_cand


def _select_tree(cand: dict, cand_depth: np.ndarray, total_tokens: int,
                 depth: int) -> DraftTree:
    """The `total_tokens` best-scoring candidates as a tree: parents re-indexed into the
    selection, and nodes whose parent was not selected (or never expanded) marked invalid."""
    _, best = jax.lax.top_k(cand["score"], total_tokens)  # ties: lower (shallower) index first
    sel = jnp.sort(best, axis=1).astype(jnp.int32)  # candidate order is topological
    take = lambda x: jnp.take_along_axis(x, sel, axis=1)
    par_cand = take(cand["parent"])
    match = sel[:, None, :] == par_cand[:, :, None]  # [B, N, N] node j is i's parent
    parents = jnp.where(par_cand >= 0, jnp.argmax(match, axis=2), -1).astype(jnp.int32)
    # a child never outscores its parent, so the selection is ancestor-closed; the check
    # also drops unexpanded candidates (levels < depth)
    valid = take(cand["filled"]) & ((par_cand < 0) | jnp.any(match, axis=2))
    node_depth = jnp.take(jnp.asarray(cand_depth), sel)
    return DraftTree(take(cand["tok"]), parents, node_depth, valid, None,
                     max_depth=depth)


def dynamic_tree(first_logp: jax.Array, expand: Expand, carry: Any, *, top_k: int, depth: int,
                 total_tokens: int, vocab_map: jax.Array | None = None,
                 levels: jax.Array | None = None) -> tuple[DraftTree, Any]:
    """EAGLE-2 dynamic tree from the root's child log-probs first_logp [B, V'].

    vocab_map [V'] maps draft indices to target ids (EAGLE-3's d2t); None = identity.
    levels: [] int32, expand only depths <= levels (the loop's deepest kept depth); the
      node budget then goes to the shallower depths. None = all `depth` levels.
    Returns a tree of `total_tokens` nodes and max_depth `depth`.
    """
    b = first_logp.shape[0]
    k = top_k
    n_cand = _candidate_count(top_k, depth, total_tokens)
    h = (depth - 1) * k  # nodes the draft runs over: the frontiers of depths 1..depth-1
    levels = jnp.int32(depth) if levels is None else levels
    score, idx = jax.lax.top_k(first_logp, k)  # [B, k]
    tok = _map(idx, vocab_map)
    i32 = lambda n, fill: jnp.full((b, n), fill, jnp.int32)
    # candidates: k children of the root, then k*k per further depth
    cand_depth = np.concatenate([np.ones(k, np.int32)] +
                                [np.full(k * k, d, np.int32) for d in range(2, depth + 1)])
    cand = dict(tok=_put(i32(n_cand, 0), tok, 0),
                score=_put(jnp.full((b, n_cand), -jnp.inf, jnp.float32), score, 0),
                parent=i32(n_cand, -1), filled=jnp.asarray(cand_depth == 1)[None].repeat(b, 0))
    # the frontiers (one spare block so the last write stays in bounds)
    hist = dict(tok=_put(i32(h + k, 0), tok, 0), par=i32(h + k, -1),
                dep=jnp.asarray(np.repeat(np.arange(1, depth + 1, dtype=np.int32), k))[None]
                .repeat(b, 0))
    beam = (score, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)))

    def level(state, j):  # expands depth d = j + 2 from the frontier of depth j + 1
        carry, cand, hist, (score, beam_cand) = state
        nodes = Nodes(hist["tok"][:, :h], hist["par"][:, :h], hist["dep"][:, :h],
                      (j + 1) * k, j * k + jnp.arange(k, dtype=jnp.int32), depth - 1)
        logp, carry = expand(carry, nodes)  # [B, k, V']
        cs, ci = jax.lax.top_k(logp, k)  # [B, k, k]
        cum = (score[:, :, None] + cs).reshape(b, k * k)
        kids = _map(ci, vocab_map).reshape(b, k * k)
        off = k + j * k * k
        cand = dict(tok=_put(cand["tok"], kids, off), score=_put(cand["score"], cum, off),
                    parent=_put(cand["parent"], jnp.repeat(beam_cand, k, axis=1), off),
                    filled=_put(cand["filled"], jnp.ones((b, k * k), bool), off))
        score, pick = jax.lax.top_k(cum, k)  # the next frontier
        pick = pick.astype(jnp.int32)
        at = (j + 1) * k
        hist = dict(tok=_put(hist["tok"], jnp.take_along_axis(kids, pick, axis=1), at),
                    par=_put(hist["par"], j * k + pick // k, at), dep=hist["dep"])
        return carry, cand, hist, (score, off + pick)

    def maybe_level(state, j):
        return jax.lax.cond(j + 2 <= levels, level, lambda s, j: s, state, j), None

    if depth > 1:
        (carry, cand, _, _), _ = jax.lax.scan(maybe_level, (carry, cand, hist, beam),
                                              jnp.arange(depth - 1, dtype=jnp.int32))
    return _select_tree(cand, cand_depth, total_tokens, depth), carry


def static_tree_expand(first_logp: jax.Array, expand: Expand, carry: Any,
                       parents: np.ndarray, depth: np.ndarray, choice: Sequence[int],
                       vocab_map: jax.Array | None = None,
                       levels: jax.Array | None = None) -> tuple[DraftTree, Any]:
    """A fixed tree (`specjax.tree.static_tree` output) filled in depth by depth, up to
    depth `levels` (deeper nodes are left 0 and marked invalid)."""
    b = first_logp.shape[0]
    n = len(depth)
    dm = int(depth.max())
    choice = np.asarray(choice)
    kmax = int(choice.max()) + 1
    levels = jnp.int32(dm) if levels is None else levels
    bc = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b, len(x)))
    _, idx = jax.lax.top_k(first_logp, kmax)  # [B, kmax]
    first = np.flatnonzero(depth == 1)
    tokens = jnp.zeros((b, n), jnp.int32).at[:, first].set(_map(idx[:, choice[first]], vocab_map))
    if dm > 1:
        t = int(np.sum(depth < dm))  # the nodes that have children run through the draft
        w = max(int(np.sum(depth == d)) for d in range(1, dm + 1))
        # per expanded depth d = 2..dm: the nodes of depth d-1 (query), and the children
        query, kids, owner, pick, count = [], [], [], [], []
        for d in range(2, dm + 1):
            q = np.flatnonzero(depth == d - 1)
            c = np.flatnonzero(depth == d)
            pad = lambda x, fill: np.concatenate([x, np.full(w - len(x), fill)]).astype(np.int32)
            query.append(pad(q, 0))
            kids.append(pad(c, n))  # n: dropped
            owner.append(pad(np.searchsorted(q, parents[c]), 0))
            pick.append(pad(choice[c], 0))
            count.append(int(np.sum(depth < d)))
        xs = tuple(jnp.asarray(np.stack(x)) for x in (query, kids, owner, pick, count))
        xs += (jnp.arange(2, dm + 1, dtype=jnp.int32),)

        def level(state, x):
            carry, tokens = state
            query, kids, owner, pick, count, _ = x
            nodes = Nodes(tokens[:, :t], bc(parents[:t]), bc(depth[:t]), count, query, dm - 1)
            logp, carry = expand(carry, nodes)  # [B, W, V']
            _, idx = jax.lax.top_k(logp, kmax)  # [B, W, kmax]
            new = _map(idx[:, owner, pick], vocab_map)  # [B, W]
            return carry, tokens.at[:, kids].set(new, mode="drop")

        def maybe_level(state, x):
            return jax.lax.cond(x[-1] <= levels, level, lambda s, x: s, state, x), None

        (carry, tokens), _ = jax.lax.scan(maybe_level, (carry, tokens), xs)
    return DraftTree(tokens, bc(parents), bc(depth), bc(depth) <= levels, None,
                     max_depth=dm), carry
