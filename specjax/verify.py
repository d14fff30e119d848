"""Verification of a draft tree against the target's logits: greedy, rejection, typical.

* Greedy follows the target's argmax down the tree: the output is exactly target-only
  greedy decoding.
* Rejection sampling is exactly lossless at any temperature (with top-k/top-p applied
  identically to both sides through `sampling.probs`): chains as in Leviathan et al.
  2023 / Chen et al. 2023, trees by recursive rejection over siblings (SpecInfer /
  EAGLE): child x with draft distribution q is accepted with probability
  min(1, p(x)/q(x)); on rejection the target's residual becomes norm(max(p - q, 0)) and
  the next sibling is tried; if all fail, the bonus token is drawn from the residual.
  Deterministic drafts (no `draft_probs`) are point masses: q = onehot(x).
* Block verification (Sun et al. 2025, "Block Verification Accelerates Speculative
  Decoding") judges a chain as a whole: exactly lossless, and for every draft block it
  accepts at least as many tokens in expectation as token-wise rejection (more for
  sampled drafts; as many for point masses). Chains only.
* Typical acceptance (Medusa) is LOSSY and only used when asked for by name.

Randomness is per row: `key` is one key per row ([B]; a single key is split into B),
node i's uniform is that row's key folded with i, so a row's outcome does not depend
on its batch or on how many nodes the tree has.

Indexing: verify inputs are [root, node 0, ..., node N-1], so node n is input n + 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import sampling as sampling_lib
from specjax.tree import DraftTree, check_draft_probs, is_chain

METHODS = ("rejection", "block", "typical")


def check_chain(tree: DraftTree) -> None:
    """Block verification's precondition, where the parents are known at trace time."""
    if isinstance(tree.parents, jax.core.Tracer):
        return
    for row, parents in enumerate(np.asarray(tree.parents)):
        if not is_chain(parents):
            raise ValueError(f"block verification needs a chain (parents -1, 0, 1, ...); "
                             f"row {row} has parents {parents.tolist()}")


@struct.dataclass
class VerifyResult:
    accepted: jax.Array  # [B, Dm] node index accepted at each depth, -1 after the stop
    num_accepted: jax.Array  # [B] int32 a: accepted draft tokens
    bonus: jax.Array  # [B] int32 token drawn from the target after the accepted path
    path_tokens: jax.Array  # [B, Dm+1] accepted tokens then the bonus (0 padding)
    path_inputs: jax.Array  # [B, Dm+1] verify-input index of root and accepted nodes


def _children(tree: DraftTree, cur: jax.Array, alive: jax.Array) -> jax.Array:
    """[B, N] bool: valid children of input `cur` [B] for rows still walking."""
    return tree.valid & (tree.parents == (cur - 1)[:, None]) & alive[:, None]


def _finish(tree: DraftTree, accepted: jax.Array, bonus: jax.Array) -> VerifyResult:
    b, dm = accepted.shape
    num = jnp.sum(accepted >= 0, axis=1).astype(jnp.int32)
    acc_tok = jnp.take_along_axis(tree.tokens, jnp.maximum(accepted, 0), axis=1)
    acc_tok = jnp.where(accepted >= 0, acc_tok, 0)
    path_tokens = jnp.concatenate([acc_tok, jnp.zeros((b, 1), jnp.int32)], axis=1)
    path_tokens = path_tokens.at[jnp.arange(b), num].set(bonus)
    path_inputs = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                                   jnp.where(accepted >= 0, accepted + 1, 0)], axis=1)
    return VerifyResult(accepted, num, bonus.astype(jnp.int32), path_tokens, path_inputs)


