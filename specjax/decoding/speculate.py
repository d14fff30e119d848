"""One speculative step of `DecodeLoop`: propose, verify the bucket the policy picks in
one target forward, then commit the accepted tokens, their KV and the counters."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from specjax import rng
from specjax.decoding.policy import Decision, decide, probe_schedule, remaining_tokens
from specjax.decoding.state import LoopState, Params, Speculation
from specjax.model import step_kv
from specjax.models.transformer import Hidden
from specjax.speculators.base import CommitContext, ProposeContext, deepest_kept
from specjax.tree import ancestor_mask, check_tree
from specjax.verify import verify, verify_no_draft

if TYPE_CHECKING:
    from specjax.decoding.loop import DecodeLoop

# `jax.named_scope`s around a speculative step's phases: they only name the ops (XLA's
# op_name metadata), so that a profile can tell the phases apart (`specjax.bench.profile`)
SCOPE_DECIDE = "spec_decide"  # the adaptive rule (`policy.decide`)
SCOPE_PROPOSE = "spec_propose"  # the speculator's draft calls and tree
SCOPE_ACCEPT = "spec_accept"  # the verifier over the target's logits
SCOPE_COMMIT = "spec_commit"  # tokens, KV and the speculator's state after a step


def gather_hidden(hidden: Hidden, idx: jax.Array) -> Hidden:
    """Hidden [B, T, ...] at per-row indices idx [B, J] -> Hidden [B, J, ...]."""
    take = lambda x: jnp.take_along_axis(x, idx[:, :, None], axis=1)
    return Hidden(final=take(hidden.final), layers=tuple(take(x) for x in hidden.layers))


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def write_tokens(buf: jax.Array, start: jax.Array, new: jax.Array, count: jax.Array):
    """buf [B, S] with new [B, J] written at start[b] + j for j < count[b]."""
    j = jnp.arange(new.shape[1])[None, :]
    cols = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])
    rows = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], cols.shape)
    return buf.at[rows, cols].set(new, mode="drop")


def node_levels(buckets) -> list[int]:
    """For each node n of a tree of buckets[-1]'s width: the depth of the first verify
    bucket (`policy.verify_buckets`) wide enough to hold it. The bucket a step verifies
    covers its deepest valid node's level: a row whose nodes sit early in the tree's
    layout (a chain inside a wider tree's shape, a tree with few nodes at its first
    depths) runs a narrower forward than its depth alone would ask."""
    widths = [w for _, w in buckets]
    return [next(d for d, w in buckets if w > n) for n in range(widths[-1])]


def _propose(params: Params, st: LoopState, decision: Decision, levels: jax.Array):
    """(tree cut to each row's depth limit, speculator state, limit [B], probed [B]).

    A row keeps its nodes down to its depth limit, and any other valid node the verify
    bucket of that depth holds (levels [N], `node_levels`): the rule priced that bucket's
    forward, and a node in it costs nothing more. Where a tree's nodes come in depth
    order the two are the same nodes; a chain inside a wider tree's shape (`Hybrid`)
    fills the width its depth limit buys."""
    spec = params.speculator
    n, dm = spec.shape.num_nodes, spec.shape.max_depth
    active = ~st.done
    limit, probed = decision.depth_limits(st, dm)
    k_prop = rng.step_keys(st.keys, st.lengths, rng.PROPOSE)  # [B] keys, one per row
    tree, spec_state = spec.propose(
        st.spec_state,
        ProposeContext(st.tokens, st.lengths, active, params.sampling, k_prop, limit),
        params.target)
    check_tree(tree)
    if tree.num_nodes != n or tree.max_depth != dm:
        raise ValueError(f"{type(spec).__name__} proposed {tree.num_nodes} nodes of depth "
                         f"{tree.max_depth}, but declares num_nodes={n}, max_depth={dm}")
    kept = (tree.depth <= limit[:, None]) | (levels[None, :] <= limit[:, None])
    tree = tree.replace(valid=tree.valid & kept)  # limit 0 keeps none: levels are >= 1
    return tree, spec_state, limit, probed


def speculate(loop: "DecodeLoop", params: Params, st: LoopState,
              decision: Decision | None = None) -> Speculation:
    """Propose, then one target forward over the tree's verified prefix and verification
    (decision None: the policy's for `st`, as `specjax.inspect` asks)."""
    if decision is None:
        decision = decide(params.speculator, params.rule, loop.buckets, st, params.max_new,
                          loop.backend)
    active = ~st.done
    levels = jnp.asarray(node_levels(loop.buckets), jnp.int32)  # [N]
    with jax.named_scope(SCOPE_PROPOSE):
        tree, spec_state, limit, probed = _propose(params, st, decision, levels)
    proposed = tree.row_depths > 0  # before the batch's bucket cuts the tree
    which = decision.bucket(jnp.max(jnp.where(tree.valid, levels[None, :], 0), axis=1),
                            active, probed)
    widths = jnp.asarray([w for _, w in loop.buckets] + [0], jnp.int32)
    which = jnp.where(jnp.any(active), which, len(loop.buckets))  # last: the idle branch
    width = widths[which]
    # nodes past the bucket's width are invalid (the forward did not see them); a tree's
    # nodes come after their parents, so what is left is a tree
    tree = tree.replace(valid=tree.valid & (jnp.arange(tree.num_nodes)[None, :] < width))
    root = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)  # [B, 1]
    inputs = jnp.concatenate([root, tree.tokens], axis=1)  # [B, N+1]: a bucket's prefix
    branches = [functools.partial(_forward_prefix, loop, w, params, st, tree, inputs)
                for _, w in loop.buckets]

    def idle():
        """No forward: every row finished (inside the plain-step loop, which hands over
        to this step only then or when a row would draft); all of it is masked out."""
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(branches[0]))
        logits, hidden, carried = zeros
        return logits, hidden, st.cache if loop.commit.write_in_verify else carried

    # Only the forward differs between buckets; verifying once after the switch (over the
    # padded logits, the nodes past the width invalid) compiles the verifiers once, not
    # once per bucket (the sampled verifiers weigh in a speculative loop's compile time).
    logits, hidden, carried = jax.lax.switch(which, branches + [idle])
    with jax.named_scope(SCOPE_ACCEPT):
        res = _verify(loop, params, st, tree, logits, width)
    kept = jnp.take_along_axis(inputs, res.path_inputs, axis=1)
    cache, kept_kv = loop.commit.split(st.cache, loop.commit.kept(carried, res.path_inputs))
    return Speculation(tree=tree, result=res, kept_inputs=kept,
                       kept_hidden=gather_hidden(hidden, res.path_inputs),
                       cache=cache, kept_kv=kept_kv, spec_state=spec_state, depth_limit=limit,
                       probed=probed, proposed=proposed, width=width, bucket=which)


