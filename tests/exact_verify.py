"""Exact output distributions of speculative verification, by float64 enumeration.

Tiny tabulated "models" give the target's and the draft's next-token logits after every
path of tokens (a path is what follows a fixed prompt). For one speculative step from a
path this module enumerates every draft draw and every accept/reject outcome and returns
the exact distribution of the emitted tokens (accepted drafts, then the bonus); chaining
steps gives the exact distribution of the first n tokens of speculative decoding, to
compare with the target's own. Algorithms: token-wise recursive rejection over trees
(chains, i.i.d. sampled siblings, deterministic top-k siblings), block verification of
chains, and the realistic wrong variants a test must be able to tell apart.

A tree shape is a tuple of child shapes: () is a leaf, ((),) a root with one child,
`chain_shape(3)` a chain of three drafts.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np


def chain_shape(depth: int) -> tuple:
    shape: tuple = ()
    for _ in range(depth):
        shape = (shape,)
    return shape


def warp(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0):
    """float64 `specjax.sampling.probs`: temperature, then top-k (ties kept), then top-p
    (the smallest sorted prefix whose mass reaches top_p), then min-p (probabilities at
    least min_p times the largest)."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        desc = np.sort(x)[::-1]
        p_desc = np.exp(desc - desc.max())
        p_desc /= p_desc.sum()
        before = np.cumsum(p_desc) - p_desc
        cutoff = desc[before < top_p].min()
        x = np.where(x < cutoff, -np.inf, x)
    p = np.exp(x - x.max())
    p = np.where(p < min_p, 0.0, p)  # p / p_max, the largest 1
    return p / p.sum()


class Table:
    """Next-token logits [V] after every path, drawn once per path from a seeded normal."""

    def __init__(self, seed: int, vocab: int, scale: float = 1.5):
        self.seed, self.vocab, self.scale = seed, vocab, scale

    @functools.lru_cache(maxsize=None)
    def logits(self, path: tuple) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(path), *path])
        return rng.normal(size=self.vocab) * self.scale

    @functools.lru_cache(maxsize=None)
    def dense(self, length: int) -> np.ndarray:
        """[V] * length + [V]: the logits after every path of `length` tokens."""
        v = self.vocab
        out = np.empty((v,) * length + (v,))
        for path in itertools.product(range(v), repeat=length):
            out[path] = self.logits(path)
        return out


@dataclass(frozen=True)
class Spec:
    """One speculative setting: the models, the warp, the tree and how it is drafted/verified.

    draw: "sampled" (children i.i.d. from the draft's warped distribution) or "topk" (the
      i-th child is the draft's i-th most likely token: a point mass).
    method: "rejection" (token-wise) or "block" (chains only).
    Wrong variants (`bug`): "shared_uniform" (one uniform for all siblings),
      "no_residual" (a rejected child leaves the target distribution as it was),
      "q_for_topk" (deterministic children verified as if drawn from the draft's q),
      "raw_q" (drafts drawn from the warped q, verified against the unwarped one).
    """

    target: Table
    draft: Table
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    shape: tuple = chain_shape(3)
    draw: str = "sampled"
    method: str = "rejection"
    bug: str | None = None

    @property
    def warp_args(self) -> tuple:
        """(temperature, top_k, top_p, min_p), as `warp` and `Sampling.create` take them."""
        return self.temperature, self.top_k, self.top_p, self.min_p

    def p(self, path):
        return warp(self.target.logits(path), *self.warp_args)

    def q(self, path):
        return warp(self.draft.logits(path), *self.warp_args)

    def q_verified(self, path, x):
        """The draft distribution the verifier is handed for a child x after `path`."""
        if self.draw == "topk":
            return self.q(path) if self.bug == "q_for_topk" else np.eye(self.target.vocab)[x]
        if self.bug == "raw_q":
            return warp(self.draft.logits(path), 1.0)
        return self.q(path)

    def children(self, path, k):
        """[(children tokens, probability)] of the draws of k children after `path`."""
        if self.draw == "topk":
            return [(tuple(np.argsort(-self.draft.logits(path), kind="stable")[:k]), 1.0)]
        q = self.q(path)
        support = np.flatnonzero(q > 0)
        return [(xs, float(np.prod(q[list(xs)])))
                for xs in itertools.product(support, repeat=k)]


