"""c, a draft call's wall time over a target step's, measured as `generate` runs both:
what `generate(cost_ratio=)` takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rng, rows_matmul
from specjax.model import Model, step
from specjax.speculators.base import ProposeContext
from specjax.timing import interleaved_medians
from specjax.xla_options import compile_decode


def measured_cost_ratio(target: Model, speculator, *, context: int = 128,
                        repeats: int = 20, seed: int = 0, temperature: float = 0.0,
                        batch: int = 1) -> float:
    """c as Leviathan et al. define it, measured at one temperature (`draft_cost_ratios`)."""
    return draft_cost_ratios(target, speculator, (temperature,), context=context,
                             repeats=repeats, seed=seed, batch=batch)[temperature]


def draft_cost_ratios(target: Model, speculator, temperatures=(0.0,), *, context: int = 128,
                      repeats: int = 20, seed: int = 0, batch: int = 1) -> dict[float, float]:
    """{temperature: c}, c as Leviathan et al. define it, measured: the wall time of one
    draft call relative to one target decode step (T = 1), both over `batch` rows and as
    `generate` runs them (its layer layout and compiler options, timed interleaved). The
    ratio moves with the batch (a small draft's fixed work per call is spread over more
    rows, and the target step turns from a GEMV into a GEMM), so time it at the batch it
    will price.

    The draft side is the speculator's whole `propose` at full depth after a
    `context`-token prompt (the draft model's queue forward and chain, Medusa's heads,
    EAGLE's tree levels with their top-k and reranking), divided by the draft calls it
    makes there (`DraftCost.calls_per_step`). Parameter counts miss exactly that work
    around the matmuls, which on a CPU is a large share of a small draft's time. 0 for
    a speculator without draft calls (n-gram). The sampling settings are an argument of
    the one compiled propose, as in `generate` (temperature is traced there): each
    temperature times the code it runs (sampling costs a draft more than argmax) with
    no second compile, from one greedy prefill (a propose's work has fixed shapes, so
    the prompt's sampled first token would not change it)."""
    from specjax.decoding.state import LoopState
    from specjax.inspect import prefilled_state
    from specjax.sampling import Sampling

    calls = speculator.cost.calls_per_step
    if calls == 0:
        return {t: 0.0 for t in temperatures}
    cfg = target.config
    spec = speculator.for_decoding()
    params = target.decode_params()  # the layout generate uses
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, context).tolist()
    state, _ = prefilled_state(target, prompt, spec, params=params, batch=batch)

    def propose(p, sp, st: LoopState, sampling: Sampling):
        ctx = ProposeContext(st.tokens, st.lengths, ~st.done, sampling,
                             rng.step_keys(st.keys, st.lengths, rng.PROPOSE),
                             jnp.full_like(st.lengths, sp.shape.max_depth))
        return sp.propose(st.spec_state, ctx, p)[0].tokens

    def target_step(p, st: LoopState):
        root = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)
        return step(cfg, p, st.cache, root, (st.lengths - 1)[:, None])[0]

    with rows_matmul.any_rows():  # the products as generate's decode loop traces them
        draft = compile_decode(jax.jit(propose).lower(params, spec, state, Sampling.create()))
        fns = {"target": (compile_decode(jax.jit(target_step).lower(params, state)),
                          (params, state))}
    fns.update({t: (draft, (params, spec, state, Sampling.create(t))) for t in temperatures})
    for f, args in fns.values():
        jax.block_until_ready(f(*args))  # first run
    med = interleaved_medians(fns, repeats)  # every program beside the same machine load
    return {t: med[t] / calls / med["target"] for t in temperatures}


def measured_cost_ratios(target: Model, speculators: dict,
                         temperatures=(0.0,), batch: int = 1) -> dict:
    """{temperature: {method: c}} at `batch` rows for every speculator (None:
    autoregressive, skipped; `draft_cost_ratios`). Sampling costs the draft more than
    argmax does, and any T > 0 runs the same sampling code, so c is measured once greedy
    and once sampled, from one compiled propose per speculator."""
    sampled = [t for t in temperatures if t > 0][:1]  # every T > 0 takes this one's c
    timed = tuple([0.0] if 0 in temperatures else []) + tuple(sampled)
    per = {name: draft_cost_ratios(target, spec, timed, batch=batch)
           for name, spec in speculators.items() if spec is not None}
    return {t: {name: c[sampled[0] if t > 0 else 0.0] for name, c in per.items()}
            for t in temperatures}


def cost_ratio_of(cost_ratios: dict | None, temperature: float, name: str, default=None):
    """The measured c of method `name` at `temperature` from `measured_cost_ratios`'
    {T: {method: c}} (None or a missing entry: `default`)."""
    return (cost_ratios or {}).get(temperature, {}).get(name, default)
