"""`generate`: ragged-batch chunked prefill, then decoding in one `lax.while_loop`.

Two compiled programs per shape bucket: `_prefill` (prompt chunks through the target,
the first token sampled) and `_decode` (the whole rest of the generation in a
`lax.while_loop`, the loop state donated). The host sees only the final buffers; there
is no round trip per token. Timing the two apart gives TTFT and TPOT.

Invariant of the loop state: row b has `lengths[b]` tokens in `tokens[b]`; the paged
cache holds KV for all but the last of them (the "root"), which the next step feeds.
With a speculator a step is propose -> verify (one target forward over [root, tree])
-> commit (keep the accepted nodes' KV, compact them into place, append the bonus);
every row advances by its own count.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import kv_quant, rng
from specjax import sampling as sampling_lib
from specjax.attention import resolve_backend
from specjax.cache import PagedKVCache, PagePool, write_slots
from specjax.config import ModelConfig
from specjax.model import Model, decode_params, module_for, step, validate_tokens
from specjax.models.transformer import Hidden, Transformer
from specjax.sharding import rules as shard
from specjax.sharding.per_shard import move_slots
from specjax.speculators.base import CommitContext, PrefillChunk, ProposeContext, Speculator
from specjax.stats import (GenerationStats, VerifyCost, batch_verify_bucket, build_stats,
                           default_verify_cost, leviathan_optimal_k, position_acceptance)
from specjax.tree import ancestor_mask, check_tree
from specjax.xla_options import compile_decode
from specjax.verify import METHODS, verify, verify_no_draft


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row, prompt excluded (EOS kept if hit)
    text: list[str] | None
    stats: GenerationStats


@struct.dataclass
class LoopState:
    cache: PagedKVCache
    tokens: jax.Array  # [B, S] prompt + generated
    lengths: jax.Array  # [B]
    prompt_lens: jax.Array  # [B]
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B, K] uint32 key data of each row's own key (`specjax.rng`)
    spec_state: Any
    target_calls: jax.Array  # [B] decode-phase target forwards while active
    draft_calls: jax.Array  # [B]
    drafted: jax.Array  # [B] speculated positions (tree depth per step)
    accepted: jax.Array  # [B] accepted draft tokens
    hist: jax.Array  # [B, Dm+1] steps that accepted 0..Dm drafts
    tried: jax.Array  # [B, Dm] steps that verified depth d+1 with depth d accepted
    verified: jax.Array  # [B] target inputs fed while active (1 per plain step)
    verify_cost: jax.Array  # [B] float32: modelled cost of those forwards (VerifyCost)
    steps: jax.Array  # [] loop iterations
    # Probing (adaptive rule): a row the rule keeps at k = 0 drafts one token at step
    # next_probe [B] to re-measure its acceptance; probe_gap [B] steps later it probes
    # again, the gap doubling after each rejected probe (PROBE_GAP up to PROBE_GAP_MAX)
    # and resetting once the row accepts a draft.
    next_probe: jax.Array
    probe_gap: jax.Array


PROBE_GAP, PROBE_GAP_MAX = 16, 256
PROBE_LOOKAHEAD = 4  # accepted probes a probe's worth is judged over (`_rule`)


@struct.dataclass
class Rule:
    """What the adaptive rule reads besides the loop's counters; traced, so one compiled
    program serves every value."""

    cost_ratio: jax.Array  # [] c: one draft call's cost in one-token target steps
    adaptive: jax.Array  # [] bool: False drafts full depth every step
    vcost: VerifyCost  # the verify forward's cost model
    # [Dm] float32 prior acceptance per depth (`generate(acceptance_prior=)`): the
    # running estimates are shrunk towards it instead of the default's 0.75 / α_{d-1};
    # NaN: the default there (`position_acceptance`)
    prior: jax.Array
    # [] bool: each row decides as if it ran alone (verify costs at batch 1, no
    # batch-wide verify width), so a row's tokens do not depend on its batch
    # (`generate(seed=[...])`); False: the batch's costs and width
    per_row: jax.Array = np.bool_(False)


def probe_schedule(next_probe, gap, step, drafted, probed, accepted):
    """The next probe step and gap per row [B] after loop step `step`: a rejected probe
    doubles the gap (up to PROBE_GAP_MAX), an accepted draft resets it to PROBE_GAP, and
    a row that drafted (by choice or probing) waits a gap from this step. A draft that
    has stopped paying then costs a probe every 16, 32, ... 256 steps, not every 16."""
    gap = jnp.where(accepted > 0, PROBE_GAP,
                    jnp.where(probed, jnp.minimum(2 * gap, PROBE_GAP_MAX), gap))
    return jnp.where(drafted, step + gap, next_probe), gap


# ---------------------------------------------------------------------------- helpers
def _gather_hidden(hidden: Hidden, idx: jax.Array) -> Hidden:
    """Hidden [B, T, ...] at per-row indices idx [B, J] -> Hidden [B, J, ...]."""
    take = lambda x: jnp.take_along_axis(x, idx[:, :, None], axis=1)
    return Hidden(final=take(hidden.final), layers=tuple(take(x) for x in hidden.layers))


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _write_tokens(buf: jax.Array, start: jax.Array, new: jax.Array, count: jax.Array):
    """buf [B, S] with new [B, J] written at start[b] + j for j < count[b]."""
    j = jnp.arange(new.shape[1])[None, :]
    cols = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])
    rows = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], cols.shape)
    return buf.at[rows, cols].set(new, mode="drop")


def _logits_of(config: ModelConfig, params, h: jax.Array) -> jax.Array:
    return module_for(config).apply({"params": params}, h, method=Transformer.logits)


# ---------------------------------------------------------------------------- prefill
@functools.partial(jax.jit, static_argnames=("config", "chunk", "num_chunks", "backend",
                                             "kv_dtype"),
                   donate_argnames=("cache", "tokens"))
def _prefill(config: ModelConfig, params, spec: Speculator | None, cache: PagedKVCache,
             tokens: jax.Array, prompt_lens: jax.Array, sampling: sampling_lib.Sampling,
             keys: jax.Array, max_new: jax.Array, eos_ids: jax.Array, *, chunk: int,
             num_chunks: int, backend: str | None, kv_dtype=None):
    b, s = tokens.shape
    layers = spec.hidden_layers if spec is not None else ()
    spec_state = spec.init(config, b, s, kv_dtype=kv_dtype) if spec is not None else ()
    d = config.hidden_size
    dt = jnp.dtype(config.dtype)
    last = Hidden(jnp.zeros((b, 1, d), dt), tuple(jnp.zeros((b, 1, d), dt) for _ in layers))

    def body(i, carry):
        cache, spec_state, last = carry
        start = i * chunk
        tok = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        nxt = jax.lax.dynamic_slice_in_dim(tokens, start + 1, chunk, axis=1)
        pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None].repeat(b, 0)
        q_lens = jnp.clip(prompt_lens - start, 0, chunk)
        _, hidden, cache = step(config, params, cache, tok, pos, q_lens=q_lens,
                                hidden_layers=layers, return_logits=False,
                                attention_backend=backend)
        li = prompt_lens - 1 - start
        here = (li >= 0) & (li < chunk)
        at = _gather_hidden(hidden, jnp.clip(li, 0, chunk - 1)[:, None])
        last = jax.tree.map(lambda new, old: jnp.where(here[:, None, None], new, old), at, last)
        if spec is not None:
            pairs = jnp.clip(prompt_lens - 1 - start, 0, chunk)
            spec_state = spec.prefill(spec_state, PrefillChunk(tok, nxt, pos, pairs, hidden),
                                      params)
        return shard.constrain_caches((cache, spec_state, last))

    cache, spec_state, last = jax.lax.fori_loop(0, num_chunks, body, (cache, spec_state, last))
    logits = _logits_of(config, params, last.final[:, 0])  # [B, V]
    first = sampling_lib.sample_rows(rng.step_keys(keys, prompt_lens, rng.SAMPLE), logits,
                                     sampling)
    tokens = tokens.at[jnp.arange(b), prompt_lens].set(first)
    lengths = prompt_lens + 1
    if spec is not None:  # hand over the last prompt pair: (x_{P-1}, h_{P-1}) -> first
        root_in = jnp.take_along_axis(tokens, (prompt_lens - 1)[:, None], axis=1)
        spec_state = spec.commit(spec_state, CommitContext(
            tokens=root_in, next_tokens=first[:, None], positions=(prompt_lens - 1)[:, None],
            num_pairs=jnp.ones((b,), jnp.int32), hidden=last,
            num_accepted=jnp.zeros((b,), jnp.int32), lengths=lengths), params)
    done = _is_eos(first, eos_ids) | (max_new <= 1)
    dm = spec.max_depth if spec is not None else 0
    zeros = jnp.zeros((b,), jnp.int32)
    return shard.constrain_caches(LoopState(
        cache, tokens, lengths, prompt_lens, done, keys, spec_state, zeros, zeros, zeros, zeros,
        jnp.zeros((b, dm + 1), jnp.int32), jnp.zeros((b, dm), jnp.int32), zeros,
        jnp.zeros((b,), jnp.float32), jnp.int32(0), jnp.full((b,), PROBE_GAP - 1, jnp.int32),
        jnp.full((b,), PROBE_GAP, jnp.int32)))


# ---------------------------------------------------------------------------- decode
def _ar_step(config, params, st: LoopState, sampling, max_new, eos_ids, backend,
             hidden_layers: tuple[int, ...] = ()):
    """One plain decode step for every active row: the root through the target (cache
    written in place), the next token sampled and appended.
    Returns (state, root [B, 1], next token [B], the root's Hidden [B, 1, ...])."""
    active = ~st.done
    pos = (st.lengths - 1)[:, None]
    root = jnp.take_along_axis(st.tokens, pos, axis=1)
    logits, hidden, cache = step(config, params, st.cache, root, pos,
                                 q_lens=active.astype(jnp.int32), hidden_layers=hidden_layers,
                                 attention_backend=backend)
    nxt = sampling_lib.sample_rows(rng.step_keys(st.keys, st.lengths, rng.SAMPLE),
                                   logits[:, 0], sampling)
    tokens = _write_tokens(st.tokens, st.lengths, nxt[:, None], active.astype(jnp.int32))
    lengths = st.lengths + active
    done = st.done | (active & _is_eos(nxt, eos_ids)) | (lengths - st.prompt_lens >= max_new)
    hist = st.hist.at[:, 0].add(active)
    st = st.replace(cache=cache, tokens=tokens, lengths=lengths, done=done,
                    target_calls=st.target_calls + active, hist=hist,
                    verified=st.verified + active, verify_cost=st.verify_cost + active,
                    steps=st.steps + 1)
    return st, root, nxt, hidden


@struct.dataclass
class Speculation:
    """One propose + verify, before commit (also what `specjax.inspect` shows)."""

    tree: Any  # DraftTree, validity cut by depth_limit and activity
    result: Any  # VerifyResult
    kept_inputs: jax.Array  # [B, Dm+1] verify inputs of the root and accepted nodes
    kept_hidden: Hidden  # their target hidden states, [B, Dm+1, ...]
    cache: PagedKVCache  # with the verified inputs written, unless kept_kv is set
    # (keys, values) [L, B, Dm+1, K, H] of the kept inputs when the verify forward did
    # not write the cache (`_defer_kv_write`): commit writes them; else None
    kept_kv: Any
    spec_state: Any
    depth_limit: jax.Array  # [B]
    probed: jax.Array  # [B] bool: rows drafting only to re-measure (the rule said k = 0)
    width: jax.Array  # [] tree nodes the target verified this step (0: a plain decode step)


def verify_buckets(widths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(depth, width) of the verify forwards compiled for a speculator's `depth_widths`.

    The target forward's cost grows with the tokens it verifies (on CPU markedly; see
    docs/speculators.md), so when no row keeps a node deeper than d, only the W[d]-node
    prefix is verified. Four forwards, not Dm+1, bound compile time: a plain decode
    step (d = 0), depth 1, half depth and full depth. Depth 1 is what probes verify
    and what a one-token n-gram match needs (on CPU a 2-token forward costs less than
    the half-depth one of a k = 8 chain; docs/speculators.md).
    """
    dm = len(widths) - 1
    out: list[tuple[int, int]] = []
    for d in sorted({0, min(1, dm), (dm + 1) // 2, dm}):
        if out and out[-1][1] == widths[d]:
            out[-1] = (d, widths[d])  # same forward: let it serve the deeper depth
        else:
            out.append((d, int(widths[d])))
    return tuple(out)


def _bucket_width_per_depth(buckets) -> list[int]:
    """For k = 0..Dm: the width verified when the deepest kept node has depth k."""
    dm = buckets[-1][0]
    return [next(w for d, w in buckets if d >= k) for k in range(dm + 1)]


def _defer_kv_write(backend: str | None) -> bool:
    """Whether verify forwards leave the cache alone and commit writes only the kept
    tokens (`reference_attention_with_new`): with the reference attention off-mesh. A
    cache written inside the verify `lax.switch` comes out in a new buffer that XLA
    copies into the loop carry, the whole pool twice per step; the Pallas kernels read
    new tokens from the pages, so they keep the write-then-compact path."""
    return resolve_backend(backend) == "reference" and shard.active_mesh() is None


def _verify_prefix(width: int, config, params, spec: Speculator, st: LoopState, tree,
                   sampling, key, backend, verification: str):
    """Target forward over [root, first `width` nodes], verification, and the kept
    inputs' hidden states. Nodes past `width` must be invalid (the caller's bucket).
    Returns (result, kept inputs, kept hidden, cache with the inputs written); with
    `_defer_kv_write`, the kept inputs' (keys, values) [L, B, Dm+1, K, H] instead of
    the cache."""
    b = st.tokens.shape[0]
    active = ~st.done
    n = max(width, 1)  # width 0 keeps one (invalid) node so the tree is never empty
    sub = tree.replace(tokens=tree.tokens[:, :n], parents=tree.parents[:, :n],
                       depth=tree.depth[:, :n], valid=tree.valid[:, :n] & (width > 0),
                       draft_probs=None if tree.draft_probs is None
                       else tree.draft_probs[:, :n])
    root = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)  # [B, 1]
    inputs = jnp.concatenate([root, sub.tokens[:, :width]], axis=1)  # [B, width+1]
    positions = (st.lengths - 1)[:, None] + jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), sub.depth[:, :width]], axis=1)
    mask = ancestor_mask(sub.parents[:, :width], spec.max_depth) if width else None
    defer = _defer_kv_write(backend)
    logits, hidden, cache = step(config, params, st.cache, inputs, positions, mask=mask,
                                 q_lens=jnp.where(active, width + 1, 0),
                                 hidden_layers=spec.hidden_layers, attention_backend=backend,
                                 write_cache=not defer)
    # the token after the accepted path is drawn with the key a plain step at this length
    # samples with: a row that drafts nothing draws what the plain-step loop would draw
    bonus_keys = rng.step_keys(st.keys, st.lengths, rng.SAMPLE)
    if width == 0:  # a plain decode step's sampling, no verifier
        res = verify_no_draft(logits[:, 0], sub, sampling, key, bonus_keys)
    else:
        res = verify(logits, sub, sampling, key, verification, bonus_keys)
    kept = jnp.take_along_axis(inputs, res.path_inputs, axis=1)
    if defer:  # cache is the new (keys, values) [L, B, width+1, K, H]
        idx = res.path_inputs[None, :, :, None, None]
        cache = tuple(jnp.take_along_axis(x, idx, axis=2, mode="clip") for x in cache)
    return res, kept, _gather_hidden(hidden, res.path_inputs), cache


def _decision_rows(st: LoopState, rule: Rule) -> jax.Array:
    """The batch size the rule prices a verify forward at: the forward runs every row's
    width (done rows too), or 1 when rows decide alone (`Rule.per_row`)."""
    return jnp.where(rule.per_row, 1.0, float(st.tokens.shape[0]))


def _rule(spec: Speculator, st: LoopState, rule: Rule):
    """The adaptive rule: per row, the k that maximises expected tokens per unit of cost
    (Leviathan et al.'s, with the verify forward's cost growing with its width and c
    paid per draft call: k calls for a chain draft, one for Medusa's heads).
    Returns (α per position [B, Dm], k [B], whether a probe could pay [B]).

    A probe drafts depth 1 only, so all it can change is α_1 (and, through the chained
    prior, the deeper estimates). It is worth its cost only if PROBE_LOOKAHEAD accepted
    probes in a row would make the rule draft; where they would not (a head whose
    deeper acceptance is known to be low, or whose one call costs more than one
    accepted token returns), no outcome of the probe changes what the row does."""
    buckets = verify_buckets(tuple(spec.depth_widths))
    inputs = np.asarray(_bucket_width_per_depth(buckets)) + 1  # verified tokens per k
    rows = _decision_rows(st, rule)
    calls = np.minimum(np.arange(spec.max_depth + 1), spec.draft_calls_per_step())
    # k = 0 is a plain step (`_plain_steps`); k > 0 a forward in the verify switch
    v = jnp.where(inputs > 1, rule.vcost.speculative(inputs, rows), 1.0)
    best = lambda a: leviathan_optimal_k(a, rule.cost_ratio, spec.max_depth, v, calls)
    alpha = position_acceptance(st.hist, st.tried, mean=rule.prior)  # [B, Dm]
    hopeful = position_acceptance(st.hist.at[:, 1].add(PROBE_LOOKAHEAD),
                                  st.tried.at[:, 0].add(PROBE_LOOKAHEAD), mean=rule.prior)
    return alpha, best(alpha), best(hopeful) > 0


def _plain_steps(config, params, spec: Speculator, st: LoopState, sampling, max_new,
                 eos_ids, backend, rule: Rule, decision) -> LoopState:
    """Plain decode steps in a nested `lax.while_loop` while no row would draft: every
    active row at k = 0 by the adaptive rule, no probe due, and the speculator able to
    skip its draft call (`Speculator.can_skip`) or every row settled (below). Then the target forward runs at the
    loop's top level, cache written in place, instead of inside the verify `lax.switch`
    (on XLA:CPU a forward inside a conditional costs 1.08-1.10x, a nested while loop
    about 1.03x: `python -m specjax.bench.branching`). α and so the rule's k do not
    change on such steps (only accepted drafts and tries move them), so the rule's
    `decision` (`_rule`, evaluated once per outer step) holds throughout and for the
    speculative step after; each step hands the speculator its one pair (`commit`)."""
    _, limit, worth = decision
    idle = rule.adaptive & jnp.all(st.done | (limit == 0))  # no row would draft by choice
    # ... and none ever will in this call: no probe could pay, and without drafts α
    # cannot move. The speculator's state is then never read again, so it is left as
    # it is: no commit, and no draft call to empty a full queue (EAGLE's head paid one,
    # 0.4 of a target step, whenever its max_depth + 1 + QUEUE_SLACK slots filled).
    settled = idle & jnp.all(st.done | ~worth)

    def go_on(s: LoopState):
        active = ~s.done
        no_probe = jnp.all(s.done | (s.steps < s.next_probe) | ~worth)
        return (idle & no_probe & jnp.any(active) & (s.steps < max_new)
                & (settled | spec.can_skip(s.spec_state)))

    def plain(s: LoopState) -> LoopState:
        new, root, nxt, hidden = _ar_step(config, params, s, sampling, max_new, eos_ids,
                                          backend, spec.hidden_layers)
        emit = (~s.done).astype(jnp.int32)
        spec_state = jax.lax.cond(settled, lambda: s.spec_state, lambda: spec.commit(
            spec.skip(s.spec_state), CommitContext(
                tokens=root, next_tokens=nxt[:, None], positions=(s.lengths - 1)[:, None],
                num_pairs=emit, hidden=hidden, num_accepted=jnp.zeros_like(emit),
                lengths=new.lengths), params))
        return shard.constrain_caches(new.replace(spec_state=spec_state))

    return jax.lax.while_loop(go_on, plain, st)


def _propose_verify(config, params, spec: Speculator, st: LoopState, sampling, backend,
                    rule: Rule, decision=None, verification: str | None = None) -> Speculation:
    """Propose, then one target forward over the tree and verification (`verification`:
    a `specjax.verify.METHODS` name; None: the speculator's own)."""
    n, dm = spec.num_nodes, spec.max_depth
    verification = spec.verification if verification is None else verification
    active = ~st.done
    k_prop = rng.step_keys(st.keys, st.lengths, rng.PROPOSE)  # [B] keys, one per row
    k_ver = rng.step_keys(st.keys, st.lengths, rng.VERIFY)
    widths = tuple(spec.depth_widths)
    if len(widths) != dm + 1 or widths[0] != 0 or widths[-1] != n or list(widths) != sorted(
            widths):
        raise ValueError(f"{type(spec).__name__}.depth_widths={widths} must rise from 0 to "
                         f"num_nodes={n} over depths 0..max_depth={dm}")
    buckets = verify_buckets(widths)
    # `_rule`'s (α, k, worth): the outer step's, or evaluated here (`inspect`)
    alpha, limit, worth = _rule(spec, st, rule) if decision is None else decision
    adaptive, vcost = rule.adaptive, rule.vcost
    rows = _decision_rows(st, rule)
    probed = (limit == 0) & (st.steps >= st.next_probe) & adaptive & active & worth
    limit = jnp.where(probed, 1, limit)  # a row at k = 0 re-measures now and then
    probe = jnp.any(probed)
    limit = jnp.where(adaptive & active, limit, jnp.where(active, dm, 0))
    tree, spec_state = spec.propose(
        st.spec_state, ProposeContext(st.tokens, st.lengths, active, sampling, k_prop, limit),
        params)
    check_tree(tree)
    if tree.num_nodes != n or tree.max_depth != dm:
        raise ValueError(f"{type(spec).__name__} proposed {tree.num_nodes} nodes of depth "
                         f"{tree.max_depth}, but declares num_nodes={n}, max_depth={dm}")
    tree = tree.replace(valid=tree.valid & (tree.depth <= limit[:, None]))  # limit 0: inactive
    row_depth = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=1)  # [B]
    depths = [d for d, _ in buckets]
    covering = jnp.sum(jnp.asarray(depths) < jnp.max(row_depth))  # verifies every draft
    # Adaptive: the width that pays off for the batch as a whole; probe steps verify
    # every draft so that rows sitting at k = 0 keep measuring their acceptance.
    bucket_cost = vcost.speculative(np.asarray([w + 1 for _, w in buckets]), rows)
    best = batch_verify_bucket(alpha, row_depth, active, depths, bucket_cost)
    which = jnp.where(adaptive & ~probe & ~rule.per_row, jnp.minimum(best, covering),
                      covering)
    cut = jnp.asarray(depths, jnp.int32)[which]
    tree = tree.replace(valid=tree.valid & (tree.depth <= cut))
    branches = [functools.partial(_verify_prefix, w, config, params, spec, st, tree, sampling,
                                  k_ver, backend, verification) for _, w in buckets]
    defer = _defer_kv_write(backend)

    def idle():
        """No forward: every row finished (inside the plain-step loop, which hands over
        to this step only then or when a row would draft); all of it is masked out."""
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(branches[0]))
        res, kept, hidden, cache = zeros
        return (res.replace(accepted=res.accepted - 1), kept, hidden,
                cache if defer else st.cache)

    which = jnp.where(jnp.any(active), which, len(branches))
    res, kept, kept_hidden, cache = jax.lax.switch(which, branches + [idle])
    kept_kv = None
    if defer:
        cache, kept_kv = st.cache, cache
    width = jnp.asarray([w for _, w in buckets] + [0], jnp.int32)[which]
    return Speculation(tree, res, kept, kept_hidden, cache, kept_kv, spec_state, limit, probed,
                       width)


