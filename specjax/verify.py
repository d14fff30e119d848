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
* Typical acceptance (Medusa) is LOSSY and only used when asked for by name.

Indexing: verify inputs are [root, node 0, ..., node N-1], so node n is input n + 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import sampling as sampling_lib
from specjax.tree import DraftTree

METHODS = ("rejection", "typical")


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
    """logits [B, N+1, V]: accept children equal to the target's argmax, depth by depth."""
    b = logits.shape[0]
    g = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N+1]
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    accepted = []
    for _ in range(tree.max_depth):
        want = jnp.take_along_axis(g, cur[:, None], axis=1)  # [B, 1]
        match = _children(tree, cur, alive) & (tree.tokens == want)
        has = jnp.any(match, axis=1)
        idx = jnp.argmax(match, axis=1).astype(jnp.int32)
        accepted.append(jnp.where(has, idx, -1))
        cur = jnp.where(has, idx + 1, cur)
        alive = alive & has
    bonus = jnp.take_along_axis(g, cur[:, None], axis=1)[:, 0]
    return _finish(tree, jnp.stack(accepted, axis=1), bonus)


def verify_rejection(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                     key: jax.Array) -> VerifyResult:
    """Lossless recursive rejection sampling over the tree (see module docstring)."""
    b, t, v = logits.shape
    n = t - 1
    p_all = sampling_lib.probs(logits, sampling)  # [B, N+1, V]
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    stop_dist = jnp.zeros((b, v), jnp.float32)
    accepted = []
    key, bonus_key = jax.random.split(key)
    for d in range(tree.max_depth):
        residual = p_all[rows, cur]  # [B, V]
        kids = _children(tree, cur, alive)  # [B, N]
        us = jax.random.uniform(jax.random.fold_in(key, d), (n, b))

        def visit(i, carry, kids=kids, us=us):
            residual, found, chosen = carry
            child = kids[:, i] & ~found
            x = tree.tokens[:, i]
            onehot = jax.nn.one_hot(x, v, dtype=jnp.float32)
            q = onehot if tree.draft_probs is None else tree.draft_probs[:, i]
            px = residual[rows, x]
            qx = q[rows, x]
            accept = child & (us[i] * qx < px)
            rest = jnp.maximum(residual - q, 0.0)
            mass = jnp.sum(rest, axis=-1, keepdims=True)
            rest = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), residual)
            residual = jnp.where((child & ~accept)[:, None], rest, residual)
            return residual, found | accept, jnp.where(accept, i, chosen)

        residual, found, chosen = jax.lax.fori_loop(
            0, n, visit, (residual, jnp.zeros((b,), bool), jnp.full((b,), -1, jnp.int32)))
        newly_stopped = alive & ~found
        stop_dist = jnp.where(newly_stopped[:, None], residual, stop_dist)
        accepted.append(jnp.where(found, chosen, -1))
        cur = jnp.where(found, chosen + 1, cur)
        alive = alive & found
    stop_dist = jnp.where(alive[:, None], p_all[rows, cur], stop_dist)
    bonus = jax.random.categorical(bonus_key, jnp.log(stop_dist), axis=-1).astype(jnp.int32)
    return _finish(tree, jnp.stack(accepted, axis=1), bonus)


def verify_typical(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                   key: jax.Array, epsilon: float = 0.09, delta: float = 0.3) -> VerifyResult:
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
    bonus = sampling_lib.sample(key, logits[rows, cur], sampling)
    return _finish(tree, jnp.stack(accepted, axis=1), bonus)


def verify_no_draft(root_logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
                    key: jax.Array) -> VerifyResult:
    """The result of a step whose tree has no valid node: nothing accepted, the token
    after the root drawn as a plain decode step draws it (the same distribution every
    verifier gives an empty tree). root_logits: [B, V]."""
    b = root_logits.shape[0]
    bonus = sampling_lib.sample(key, root_logits, sampling)
    return _finish(tree, jnp.full((b, tree.max_depth), -1, jnp.int32), bonus)


def verify(logits: jax.Array, tree: DraftTree, sampling: sampling_lib.Sampling,
           key: jax.Array, method: str = "rejection") -> VerifyResult:
    """Greedy when temperature is 0, else `method` ("rejection" lossless, "typical" lossy)."""
    if method not in METHODS:
        raise ValueError(f"verification method={method!r} must be one of {METHODS}")
    sampled = verify_rejection if method == "rejection" else verify_typical
    return jax.lax.cond(sampling.greedy,
                        lambda: verify_greedy(logits, tree),
                        lambda: sampled(logits, tree, sampling, key))