def verify_greedy(logits: jax.Array, tree: DraftTree) -> VerifyResult:
    """logits [B, N+1, V]: accept children equal to the target's argmax, depth by depth.
    A `while_loop` that stops once every row has stopped takes the argmax only at the
    inputs the walk reaches, not over every node's logits."""
    b = logits.shape[0]
    rows = jnp.arange(b)

    def step(c):
        d, cur, alive, accepted, bonus = c
        want = sampling_lib.argmax(logits[rows, cur])  # [B]
        match = _children(tree, cur, alive) & (tree.tokens == want[:, None])
        has = jnp.any(match, axis=1)
        idx = jnp.argmax(match, axis=1).astype(jnp.int32)
        accepted = accepted.at[:, d].set(jnp.where(has, idx, -1))
        bonus = jnp.where(alive & ~has, want, bonus)  # a row that stops here: its bonus
        return d + 1, jnp.where(has, idx + 1, cur), alive & has, accepted, bonus

    zeros = jnp.zeros((b,), jnp.int32)
    _, cur, alive, accepted, bonus = jax.lax.while_loop(
        lambda c: (c[0] < tree.max_depth) & jnp.any(c[2]), step,
        (0, zeros, jnp.ones((b,), bool), jnp.full((b, tree.max_depth), -1, jnp.int32), zeros))
    # rows that accepted a whole max_depth path still need the argmax at its end
    bonus = jax.lax.cond(jnp.any(alive),
                         lambda: jnp.where(alive, sampling_lib.argmax(logits[rows, cur]), bonus),
                         lambda: bonus)
    return _finish(tree, accepted, bonus)


def row_keys(key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
    """(uniform keys [B], bonus keys [B]) from one key per row [B] (or one key [], split)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # raw uint32 key data
        key = jax.random.wrap_key_data(key)
    keys = jax.random.split(key, batch) if key.ndim == 0 else key
    pair = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return pair[:, 0], pair[:, 1]


def _keys(key: jax.Array, batch: int, bonus_keys: jax.Array | None):
    """`row_keys`, with the bonus keys replaced by `bonus_keys` [B] when given (the
    decode loop passes the keys a plain step would sample with, so a row that drafts
    nothing draws the token a plain step draws)."""
    ukeys, own = row_keys(key, batch)
    return ukeys, own if bonus_keys is None else bonus_keys


def _uniforms(keys: jax.Array, n: int) -> jax.Array:
    """[B, N] node uniforms, one independent draw per (row, node)."""
    return sampling_lib.uniform_rows(keys, n)


def _bonus(keys: jax.Array, log_target: jax.Array, residual: jax.Array,
           use_residual: jax.Array) -> jax.Array:
    """[B] bonus tokens: from the residual [B, V] where use_residual [B], else from the
    target's own log-probabilities [B, V] (exactly as a plain decode step draws)."""
    logp = jnp.where(use_residual[:, None], jnp.log(residual), log_target)
    return sampling_lib.categorical_rows(keys, logp)


def verify_rejection(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                     key: jax.Array, bonus_keys: jax.Array | None = None) -> VerifyResult:
    """Lossless recursive rejection sampling over the tree (see module docstring).
    Vocabulary-wide work runs only where a walk is: `while_loop`s over the depths some
    row still walks and over the nodes that are some row's candidate child, so a step
    costs [B, V] work per visited node, not per (depth, node) of the tree."""
    b, t, v = logits.shape
    n = t - 1
    rows = jnp.arange(b)
    ukeys, bonus_keys = _keys(key, b, bonus_keys)
    us = _uniforms(ukeys, n).T  # [N, B]: node i's uniform is used at its depth only
    target = lambda cur: sampling_lib.log_probs(logits[rows, cur], sampling)  # [B, V]

    def visit(c):
        """Judge the first candidate node i against each row's residual."""
        cand, residual, found, chosen, rej = c
        i = jnp.argmax(jnp.any(cand, axis=0)).astype(jnp.int32)
        child = cand[:, i]
        x = tree.tokens[:, i]
        q = (jax.nn.one_hot(x, v, dtype=jnp.float32) if tree.draft_probs is None
             else tree.draft_probs[:, i])
        px = residual[rows, x]
        qx = q[rows, x]
        accept = child & (us[i] * qx < px)
        rest = jnp.maximum(residual - q, 0.0)
        mass = jnp.sum(rest, axis=-1, keepdims=True)
        rest = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), residual)
        residual = jnp.where((child & ~accept)[:, None], rest, residual)
        found = found | accept
        # a row that accepted stops judging its siblings
        cand = cand.at[:, i].set(False) & ~found[:, None]
        return cand, residual, found, jnp.where(accept, i, chosen), rej | (child & ~accept)

    def depth(c):
        d, cur, alive, stop_dist, rejected, accepted = c
        kids = _children(tree, cur, alive)  # [B, N]
        none = (jnp.zeros((b,), bool), jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), bool))
        # no row has a child here: every alive row stops without a rejection, so its
        # residual (stop_dist) is never read
        residual, found, chosen, rej = jax.lax.cond(
            jnp.any(kids),
            lambda: jax.lax.while_loop(lambda w: jnp.any(w[0]), visit,
                                       (kids, jnp.exp(target(cur))) + none)[1:],
            lambda: (stop_dist,) + none)
        newly_stopped = alive & ~found
        return (d + 1, jnp.where(found, chosen + 1, cur), alive & found,
                jnp.where(newly_stopped[:, None], residual, stop_dist),
                rejected | (newly_stopped & rej),  # the bonus comes from a residual
                accepted.at[:, d].set(jnp.where(found, chosen, -1)))

    _, cur, _, stop_dist, rejected, accepted = jax.lax.while_loop(
        lambda c: (c[0] < tree.max_depth) & jnp.any(c[2]), depth,
        (0, jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), jnp.zeros((b, v), jnp.float32),
         jnp.zeros((b,), bool), jnp.full((b, tree.max_depth), -1, jnp.int32)))
    bonus = _bonus(bonus_keys, target(cur), stop_dist, rejected)
    return _finish(tree, accepted, bonus)