def _spec_step(config, params, spec: Speculator, st: LoopState, sampling, max_new, eos_ids,
               backend, rule: Rule, decision, verification: str) -> LoopState:
    b = st.tokens.shape[0]
    dm = spec.max_depth
    active = ~st.done
    sp = _propose_verify(config, params, spec, st, sampling, backend, rule, decision,
                         verification)
    tree, res, cache = sp.tree, sp.result, sp.cache
    spec_state, limit = sp.spec_state, sp.depth_limit
    base = (st.lengths - 1)[:, None]
    # How many of [accepted..., bonus] to emit: the row's budget, and stop after an EOS.
    budget = max_new - (st.lengths - st.prompt_lens)
    emit = jnp.minimum(res.num_accepted + 1, budget)
    j = jnp.arange(dm + 1)[None, :]
    eos_at = _is_eos(res.path_tokens, eos_ids) & (j < emit[:, None])
    new_eos = jnp.any(eos_at, axis=1)
    emit = jnp.where(new_eos, jnp.argmax(eos_at, axis=1) + 1, emit)
    emit = jnp.where(active, emit, 0)
    lens = st.lengths
    if sp.kept_kv is not None:  # Commit KV: the root and emitted accepted nodes, in order
        cache = write_slots(cache, *sp.kept_kv, lens - 1, emit)
    else:  # accepted node at tree slot L + node moves to slot L + depth - 1
        src = lens[:, None] + jnp.maximum(res.accepted, 0)
        dst = lens[:, None] + jnp.arange(dm)[None, :]
        keep = (res.accepted >= 0) & (jnp.arange(dm)[None, :] < (emit - 1)[:, None])
        cache = move_slots(cache, src, dst, keep)
    cache = cache.replace(lengths=jnp.where(active, lens - 1 + emit, st.cache.lengths))
    tokens = _write_tokens(st.tokens, lens, res.path_tokens, emit)
    lengths = lens + emit
    done = st.done | (active & new_eos) | (lengths - st.prompt_lens >= max_new)
    spec_state = spec.commit(spec_state, CommitContext(
        tokens=sp.kept_inputs, next_tokens=res.path_tokens,
        positions=base + jnp.arange(dm + 1)[None, :], num_pairs=emit,
        hidden=sp.kept_hidden, num_accepted=res.num_accepted, lengths=lengths), params)
    depth_used = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=1)
    acc = jnp.where(active, res.num_accepted, 0)  # what the verifier accepted (α), even
    # if the row's budget or an EOS then emits fewer
    hist = st.hist.at[jnp.arange(b), acc].add(active)
    d = jnp.arange(1, dm + 1)[None, :]
    tried = st.tried + (active[:, None] & (d <= jnp.minimum(acc + 1, depth_used)[:, None]))
    next_probe, gap = probe_schedule(st.next_probe, st.probe_gap, st.steps,
                                     sp.depth_limit > 0, sp.probed, acc)
    return st.replace(
        cache=cache, tokens=tokens, lengths=lengths, done=done, spec_state=spec_state,
        target_calls=st.target_calls + active,
        # drafting stops at the deepest depth any row keeps (ProposeContext.depth_limit):
        # every row waits for that many calls
        draft_calls=st.draft_calls + active * jnp.minimum(
            spec.draft_calls_per_step(), jnp.maximum(jnp.max(jnp.where(active, limit, 0)), 1)),
        drafted=st.drafted + jnp.where(active, depth_used, 0),
        accepted=st.accepted + acc, hist=hist, tried=tried,
        verified=st.verified + active * (sp.width + 1),
        verify_cost=st.verify_cost + active * rule.vcost.speculative(sp.width + 1, b),
        steps=st.steps + 1,
        next_probe=next_probe, probe_gap=gap)


