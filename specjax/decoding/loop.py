"""`DecodeLoop`: prefill, then the whole generation in one `lax.while_loop`.

A frozen, hashable dataclass of static settings (the compiled program's), whose jitted
`prefill` and `run` take the traced `Params` and the typed `LoopState`. With a speculator
a step is decide (`policy.decide`) -> plain steps while no row would draft -> propose ->
verify (one target forward over [root, tree prefix]) -> commit (`commit`); every row
advances by its own count.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax import rng, rows_matmul, sampling as sampling_lib
from specjax.config import ModelConfig
from specjax.decoding import commit as commit_lib
from specjax.decoding.policy import Decision, decide, initial_probes, verify_buckets
from specjax.decoding.speculate import (
    SCOPE_COMMIT,
    SCOPE_DECIDE,
    gather_hidden,
    is_eos,
    speculate,
    speculative_step,
    write_tokens,
)
from specjax.decoding.state import Counters, LoopState, Params, Prompt, Speculation
from specjax.model import module_for, step
from specjax.models.transformer import Hidden, Transformer
from specjax.sharding import rules as shard
from specjax.speculators.base import CommitContext, PrefillChunk, Speculator


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """The compiled loop's static settings: equal loops share one program. The weights
    (the speculator's too) and every tunable number travel in the traced `Params`."""

    config: ModelConfig
    backend: str | None = None  # attention backend (`specjax.attention`)
    commit: commit_lib.Commit = commit_lib.COMPACT  # how verified KV is committed
    verification: str | None = None  # `specjax.verify.METHODS`; None: the speculator's
    buckets: tuple[tuple[int, int], ...] = ()  # (depth, width) verify forwards

    @classmethod
    def create(cls, config: ModelConfig, spec: Speculator | None, *, backend=None,
               commit: commit_lib.Commit | None = None,
               verification: str | None = None) -> "DecodeLoop":
        """The loop for `spec`, its verify buckets computed once here (commit None: the
        backend's default under the mesh active now)."""
        buckets = verify_buckets(spec.shape.depth_widths) if spec is not None else ()
        commit = commit_lib.default_commit(backend) if commit is None else commit
        return cls(config, backend, commit, verification, buckets)

    def prefill_only(self) -> "DecodeLoop":
        """This loop without the decode-only settings prefill never reads, so that one
        prefill program serves every verification method and commit strategy."""
        return DecodeLoop(self.config, self.backend)

    @functools.partial(jax.jit, static_argnames=("self", "chunk", "num_chunks", "kv_dtype"),
                       donate_argnames=("prompt",))
    def prefill(self, params: Params, prompt: Prompt, *, chunk: int, num_chunks: int,
                kv_dtype=None) -> LoopState:
        """Prompt chunks through the target (and the speculator), the first token
        sampled: the state `run` starts from."""
        spec, (b, s) = params.speculator, prompt.tokens.shape
        spec_state = spec.init(self.config, b, s, kv_dtype=kv_dtype) if spec is not None else ()
        cache, spec_state, last = self._prompt_chunks(params, prompt, spec_state, chunk,
                                                      num_chunks)
        logits = module_for(self.config, params.target).apply(
            {"params": params.target}, last.final[:, 0], method=Transformer.logits)  # [B, V]
        plens = prompt.prompt_lens
        first = sampling_lib.sample_rows(rng.step_keys(prompt.keys, plens, rng.SAMPLE), logits,
                                         params.sampling)
        tokens = prompt.tokens.at[jnp.arange(b), plens].set(first)
        lengths = plens + 1
        if spec is not None:  # hand over the last prompt pair: (x_{P-1}, h_{P-1}) -> first
            root_in = jnp.take_along_axis(tokens, (plens - 1)[:, None], axis=1)
            spec_state = spec.commit(spec_state, CommitContext(
                tokens=root_in, next_tokens=first[:, None], positions=(plens - 1)[:, None],
                num_pairs=jnp.ones((b,), jnp.int32), hidden=last,
                num_accepted=jnp.zeros((b,), jnp.int32), lengths=lengths), params.target)
        done = is_eos(first, params.eos_ids) | (params.max_new <= 1)
        dm = spec.shape.max_depth if spec is not None else 0
        return shard.constrain_caches(LoopState(
            cache=cache, tokens=tokens, lengths=lengths, prompt_lens=plens, done=done,
            keys=prompt.keys, spec_state=spec_state, steps=jnp.int32(0),
            counters=Counters.zeros(b, dm), probes=initial_probes(b)))

    def _prompt_chunks(self, params: Params, prompt: Prompt, spec_state, chunk, num_chunks):
        """(cache, speculator state, the last prompt token's Hidden [B, 1, ...]) after
        every chunk's target forward."""
        spec, tokens, plens = params.speculator, prompt.tokens, prompt.prompt_lens
        b = tokens.shape[0]
        layers = spec.hidden_layers if spec is not None else ()
        d, dt = self.config.hidden_size, jnp.dtype(self.config.dtype)
        last = Hidden(jnp.zeros((b, 1, d), dt), tuple(jnp.zeros((b, 1, d), dt) for _ in layers))

        def body(i, carry):
            cache, spec_state, last = carry
            start = i * chunk
            tok = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
            nxt = jax.lax.dynamic_slice_in_dim(tokens, start + 1, chunk, axis=1)
            pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None].repeat(b, 0)
            q_lens = jnp.clip(plens - start, 0, chunk)
            _, hidden, cache = step(self.config, params.target, cache, tok, pos, q_lens=q_lens,
                                    hidden_layers=layers, return_logits=False,
                                    attention_backend=self.backend)
            li = plens - 1 - start
            here = (li >= 0) & (li < chunk)
            at = gather_hidden(hidden, jnp.clip(li, 0, chunk - 1)[:, None])
            last = jax.tree.map(lambda new, old: jnp.where(here[:, None, None], new, old),
                                at, last)
            if spec is not None:
                pairs = jnp.clip(plens - 1 - start, 0, chunk)
                spec_state = spec.prefill(spec_state, PrefillChunk(tok, nxt, pos, pairs, hidden),
                                          params.target)
            return shard.constrain_caches((cache, spec_state, last))

        return jax.lax.fori_loop(0, num_chunks, body, (prompt.cache, spec_state, last))

    @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("state",))
    def run(self, params: Params, state: LoopState) -> LoopState:
        """Steps until every row is done or the budget of new tokens is spent; the rows'
        first probes wait the rule's gap (`Rule.probe_gap`: prefill reads no rule). Its
        products take the few-row kernels at any row count (`rows_matmul.any_rows`): a
        verify's rows get a plain step's bits at every batch and tree size."""
        state = state.replace(probes=initial_probes(state.lengths.shape[0],
                                                    params.rule.probe_gap))

        def cond(st):
            return jnp.any(~st.done) & (st.steps < params.max_new)

        with rows_matmul.any_rows():
            return jax.lax.while_loop(cond, functools.partial(self.step, params), state)

    def step(self, params: Params, st: LoopState) -> LoopState:
        """One loop iteration: a plain step, or (with a speculator) the rule's decision,
        the plain steps it allows, then one speculative step."""
        spec = params.speculator
        if spec is None:
            st = self.plain_step(params, st)[0]
        else:  # plain steps leave α unchanged, so one decision serves both
            with jax.named_scope(SCOPE_DECIDE):
                decision = decide(spec, params.rule, self.buckets, st, params.max_new,
                                  self.backend)
            st = self.plain_steps(params, st, decision)
            st = self.speculative_step(params, st, decision)
        return shard.constrain_caches(st)  # the carried pools stay split per data shard

    def plain_step(self, params: Params, st: LoopState, hidden_layers: tuple[int, ...] = ()):
        """One plain decode step for every active row: the root through the target (cache
        written in place), the next token sampled and appended.
        Returns (state, root [B, 1], next token [B], the root's Hidden [B, 1, ...])."""
        active = ~st.done
        pos = (st.lengths - 1)[:, None]
        root = jnp.take_along_axis(st.tokens, pos, axis=1)
        logits, hidden, cache = step(self.config, params.target, st.cache, root, pos,
                                     q_lens=active.astype(jnp.int32),
                                     hidden_layers=hidden_layers, attention_backend=self.backend)
        nxt = sampling_lib.sample_rows(rng.step_keys(st.keys, st.lengths, rng.SAMPLE),
                                       logits[:, 0], params.sampling)
        tokens = write_tokens(st.tokens, st.lengths, nxt[:, None], active.astype(jnp.int32))
        lengths = st.lengths + active
        done = (st.done | (active & is_eos(nxt, params.eos_ids))
                | (lengths - st.prompt_lens >= params.max_new))
        c = st.counters
        counters = c.replace(target_calls=c.target_calls + active, hist=c.hist.at[:, 0].add(active),
                             verified=c.verified + active, verify_cost=c.verify_cost + active)
        st = st.replace(cache=cache, tokens=tokens, lengths=lengths, done=done,
                        counters=counters, steps=st.steps + 1)
        return st, root, nxt, hidden

    def plain_steps(self, params: Params, st: LoopState, decision: Decision) -> LoopState:
        """Plain decode steps in a nested `lax.while_loop` while no row would draft (every
        active row at k = 0 or, where the speculator can tell cheaply (`has_draft`),
        without a draft now; no probe due; and the speculator able to skip its draft call
        or every row settled), so the target forward runs outside the verify switch. Each
        step hands the speculator its one pair (`commit`)."""
        spec = params.speculator
        adaptive = decision.rule.adaptive
        idle = adaptive & jnp.all(st.done | (decision.limit == 0))
        # ... and none ever will in this call: no probe could pay, and without drafts α
        # cannot move. The speculator's state is then never read again: no commit, and no
        # draft call to empty a full queue.
        settled = idle & ~decision.probes_could_pay(~st.done)

        def drafts_now(s: LoopState):
            """[] bool: whether a row would draft at this step."""
            wants = (decision.limit > 0) | decision.probing(s)
            if spec.peeks:  # a row drafts where it has a draft (probes wait for one)
                wants &= spec.has_draft(s.spec_state, s.tokens, s.lengths)
            return jnp.any(wants & ~s.done)

        def go_on(s: LoopState):
            quiet = settled | ~drafts_now(s)  # settled: never again
            return (adaptive & quiet & jnp.any(~s.done) & (s.steps < params.max_new)
                    & (settled | spec.can_skip(s.spec_state)))

        def plain(s: LoopState) -> LoopState:
            new, root, nxt, hidden = self.plain_step(params, s, spec.hidden_layers)
            emit = (~s.done).astype(jnp.int32)
            with jax.named_scope(SCOPE_COMMIT):
                spec_state = jax.lax.cond(settled, lambda: s.spec_state, lambda: spec.commit(
                    spec.skip(s.spec_state), CommitContext(
                        tokens=root, next_tokens=nxt[:, None],
                        positions=(s.lengths - 1)[:, None], num_pairs=emit, hidden=hidden,
                        num_accepted=jnp.zeros_like(emit), lengths=new.lengths),
                    params.target))
            return shard.constrain_caches(new.replace(spec_state=spec_state))

        return jax.lax.while_loop(go_on, plain, st)

    def speculate(self, params: Params, st: LoopState,
                  decision: Decision | None = None) -> Speculation:
        """Propose + verify, before commit (`speculate.speculate`)."""
        return speculate(self, params, st, decision)

    def speculative_step(self, params: Params, st: LoopState, decision: Decision) -> LoopState:
        """Propose, verify and commit (`speculate.speculative_step`)."""
        return speculative_step(self, params, st, decision)