def verify_block(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                 key: jax.Array, bonus_keys: jax.Array | None = None) -> VerifyResult:
    """Block verification of a chain x_1..x_g (drafts drawn from q_i = draft_probs, or
    point masses), with target p_i at input i (p_0: the root's):

      w_0 = 1,  w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_i(x_i))
      r_i = max(w_i p_i - q_{i+1}, 0)  (the residual after i accepted drafts, i < g)
      h_i = |r_i| / (|r_i| + 1 - w_i) for i < g,  h_g = w_g
      τ = the largest i with η_i < h_i (0 if none), η_i i.i.d. uniform
      bonus ~ p_g if τ = g, else r_τ / |r_τ|

    The chain is each row's longest valid prefix of nodes whose parent is the node
    before (a node off that path is never accepted)."""
    b, t, v = logits.shape
    n = t - 1
    g = min(n, tree.max_depth)
    logp_all = sampling_lib.log_probs(logits, sampling)  # [B, N+1, V]
    p_all = jnp.exp(logp_all)
    x = tree.tokens[:, :g]  # [B, g]
    q = (jax.nn.one_hot(x, v, dtype=jnp.float32) if tree.draft_probs is None
         else tree.draft_probs[:, :g])  # [B, g, V]: q[:, i] is node i's (x_{i+1}'s)
    on_chain = tree.valid[:, :g] & (tree.parents[:, :g] == jnp.arange(g)[None] - 1)
    length = jnp.sum(jnp.cumprod(on_chain, axis=1), axis=1)  # [B] γ: drafts in the chain
    px = jnp.take_along_axis(p_all[:, :g], x[..., None], axis=2)[..., 0]  # p_{i-1}(x_i)
    qx = jnp.take_along_axis(q, x[..., None], axis=2)[..., 0]
    ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0), jnp.where(px > 0, jnp.inf, 0.0))
    w = [jnp.ones((b,), jnp.float32)]
    for i in range(g):  # (a weight of 0 stays 0, even against a ratio of inf)
        w.append(jnp.where(w[-1] > 0, jnp.minimum(1.0, w[-1] * ratio[:, i]), 0.0))
    w = jnp.stack(w, axis=1)  # [B, g+1]
    res = jnp.maximum(w[:, :g, None] * p_all[:, :g] - q, 0.0)  # [B, g, V]: r_0..r_{g-1}
    mass = jnp.sum(res, axis=-1)  # [B, g]
    den = mass + 1.0 - w[:, :g]
    h_mid = jnp.where(den > 0, mass / jnp.where(den > 0, den, 1.0), 0.0)  # h_i, i < g
    i = jnp.arange(1, g + 1)[None]  # [1, g]
    h = jnp.where(i == length[:, None], w[:, 1:],
                  jnp.where(i < length[:, None], jnp.pad(h_mid[:, 1:], ((0, 0), (0, 1))), 0.0))
    ukeys, bonus_keys = _keys(key, b, bonus_keys)
    stops = _uniforms(ukeys, g) < h  # [B, g]
    tau = jnp.max(jnp.where(stops, i, 0), axis=1)  # [B]
    rows = jnp.arange(b)
    r_tau = jnp.concatenate([res, jnp.zeros((b, 1, v))], axis=1)[rows, tau]  # [B, V]
    use_res = (tau < length) & (jnp.sum(r_tau, axis=-1) > 0)
    bonus = _bonus(bonus_keys, logp_all[rows, tau], r_tau, use_res)
    accepted = jnp.where(jnp.arange(tree.max_depth)[None] < tau[:, None],
                         jnp.arange(tree.max_depth)[None], -1).astype(jnp.int32)
    return _finish(tree, accepted, bonus)