@functools.partial(jax.jit, static_argnames=("config", "backend", "verification"),
                   donate_argnames=("state",))
def _decode(config: ModelConfig, params, spec: Speculator | None, state: LoopState,
            sampling, max_new, eos_ids, rule: Rule, *, backend, verification="rejection"):
    def cond(st):
        return jnp.any(~st.done) & (st.steps < max_new)

    def body(st):
        if spec is None:
            st = _ar_step(config, params, st, sampling, max_new, eos_ids, backend)[0]
        else:
            # plain steps leave α unchanged (only accepted drafts and tries move it), so
            # one evaluation of the rule serves both
            decision = _rule(spec, st, rule)
            st = _plain_steps(config, params, spec, st, sampling, max_new, eos_ids, backend,
                              rule, decision)
            st = _spec_step(config, params, spec, st, sampling, max_new, eos_ids, backend,
                            rule, decision, verification)
        return shard.constrain_caches(st)  # the carried pools stay split per data shard

    return jax.lax.while_loop(cond, body, state)


# ---------------------------------------------------------------------------- host API
def _as_token_lists(model: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, np.ndarray)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but the model has no tokenizer; "
                                 "pass token ids")
            p = model.tokenizer.encode(p).ids
        ids = [int(x) for x in np.asarray(p).reshape(-1)]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        validate_tokens(np.asarray(ids), model.config.vocab_size, what=f"prompt {i} token")
        out.append(ids)
    return out