def _verify(loop: "DecodeLoop", params: Params, st: LoopState, tree, logits, width):
    """The verifier over logits [B, N+1, V] of [root, tree]; a step that verifies no node
    (width 0, or idle) samples the root's logits as a plain decode step does, without
    the verifier's work over the padding."""
    key = rng.step_keys(st.keys, st.lengths, rng.VERIFY)
    # the token after the accepted path is drawn with the key a plain step at this length
    # samples with: a row that drafts nothing draws what the plain-step loop would draw
    bonus_keys = rng.step_keys(st.keys, st.lengths, rng.SAMPLE)
    verification = (params.speculator.verification if loop.verification is None
                    else loop.verification)
    return jax.lax.cond(
        width == 0,
        lambda: verify_no_draft(logits[:, 0], tree, params.sampling, key, bonus_keys),
        lambda: verify(logits, tree, params.sampling, key, verification, bonus_keys))


def _forward_prefix(loop: "DecodeLoop", width: int, params: Params, st: LoopState, tree,
                    inputs: jax.Array):
    """Target forward over inputs [B, N+1] = [root, tree]'s first width + 1: (logits
    [B, N+1, V], hidden [B, N+1, ...], what the commit strategy carries), padded past
    width + 1 to the whole tree so that every bucket's branch has one shape."""
    spec = params.speculator
    b, n = st.tokens.shape[0], tree.num_nodes
    active = ~st.done
    inputs = inputs[:, :width + 1]
    positions = (st.lengths - 1)[:, None] + jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), tree.depth[:, :width]], axis=1)
    mask = ancestor_mask(tree.parents[:, :width], spec.shape.max_depth) if width else None
    logits, hidden, out = step_kv(loop.config, params.target, st.cache, inputs, positions,
                                  mask=mask, q_lens=jnp.where(active, width + 1, 0),
                                  hidden_layers=spec.hidden_layers,
                                  attention_backend=loop.backend,
                                  write_in_layers=loop.commit.write_in_verify)
    pad = lambda x, axis: jnp.pad(x, [(0, n - width if a == axis else 0)
                                      for a in range(x.ndim)])
    hidden = Hidden(final=pad(hidden.final, 1), layers=tuple(pad(x, 1) for x in hidden.layers))
    return pad(logits, 1), hidden, loop.commit.carry(out, lambda x: pad(x, 2))


