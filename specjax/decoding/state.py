"""The decode loop's typed state: what one step reads and returns, built by keyword.

Invariant: row b has `lengths[b]` tokens in `tokens[b]`; the paged cache holds KV for all
but the last of them (the "root"), which the next step feeds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import PagedKVCache
from specjax.models.transformer import Hidden


@struct.dataclass
class Counters:
    """Per-row decode-phase counters, for the adaptive rule and the host's statistics."""

    target_calls: jax.Array  # [B] target forwards while active
    draft_calls: jax.Array  # [B]
    drafted: jax.Array  # [B] speculated positions (tree depth per step)
    accepted: jax.Array  # [B] accepted draft tokens
    hist: jax.Array  # [B, Dm+1] steps that accepted 0..Dm drafts
    tried: jax.Array  # [B, Dm] steps that verified depth d+1 with depth d accepted
    verified: jax.Array  # [B] target inputs fed while active (1 per plain step)
    verify_cost: jax.Array  # [B] float32: modelled cost of those forwards (VerifyCost)
    # [B] speculative steps that asked the row for a draft (depth limit >= 1), and those
    # in which the speculator proposed at least one token (before the batch's verify
    # bucket cut it): how often a speculator that may find nothing (n-gram) drafts
    asked: jax.Array
    proposed: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_depth: int) -> "Counters":
        zeros = jnp.zeros((batch,), jnp.int32)
        return cls(target_calls=zeros, draft_calls=zeros, drafted=zeros, accepted=zeros,
                   hist=jnp.zeros((batch, max_depth + 1), jnp.int32),
                   tried=jnp.zeros((batch, max_depth), jnp.int32), verified=zeros,
                   verify_cost=jnp.zeros((batch,), jnp.float32), asked=zeros,
                   proposed=zeros)


@struct.dataclass
class Probes:
    """When a row the adaptive rule keeps at k = 0 drafts one token to re-measure its
    acceptance (`specjax.decoding.policy.probe_schedule`)."""

    next_probe: jax.Array  # [B] the loop step of the row's next probe
    probe_gap: jax.Array  # [B] steps between its probes


@struct.dataclass
class LoopState:
    cache: PagedKVCache
    tokens: jax.Array  # [B, S] prompt + generated
    lengths: jax.Array  # [B]
    prompt_lens: jax.Array  # [B]
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B, K] uint32 key data of each row's own key (`specjax.rng`)
    spec_state: Any
    steps: jax.Array  # [] loop iterations
    counters: Counters
    probes: Probes


@struct.dataclass
class Prompt:
    """What prefill starts from: the zeroed cache and the padded prompts."""

    cache: PagedKVCache
    tokens: jax.Array  # [B, S] prompts, zero-padded to the token buffer's width
    prompt_lens: jax.Array  # [B]
    keys: jax.Array  # [B, K] each row's key data


@struct.dataclass
class Params:
    """What the loop reads and never changes, traced so one program serves every value:
    the target's and the speculator's weights, sampling, stopping and the rule."""

    target: Any
    speculator: Any  # a `Speculator` (a pytree of its weights and settings) or None
    sampling: Any  # `specjax.sampling.Sampling`
    max_new: jax.Array  # [] int32
    eos_ids: jax.Array  # [E] int32 stop tokens, -1 padded
    rule: Any = None  # `specjax.decoding.policy.Rule`; prefill reads none


@struct.dataclass
class Speculation:
    """One propose + verify, before commit (also what `specjax.inspect` shows)."""

    tree: Any  # DraftTree, validity cut by depth_limit and activity
    result: Any  # VerifyResult
    kept_inputs: jax.Array  # [B, Dm+1] verify inputs of the root and accepted nodes
    kept_hidden: Hidden  # their target hidden states, [B, Dm+1, ...]
    cache: PagedKVCache  # with the verified inputs written, unless kept_kv is set
    # (keys, values) [L, B, Dm+1, K, H] of the kept inputs when the verify forward did
    # not write the cache (`specjax.decoding.commit.WriteKept`); else None
    kept_kv: Any
    spec_state: Any
    depth_limit: jax.Array  # [B]
    probed: jax.Array  # [B] bool: rows drafting only to re-measure (the rule said k = 0)
    proposed: jax.Array  # [B] bool: rows whose draft (within their limit) has a node
    width: jax.Array  # [] tree nodes the target verified this step (0: a plain decode step)
    bucket: jax.Array  # [] the verify bucket that ran (len(buckets): no forward)