def _prior(acceptance_prior, max_depth: int) -> np.ndarray:
    """generate's `acceptance_prior` as the loop's [max_depth] float32 (NaN: default)."""
    out = np.full((max_depth,), np.nan, np.float32)
    if acceptance_prior is None:
        return out
    vals = [np.nan if a is None else a for a in acceptance_prior]
    if len(vals) > max_depth or not all(
            isinstance(a, (int, float, np.floating, np.integer)) and (np.isnan(a) or 0 <= a <= 1)
            for a in vals):
        raise ValueError(f"acceptance_prior={acceptance_prior!r} must list at most "
                         f"max_depth={max_depth} rates in [0, 1] (None: the default)")
    out[:len(vals)] = vals
    return out


def _verification(verification: str | None, speculator: Speculator | None) -> str:
    """generate's `verification` checked against the speculator (None: its own)."""
    if verification is None:  # block verification for chains: lossless, never fewer
        if speculator is None:  # accepted in expectation, and no slower (docs/benchmarks.md)
            return METHODS[0]
        own = speculator.verification
        return "block" if own == "rejection" and speculator.proposes_chains else own
    if verification not in METHODS:
        raise ValueError(f"verification={verification!r} must be one of {METHODS}")
    if speculator is None:
        raise ValueError(f"verification={verification!r} needs a speculator")
    if verification == "block" and not speculator.proposes_chains:
        raise ValueError(f"verification='block' verifies chains; {type(speculator).__name__} "
                         "proposes trees with siblings (use 'rejection')")
    return verification


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Chunk lengths above this are padded to a multiple of it: the decode buffer's own step
# (`_bucket(..., 64)`), so prompt lengths add few compiled prefill programs beside the
# decode programs a length bucket already needs
PREFILL_MULTIPLE = 64