def _add(out: dict, key, w: float):
    if w > 0:
        out[key] = out.get(key, 0.0) + w


def _ratio(r: float, q: float) -> float:
    """Acceptance probability min(1, r / q) (a child of draft mass 0: accepted iff r > 0)."""
    return min(1.0, r / q) if q > 0 else float(r > 0)


@functools.lru_cache(maxsize=None)
def step_dist(spec: Spec, path: tuple = (), shape: tuple | None = None) -> dict:
    """{emitted tokens (accepted..., bonus): probability} of one step from `path`."""
    shape = spec.shape if shape is None else shape
    if spec.method == "block":
        return _block_step(spec, path)
    p = spec.p(path)
    out: dict = {}
    if not shape:
        for y in np.flatnonzero(p > 0):
            _add(out, (int(y),), p[y])
        return out
    for xs, w in spec.children(path, len(shape)):
        r = p.copy()
        accept, first = [], []  # per child: its acceptance probability and P(first accepted)
        for x in xs:
            q = spec.q_verified(path, x)
            accept.append(_ratio(r[x], q[x]))
            if spec.bug != "no_residual":
                rest = np.maximum(r - q, 0.0)
                r = rest / rest.sum() if rest.sum() > 0 else r
        for i, a in enumerate(accept):
            if spec.bug == "shared_uniform":  # u < a_i and u >= a_j for j < i
                first.append(max(0.0, a - max(accept[:i], default=0.0)))
            else:
                first.append(a * np.prod([1 - b for b in accept[:i]]))
        for x, f, sub in zip(xs, first, shape):
            for tail, w2 in step_dist(spec, path + (int(x),), sub).items():
                _add(out, (int(x),) + tail, w * f * w2)
        for y in np.flatnonzero(r > 0):
            _add(out, (int(y),), w * (1.0 - sum(first)) * r[y])
    return out


def block_weights(p_rows, q_rows, xs):
    """Block verification of a chain (Sun et al. 2025): p_rows [γ+1, V] target, q_rows [γ, V]
    draft distributions, drafts xs [γ]. Returns (h [γ] stop probabilities, residuals
    [γ+1, V] unnormalised: what the bonus is drawn from after τ accepted drafts)."""
    g = len(xs)
    weight = [1.0]  # p_i: the running acceptance weight of the first i drafts
    for i, x in enumerate(xs):
        weight.append(min(1.0, weight[-1] * _div(p_rows[i][x], q_rows[i][x])))
    h, residuals = [], []
    for i in range(g + 1):
        res = p_rows[i] if i == g else np.maximum(weight[i] * p_rows[i] - q_rows[i], 0.0)
        residuals.append(res)
        if i == 0:
            continue
        if i == g:
            h.append(weight[g])
        else:
            mass = res.sum()
            den = mass + 1.0 - weight[i]
            h.append(mass / den if den > 0 else 0.0)
    return np.asarray(h), residuals


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else (np.inf if a > 0 else 0.0)


def _block_step(spec: Spec, path: tuple) -> dict:
    """One block-verified step of a chain: τ = the last i with η_i <= h_i (else 0)."""
    g = _chain_depth(spec.shape)
    out: dict = {}
    drafts = _chain_draws(spec, path, g)
    for xs, w in drafts:
        paths = [path + tuple(int(x) for x in xs[:i]) for i in range(g + 1)]
        p_rows = [spec.p(pp) for pp in paths]
        q_rows = [spec.q_verified(paths[i], xs[i]) for i in range(g)]
        h, residuals = block_weights(p_rows, q_rows, xs)
        for tau in range(g + 1):
            stop = (h[tau - 1] if tau else 1.0) * np.prod(1 - h[tau:])
            res = residuals[tau]
            if stop == 0 or res.sum() == 0:
                continue
            for y in np.flatnonzero(res > 0):
                _add(out, tuple(int(x) for x in xs[:tau]) + (int(y),),
                     w * stop * res[y] / res.sum())
    return out


def _chain_depth(shape: tuple) -> int:
    g = 0
    while shape:
        if len(shape) != 1:
            raise ValueError(f"block verification needs a chain; got the tree {shape}")
        shape, g = shape[0], g + 1
    return g


