"""`DraftTree`: what every speculator proposes and the one verifier consumes.

A chain is a tree whose parents are -1, 0, 1, and so on. Node n of row b
holds a draft token, the index of its parent node (-1 = the root, i.e. the last
committed token that the target has not yet seen), its depth (root children have
depth 1) and, optionally, the distribution it was drawn from. Nodes are topologically
ordered (a parent comes before its children). Verification feeds the target
[root, node 0, ..., node N-1] in one forward with the mask `ancestor_mask`, at
positions `root_position + [0, depth...]`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N] int32 draft token of each node
    parents: jax.Array  # [B, N] int32 parent node, -1 = root
    depth: jax.Array  # [B, N] int32, 1 for children of the root
    valid: jax.Array  # [B, N] bool, False for padding / nodes cut by adaptive length
    # [B, N, V] float32: the (processed) draft distribution node n was sampled from,
    # i.i.d. among siblings. None: every node is a deterministic pick (a point mass),
    # as for n-gram, top-k expansion or greedy drafts.
    draft_probs: jax.Array | None = None
    max_depth: int = struct.field(pytree_node=False, default=1)
    # The builder's declaration that every node is an independent draw from its
    # draft_probs row (siblings i.i.d.): required with draft_probs, refused without
    # (`check_tree`). Top-k or otherwise deterministic children must not carry a q:
    # verified against it they make the output lossy.
    sampled: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def row_depths(self) -> jax.Array:
        """[B] int32: each row's deepest valid node (0: it drafts nothing)."""
        return jnp.max(jnp.where(self.valid, self.depth, 0), axis=1)


def check_tree(tree: DraftTree) -> None:
    """Static checks, run at trace time: shapes and a non-empty tree."""
    if tree.tokens.ndim != 2 or tree.tokens.shape[1] < 1:
        raise ValueError(f"a draft tree needs at least one node; got tokens of shape "
                         f"{tree.tokens.shape}")
    for name in ("parents", "depth", "valid"):
        if getattr(tree, name).shape != tree.tokens.shape:
            raise ValueError(f"DraftTree.{name} has shape {getattr(tree, name).shape}, "
                             f"expected {tree.tokens.shape}")
    if tree.max_depth < 1 or tree.max_depth > tree.num_nodes:
        raise ValueError(f"max_depth={tree.max_depth} must be in [1, {tree.num_nodes}]")
    check_draft_probs(tree.draft_probs, tree.sampled)
    if tree.draft_probs is not None and tree.draft_probs.shape[:2] != tree.tokens.shape:
        raise ValueError(f"draft_probs shape {tree.draft_probs.shape} does not match "
                         f"tokens {tree.tokens.shape}")


def check_draft_probs(draft_probs, sampled: bool) -> None:
    """The draft-distribution contract: draft_probs iff the nodes were sampled from it."""
    if draft_probs is not None and not sampled:
        raise ValueError("a DraftTree with draft_probs must declare sampled=True (every node "
                         "an independent draw from its draft_probs row); deterministic "
                         "(top-k, greedy) nodes are point masses and carry no draft_probs")
    if draft_probs is None and sampled:
        raise ValueError("a DraftTree with sampled=True needs the draft_probs its nodes were "
                         "drawn from")


def chain(tokens: jax.Array, draft_probs: jax.Array | None = None,
          valid: jax.Array | None = None, *, sampled: bool = False) -> DraftTree:
    """A chain of k drafts per row: tokens [B, k] -> DraftTree with parents -1, 0, 1, ...
    sampled: drafts drawn from draft_probs [B, k, V] (see `DraftTree.sampled`)."""
    b, k = tokens.shape
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    check_draft_probs(draft_probs, sampled)
    parents = jnp.broadcast_to(jnp.arange(-1, k - 1, dtype=jnp.int32), (b, k))
    depth = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (b, k))
    if valid is None:
        valid = jnp.ones((b, k), bool)
    return DraftTree(tokens.astype(jnp.int32), parents, depth, valid, draft_probs, max_depth=k,
                     sampled=sampled)


def empty_tree(batch: int, num_nodes: int, max_depth: int, vocab: int | None = None) -> DraftTree:
    """A tree with no valid node, shaped like a speculator's proposals (`vocab`: with
    zero draft_probs [B, N, V], sampled): what a speculator returns on a step it does not
    draft."""
    full = lambda v: jnp.full((batch, num_nodes), v, jnp.int32)  # noqa: E731
    probs = None if vocab is None else jnp.zeros((batch, num_nodes, vocab), jnp.float32)
    return DraftTree(full(0), full(-1), full(1), jnp.zeros((batch, num_nodes), bool), probs,
                     max_depth=max_depth, sampled=vocab is not None)


def static_tree(paths: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, list]:
    """A static tree from Medusa-style paths (each path: top-k choice index per depth).

    Returns (parents [N], depth [N], choice [N]) in topological (sorted by depth) order;
    every prefix of a path must be a path too.
    """
    if not paths:
        raise ValueError("a draft tree needs at least one path; got an empty list")
    paths = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents, depth, choice = [], [], []
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"tree path {list(p)} must be non-empty with entries >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
        depth.append(len(p))
        choice.append(p[-1])
    return np.asarray(parents, np.int32), np.asarray(depth, np.int32), choice


def is_chain(parents) -> bool:
    """Whether a static layout's parents [N] are a chain: -1, 0, 1, ..."""
    parents = np.asarray(parents)
    return bool(np.array_equal(parents, np.arange(parents.shape[-1]) - 1))


def depth_widths(depth: Sequence[int]) -> tuple[int, ...]:
    """W[d] for d = 0..max depth: every node of depth <= d is among the first W[d] nodes.

    For a static tree layout `depth` [N]; a depth-sorted tree (as `static_tree` makes)
    gives the node counts per depth, so verifying only that prefix is exact.
    """
    depth = np.asarray(depth)
    out = []
    for d in range(int(depth.max()) + 1):
        idx = np.flatnonzero(depth <= d)
        out.append(int(idx.max()) + 1 if idx.size else 0)
    return tuple(out)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, N+1, N+1] bool over verify inputs [root, nodes]: i sees j iff j is i or its ancestor."""
    b, n = parents.shape
    t = n + 1
    par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents + 1], axis=1)  # [B, T]
    par = jnp.where(jnp.arange(t)[None] == 0, -1, par)
    step = (par[:, :, None] == jnp.arange(t)[None, None, :])  # [B, T, T] i's parent is j
    reach = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    anc = reach
    for _ in range(max_depth):
        reach = jnp.einsum("BIJ,BJK->BIK", reach.astype(jnp.int32),
                           step.astype(jnp.int32)) > 0
        anc = anc | reach
    return anc