def prefill_chunks(max_len: int, prefill_chunk: int) -> tuple[int, int]:
    """(chunk, num_chunks) for prompts of up to `max_len` tokens: as few chunks of at most
    `prefill_chunk` tokens as cover them, of equal length padded to a power of two up to
    PREFILL_MULTIPLE and to a multiple of it beyond: a 150-token prompt runs 192 padded
    positions in one forward rather than 2 × 128."""
    num_chunks = -(-max_len // prefill_chunk)
    need = -(-max_len // num_chunks)
    chunk = (1 << (need - 1).bit_length() if need <= PREFILL_MULTIPLE
             else _bucket(need, PREFILL_MULTIPLE))
    return min(chunk, prefill_chunk), num_chunks


def generate(
    model: Model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    eos_id: int | Sequence[int] | None = None,
    ignore_eos: bool = False,
    speculator: Speculator | None = None,
    verification: str | None = None,
    adaptive: bool = True,
    cost_ratio: float | None = None,
    verify_cost: VerifyCost | None = None,
    acceptance_prior: Sequence[float | None] | None = None,
    layer_layout: str = "auto",
    page_size: int = 16,
    num_pages: int | None = None,
    prefill_chunk: int = 256,
    attention_backend: str | None = None,
    kv_cache_dtype=None,
) -> GenerationResult:
    """Generates up to `max_new_tokens` per prompt; greedy by default.

    prompts: token-id lists (a ragged batch) or strings (needs `model.tokenizer`).
    seed: an int (row r draws from this seed folded with r) or one int per prompt; rows
      draw from keys of their own (`specjax.rng`), so a row given seed s in a list
      samples the same tokens alone or in any batch, padded or not, plain or with a
      speculator. With a list the adaptive rule also decides each row as if it ran
      alone (verify costs at batch 1, no batch-wide verify width); with an int it
      prices the batch's forward and may cut every row's verify to one width.
    eos_id: stop tokens; None uses the config's `eos_token_id` (as transformers does);
      `ignore_eos=True` generates exactly `max_new_tokens`.
    speculator: a `specjax.speculators` instance; output is identical to target-only
      greedy decoding at temperature 0 and distributed as the target at any temperature.
    verification: how sampled drafts are verified (`specjax.verify`): "rejection"
      (token-wise, lossless), "block" (block verification of chains, lossless, accepts
      at least as many tokens in expectation; speculators that propose chains only:
      `Speculator.proposes_chains`), "typical" (Medusa's, LOSSY); None: the
      speculator's own (`speculator.verification`), "block" where that is "rejection"
      and the speculator proposes chains. Greedy decoding is unaffected.
    adaptive: per-row draft depth from running acceptance and the speculator's cost ratio.
    cost_ratio: one draft call's cost relative to a one-token target step, for the
      adaptive rule and the analytical speedup; None takes `speculator.cost_ratio`
      (parameter counts). Drafts cost more than their parameter share (the sampling,
      top-k and tree work around the matmuls), so pass a measured one
      (`specjax.calibrate.measured_cost_ratio`) where it matters. A step that
      drafts k positions makes min(k, `speculator.draft_calls_per_step()`) calls.
    verify_cost: `specjax.VerifyCost(jump, slope, per_token, branch)`: a forward of T
      tokens costs max(1 + jump·[T > 1] + slope·log2(T), per_token·T) one-token target
      steps (or measured ratios, `VerifyCost.from_table`), times 1 + branch inside the
      speculative step's verify switch
      (a batch's verify forward counts rows × T tokens, or reads tables measured at
      larger batches, `from_table(by_rows=)`); used by the adaptive rule
      and the analytical speedup. None takes this backend's `specjax.stats.VERIFY_COST`;
      `VerifyCost()` is Leviathan et al.'s free verify.
    acceptance_prior: the acceptance α_d per draft depth d = 1, 2, ... the adaptive rule
      starts from before a row has data of its own (None, or a None / NaN entry, or
      depths past the list: the default, 0.75 at depth 1, the row's α_{d-1} deeper).
      Pass a calibration run's `stats.acceptance_by_position` (same speculator, other
      prompts) so that a good draft drafts deep from its first step and a useless one
      does not explore (docs/speculators.md).
    layer_layout: "auto" (unrolled layers on CPU, where XLA's layer scan copies every
      layer's weights each step; scanned elsewhere), "scan" or "unrolled"
      (`specjax.model.decode_params`).
    prefill_chunk: the most prompt tokens one prefill forward takes; prompts run in as few
      equal chunks as cover the longest, padded to a multiple of 64 (`prefill_chunks`).
    num_pages: cache pages in the pool (default: exactly what the batch needs); on a mesh
      whose `data` axis splits the rows, split evenly between the data shards.
    kv_cache_dtype: the KV caches' pages, the target's and the speculator's own (a draft
      model's, an EAGLE head's), as vLLM's `kv_cache_dtype`: None (each model's dtype), a
      float dtype, or "int8" (per-token scales, about half of bf16's bytes;
      `specjax.kv_quant`). The output is then lossless against the target with that
      cache, which is not the float target's output token for token; the speculator's
      cache changes only what it proposes.
    """
    cfg = model.config
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    sampling_lib.validate_sampling(temperature, top_k, top_p)
    kv_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)
    if page_size < 1 or prefill_chunk < 1:
        raise ValueError(f"page_size={page_size} and prefill_chunk={prefill_chunk} must be >= 1")
    rows = _as_token_lists(model, prompts)
    lens = [len(r) for r in rows]
    for i, n in enumerate(lens):
        if n + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's context of {cfg.max_position_embeddings} positions")
    if speculator is not None:
        if not isinstance(speculator, Speculator):
            raise ValueError(f"speculator={speculator!r} is not a specjax Speculator")
        speculator.check_target(cfg)
    mesh = shard.mesh_of(model.params)  # run where the params live (None: one device)
    if mesh is not None and speculator is not None:
        speculator = shard.shard_speculator(speculator, mesh)
    elif speculator is not None:
        speculator = speculator.for_decoding(layer_layout)
    if ignore_eos:
        eos = ()
    elif eos_id is None:
        eos = cfg.eos_ids
    else:
        eos = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    b = len(rows)
    slack = speculator.num_nodes + 1 if speculator is not None else 1
    chunk, num_chunks = prefill_chunks(max(lens), prefill_chunk)
    # token buffer S: the padded prompt chunks (and the token after them) and every row's
    # prompt, new tokens and draft slack
    width = _bucket(max(num_chunks * chunk + 1, max(lens) + max_new_tokens + slack), 64)
    pages_per_row = -(-width // page_size)
    # Default pool: a full table per row, so the cache shape (and the compiled program)
    # depends only on the bucketed buffer width, not on the exact prompt lengths. On a
    # mesh each data shard owns the pages of its rows (shard-local ids).
    pool = PagePool(num_pages if num_pages is not None else b * pages_per_row, page_size,
                    num_shards=shard.page_shards(b, mesh))
    table = pool.allocate_rows([n + max_new_tokens + slack for n in lens], pages_per_row)
    buf = np.zeros((b, width), np.int32)
    for r, ids in enumerate(rows):
        buf[r, :len(ids)] = ids
    cache = shard.create_cache(cfg, table, num_pages=pool.num_pages, page_size=page_size,
                               mesh=mesh, dtype=kv_dtype)
    eos_pad = _bucket(max(len(eos), 1), 8)  # fixed size so stop tokens never recompile
    eos_list = list(eos) + [-1] * (eos_pad - len(eos))
    sampling, max_new, eos_arr = shard.replicate(
        (sampling_lib.Sampling.create(temperature, top_k, top_p), jnp.int32(max_new_tokens),
         jnp.asarray(eos_list, jnp.int32)), mesh)
    keys = shard.put(rng.row_key_data(seed, b), mesh, ("batch", None), name="keys")
    if cost_ratio is not None and not (np.isfinite(cost_ratio) and cost_ratio >= 0):
        raise ValueError(f"cost_ratio={cost_ratio!r} must be a finite number >= 0")
    if speculator is None:
        cost = 0.0
    else:
        cost = float(speculator.cost_ratio(cfg) if cost_ratio is None else cost_ratio)
    if verify_cost is not None and not isinstance(verify_cost, VerifyCost):
        raise ValueError(f"verify_cost={verify_cost!r} must be a specjax.VerifyCost")
    vcost = (default_verify_cost() if verify_cost is None else verify_cost).validated()
    prior = _prior(acceptance_prior, speculator.max_depth if speculator is not None else 0)
    plens = shard.put(np.asarray(lens, np.int32), mesh, ("batch",), name="prompt_lens")

    params = decode_params(cfg, model.params, layer_layout)
    pre_args = (cfg, params, speculator, cache,
                shard.put(buf, mesh, ("batch", None), name="tokens"), plens, sampling, keys,
                max_new, eos_arr)
    pre_kw = dict(chunk=chunk, num_chunks=num_chunks, backend=attention_backend,
                  kv_dtype=kv_dtype)
    t0 = time.perf_counter()
    pre = _compiled(_prefill, pre_args, pre_kw, mesh)
    state_shape = pre.out_info  # ShapeDtypeStructs of the loop state
    per_row = not rng.is_seed(seed)  # one seed per prompt: rows decide alone
    dec_args = (shard.replicate(Rule(jnp.float32(cost), jnp.bool_(adaptive),
                                     jax.tree.map(jnp.float32, vcost), jnp.asarray(prior),
                                     jnp.bool_(per_row)), mesh),)
    dec_kw = dict(backend=attention_backend,
                  verification=_verification(verification, speculator))
    dec = _compiled(_decode, (cfg, params, speculator, state_shape, sampling, max_new,
                              eos_arr) + dec_args, dec_kw, mesh)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    state = pre(*_dyn(pre_args))
    jax.block_until_ready(state.tokens)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = dec(*_dyn((cfg, params, speculator, state, sampling, max_new, eos_arr)
                      + dec_args))
    jax.block_until_ready(state.tokens)
    decode_s = time.perf_counter() - t0

    out_tokens = shard.to_host(state.tokens)
    out_lens = shard.to_host(state.lengths)
    gen = [out_tokens[r, lens[r]:out_lens[r]].tolist() for r in range(b)]
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(g, skip_special_tokens=True) for g in gen]
    stats = build_stats(
        new_tokens=[len(g) for g in gen], target_calls=shard.to_host(state.target_calls),
        draft_calls=shard.to_host(state.draft_calls), drafted=shard.to_host(state.drafted),
        accepted=shard.to_host(state.accepted), hist=shard.to_host(state.hist), cost_ratio=cost,
        tried=shard.to_host(state.tried),
        verified=shard.to_host(state.verified), verify_cost=shard.to_host(state.verify_cost),
        ttft_s=ttft, decode_s=decode_s, compile_s=compile_s)
    return GenerationResult(gen, text, stats)


# Compiled programs by (function, static args, argument shapes and shardings): jit's own
# cache would compile on first call, which would put compile time into TTFT.
# Least recently used programs are dropped past _MAX_COMPILED, so a long session (a
# notebook, a test run, a benchmark sweep) does not keep every executable alive.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_MAX_COMPILED = 32


def _dyn(args):
    """Drops the leading static config (positional) for calling a compiled program."""
    return args[1:]


def _compiled(fn, args, kwargs, mesh=None):
    cfg, rest = args[0], args[1:]
    leaves, treedef = jax.tree.flatten(rest)
    sig = (fn.__name__, cfg, treedef, tuple(kwargs.items()),
           tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))),
                  getattr(x, "sharding", None)) for x in leaves))
    if sig not in _COMPILED:
        with shard.use_mesh(mesh):  # traced under the mesh: attention runs per shard
            _COMPILED[sig] = compile_decode(fn.lower(cfg, *rest, **kwargs))
        while len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(sig)
    return _COMPILED[sig]