def verify_typical(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                   key: jax.Array, bonus_keys: jax.Array | None = None, epsilon: float = 0.09,
                   delta: float = 0.3) -> VerifyResult:
    """LOSSY Medusa typical acceptance: accept x if p(x) > min(epsilon, delta * exp(-H(p))).

    Among passing children the most probable under the target is taken; the bonus is
    drawn from the target at the last accepted node. Output is not the target's
    distribution; use only when asked for by name.
    """
    b = logits.shape[0]
    p_all = sampling_lib.probs(logits, sampling)
    ent = -jnp.sum(jnp.where(p_all > 0, p_all * jnp.log(p_all), 0.0), axis=-1)  # [B, N+1]
    thresh = jnp.minimum(epsilon, delta * jnp.exp(-ent))
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    accepted = []
    for _ in range(tree.max_depth):
        p_cur = p_all[rows, cur]  # [B, V]
        px = jnp.take_along_axis(p_cur, tree.tokens, axis=1)  # [B, N]
        ok = _children(tree, cur, alive) & (px > thresh[rows, cur][:, None])
        score = jnp.where(ok, px, -1.0)
        has = jnp.any(ok, axis=1)
        idx = jnp.argmax(score, axis=1).astype(jnp.int32)
        accepted.append(jnp.where(has, idx, -1))
        cur = jnp.where(has, idx + 1, cur)
        alive = alive & has
    bonus = sampling_lib.sample_rows(_keys(key, b, bonus_keys)[1], logits[rows, cur], sampling)
    return _finish(tree, jnp.stack(accepted, axis=1), bonus)


def verify_no_draft(root_logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                    key: jax.Array, bonus_keys: jax.Array | None = None) -> VerifyResult:
    """The result of a step whose tree has no valid node: nothing accepted, the token
    after the root drawn as a plain decode step draws it (the same distribution every
    verifier gives an empty tree). root_logits: [B, V]."""
    b = root_logits.shape[0]
    bonus = sampling_lib.sample_rows(_keys(key, b, bonus_keys)[1], root_logits, sampling)
    return _finish(tree, jnp.full((b, tree.max_depth), -1, jnp.int32), bonus)


def verify(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
           key: jax.Array, method: str = "rejection",
           bonus_keys: jax.Array | None = None) -> VerifyResult:
    """Greedy when temperature is 0, else `method`: "rejection" (token-wise, lossless),
    "block" (chains, lossless) or "typical" (lossy). key: [B] (one per row) or [];
    bonus_keys: [B] keys for the token drawn after the accepted path (None: from key)."""
    if method not in METHODS:
        raise ValueError(f"verification method={method!r} must be one of {METHODS}")
    check_draft_probs(tree.draft_probs, tree.sampled)
    if method == "block":
        check_chain(tree)
    sampled = {"rejection": verify_rejection, "block": verify_block,
               "typical": verify_typical}[method]
    return jax.lax.cond(sampling.greedy,
                        lambda: verify_greedy(logits, tree),
                        lambda: sampled(logits, tree, sampling, key, bonus_keys))