def speculative_step(loop: "DecodeLoop", params: Params, st: LoopState,
                     decision: Decision) -> LoopState:
    """Propose and verify, then emit the accepted tokens and the bonus (up to the row's
    budget and its first EOS), commit their KV and hand the speculator its pairs."""
    sp = speculate(loop, params, st, decision)
    with jax.named_scope(SCOPE_COMMIT):
        return _commit(loop, params, st, sp, decision)


def _commit(loop: "DecodeLoop", params: Params, st: LoopState, sp: Speculation,
            decision: Decision) -> LoopState:
    """The state after emitting `sp`'s accepted tokens and bonus: KV committed, tokens
    written, counters and probes advanced, the speculator handed its pairs."""
    spec, dm = params.speculator, params.speculator.shape.max_depth
    active = ~st.done
    res, lens = sp.result, st.lengths
    # How many of [accepted..., bonus] to emit: the row's budget, and stop after an EOS.
    budget = remaining_tokens(st, params.max_new)
    emit = jnp.minimum(res.num_accepted + 1, budget)
    j = jnp.arange(dm + 1)[None, :]
    eos_at = is_eos(res.path_tokens, params.eos_ids) & (j < emit[:, None])
    new_eos = jnp.any(eos_at, axis=1)
    emit = jnp.where(new_eos, jnp.argmax(eos_at, axis=1) + 1, emit)
    emit = jnp.where(active, emit, 0)
    cache = loop.commit.apply(sp.cache, sp.kept_kv, res.accepted, lens, emit)
    cache = cache.replace(lengths=jnp.where(active, lens - 1 + emit, st.cache.lengths))
    tokens = write_tokens(st.tokens, lens, res.path_tokens, emit)
    lengths = lens + emit
    done = st.done | (active & new_eos) | (lengths - st.prompt_lens >= params.max_new)
    spec_state = spec.commit(sp.spec_state, CommitContext(
        tokens=sp.kept_inputs, next_tokens=res.path_tokens,
        positions=(lens - 1)[:, None] + jnp.arange(dm + 1)[None, :], num_pairs=emit,
        hidden=sp.kept_hidden, num_accepted=res.num_accepted, lengths=lengths), params.target)
    acc = jnp.where(active, res.num_accepted, 0)  # what the verifier accepted (α), even
    # if the row's budget or an EOS then emits fewer
    next_probe, gap = probe_schedule(st.probes.next_probe, st.probes.probe_gap, st.steps,
                                     sp.depth_limit > 0, sp.probed, acc,
                                     decision.rule.probe_gap)
    return st.replace(
        cache=cache, tokens=tokens, lengths=lengths, done=done, spec_state=spec_state,
        counters=_count(params, st, sp, acc, decision), steps=st.steps + 1,
        probes=st.probes.replace(next_probe=next_probe, probe_gap=gap))


def _count(params: Params, st: LoopState, sp: Speculation, acc, decision: Decision):
    """The counters after a speculative step that accepted `acc` [B] drafts per row."""
    c, b, dm = st.counters, st.tokens.shape[0], params.speculator.shape.max_depth
    active = ~st.done
    depth_used = sp.tree.row_depths  # after the bucket's cut
    d = jnp.arange(1, dm + 1)[None, :]
    tried = c.tried + (active[:, None] & (d <= jnp.minimum(acc + 1, depth_used)[:, None]))
    # drafting stops at the deepest depth any row keeps (ProposeContext.depth_limit):
    # every row waits for that many calls
    calls = jnp.minimum(params.speculator.cost.calls_per_step,
                        jnp.maximum(deepest_kept(active, sp.depth_limit), 1))
    return c.replace(
        target_calls=c.target_calls + active, draft_calls=c.draft_calls + active * calls,
        drafted=c.drafted + jnp.where(active, depth_used, 0), accepted=c.accepted + acc,
        hist=c.hist.at[jnp.arange(b), acc].add(active), tried=tried,
        verified=c.verified + active * (sp.width + 1),
        verify_cost=c.verify_cost + active * decision.spent[sp.bucket],
        asked=c.asked + (active & (sp.depth_limit > 0)),
        proposed=c.proposed + (active & (sp.depth_limit > 0) & sp.proposed))