def _chain_draws(spec: Spec, path: tuple, g: int):
    """[(drafts x_1..x_g, probability)], each drafted after the ones before it."""
    draws = [((), 1.0)]
    for _ in range(g):
        draws = [(xs + (x,), w * w2) for xs, w in draws
                 for (x,), w2 in spec.children(path + xs, 1)]
    return draws


def emitted(spec: Spec, n: int, path: tuple = ()) -> dict:
    """{first n tokens: probability} of speculative decoding from `path` (steps chained)."""
    out: dict = {}
    for seq, w in step_dist(spec, path).items():
        if len(seq) >= n:
            _add(out, seq[:n], w)
        else:
            for tail, w2 in emitted(spec, n - len(seq), path + seq).items():
                _add(out, seq + tail, w * w2)
    return out


def target_joint(spec: Spec, n: int, path: tuple = ()) -> dict:
    """{first n tokens: probability} of sampling the target itself."""
    out = {(): 1.0}
    for _ in range(n):
        out = {seq + (int(y),): w * py for seq, w in out.items()
               for py, y in ((spec.p(path + seq)[y], y) for y in range(spec.target.vocab))
               if w * py > 0}
    return out


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def expected_accepted(spec: Spec, path: tuple = ()) -> float:
    """E[accepted drafts] of one step from `path`."""
    return sum(w * (len(seq) - 1) for seq, w in step_dist(spec, path).items())


# ---- the same settings as batched arrays, for sampling specjax's own verifier -------------
def tree_nodes(shape: tuple) -> tuple[list[int], list[int], list[tuple]]:
    """Breadth-first (topological) nodes of `shape`: parents (-1 = root), child ordinal
    among siblings, and each node's own child shape."""
    parents, ordinal, shapes = [], [], []
    frontier = [(-1, shape)]
    while frontier:
        nxt = []
        for parent, sub in frontier:
            for c, kid in enumerate(sub):
                parents.append(parent)
                ordinal.append(c)
                shapes.append(kid)
                nxt.append((len(parents) - 1, kid))
        frontier = nxt
    return parents, ordinal, shapes


def draw_rows(spec: Spec, rows: int, seed: int):
    """`rows` independent draft trees of `spec`, drawn in float64 from the exact draft.

    Returns (tokens [R, N], target logits [R, N+1, V] at [root, nodes], draft logits
    [R, N, V] each node was drawn from, i.e. at its parent's path)."""
    parents, ordinal, _ = tree_nodes(spec.shape)
    v, n = spec.target.vocab, len(parents)
    rng = np.random.default_rng(seed)
    paths = [np.zeros((rows, 0), np.int64)]  # per input: the path to it, [R, depth]
    tokens = np.zeros((rows, n), np.int64)
    draft_logits = np.zeros((rows, n, v))
    for i, (par, c) in enumerate(zip(parents, ordinal)):
        base = paths[par + 1]
        dl = _lookup(spec.draft, base)
        draft_logits[:, i] = dl
        if spec.draw == "topk":
            tokens[:, i] = np.argsort(-dl, axis=1, kind="stable")[:, c]
        else:
            # warped once per distinct context (at most V^depth of them), not per row:
            # per row, the 100k-row draws spent seconds in numpy's per-call overhead
            distinct, inverse = np.unique(dl, axis=0, return_inverse=True)
            q = np.stack([warp(z, *spec.warp_args)
                          for z in distinct])[inverse.reshape(-1)]
            tokens[:, i] = np.argmax(np.cumsum(q, axis=1) > rng.random((rows, 1)), axis=1)
        paths.append(np.concatenate([base, tokens[:, i:i + 1]], axis=1))
    target_logits = np.stack([_lookup(spec.target, p) for p in paths], axis=1)
    return tokens, target_logits, draft_logits


def _lookup(table: Table, paths: np.ndarray) -> np.ndarray:
    """[R, V] logits after each row's path (paths [R, L])."""
    dense = table.dense(paths.shape[1])
    return dense[tuple(paths.T)] if paths.shape[1] else np.broadcast_to(dense, (len(paths),
                                                                                  table.vocab))
