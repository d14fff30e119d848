"""What verifying T tokens costs over a one-token step, measured on a config's shapes
and fitted: the table `specjax.decoding.cost.VerifyCost.from_table` takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rows_matmul
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.decoding.policy import attended_tokens
from specjax.model import init_model, step_kv
from specjax.timing import interleaved_medians
from specjax.tree import ancestor_mask, chain
from specjax.xla_options import compile_decode

# XLA:CPU without its YNNPACK fusions: timed beside generate's options (the option
# generate compiled with until measured on a real checkpoint; `specjax.xla_options`)
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def measure_verify_cost(tokens: list[int], batch: int, repeats: int, context: int = 128, *,
                        config: ModelConfig, far: int | None = None) -> dict:
    """What a verify forward of T tokens costs relative to a one-token step after
    `context` cached tokens, on `config`'s shapes (random weights): median seconds per
    step at each T, their ratios, and the fitted jump, slope (`fit_verify_cost`) and
    per_token (`fit_per_token`). Each forward runs as the speculative loop's verify does
    on CPU: the pages untouched, the new tokens' keys/values beside them (`step_kv(
    write_in_layers=False)`); a write here would copy the whole pool, since nothing
    donates it as the loop's carry does.

    Each T is compiled twice: with the options `generate` compiles with
    (`specjax.xla_options`, the figures the fit uses) and without YNNPACK fusions
    (`NO_YNN`), so one run shows what that option would change. With `far`, each T is
    also timed after `far` cached tokens (generate's options), interleaved with the rest:
    `far_seconds`, and `far` = those seconds over T = 1's at `context`
    (`VerifyCost.from_table(contexts=, far=)`). `attended`: the cached tokens each
    context's attention reads (`policy.attended_tokens`: the context itself where the
    CPU attention kernel runs, else the page table), so what `contexts=` takes."""
    model = init_model(config, seed=0)
    params = model.decode_params()  # the layout `generate` decodes with
    page = 16
    contexts = (context,) if far is None else (context, far)
    fns, attended = {}, []
    for c in contexts:
        pages = -(-(c + max(tokens)) // page)
        attended.append(int(attended_tokens(None, pages * page, [c])))
        table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
        cache = PagedKVCache.create(config, table, num_pages=batch * pages, page_size=page,
                                    lengths=jnp.full((batch,), c, jnp.int32))
        for t in tokens:
            ids = jnp.asarray(np.random.default_rng(t).integers(0, config.vocab_size,
                                                                 (batch, t)))
            pos = c + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
            mask = None if t == 1 else ancestor_mask(chain(ids[:, 1:]).parents, t - 1)
            args = (params, cache, ids, pos, mask)
            with rows_matmul.any_rows():  # as generate's decode loop traces a verify
                lowered = jax.jit(lambda p, kv, i, q, m: step_kv(
                    config, p, kv, i, q, mask=m, write_in_layers=False)[0]).lower(*args)
            variants = (("generate", compile_decode(lowered)),)
            if c == context:
                variants += (("no_ynn", lowered.compile(compiler_options=NO_YNN)),)
            for variant, fn in variants:
                fn(*args).block_until_ready()  # first run
                fns[variant if c == context else "far", t] = (fn, args)
    med = interleaved_medians(fns, repeats)
    out = dict(params=model.num_params(), attended=tuple(attended),
               name=f"{config.model_type}, {config.num_layers} layers x {config.hidden_size}")
    for variant, suffix in (("generate", ""), ("no_ynn", "_no_ynn")):
        sec = {t: med[variant, t] for t in tokens}
        out["seconds" + suffix] = sec
        out["ratio" + suffix] = {t: sec[t] / sec[tokens[0]] for t in tokens}
    if far is not None:
        out["far_seconds"] = {t: med["far", t] for t in tokens}
        out["far"] = {t: med["far", t] / med["generate", tokens[0]] for t in tokens}
    small = {t: r for t, r in out["ratio"].items() if t < LINEAR_FROM}
    out["jump"], out["slope"] = fit_verify_cost(small)
    out["per_token"] = fit_per_token(out["ratio"])
    return out


# From this many tokens on, the forward is compute-bound: cost grows linearly in T.
LINEAR_FROM = 33


def fit_per_token(ratio: dict[int, float]) -> float:
    """per_token of cost(T)/cost(1) ≈ per_token·T over the measured T >= LINEAR_FROM
    (least squares through the origin); 0 when none was measured."""
    ts = np.asarray([t for t in ratio if t >= LINEAR_FROM], np.float64)
    if not len(ts):
        return 0.0
    y = np.asarray([ratio[int(t)] for t in ts], np.float64)
    return float(ts @ y / (ts @ ts))


def fit_verify_cost(ratio: dict[int, float]) -> tuple[float, float]:
    """(jump, slope) of cost(T)/cost(1) = 1 + jump + slope·log2(T) for T > 1, by least
    squares over the measured T > 1, both kept >= 0 (`specjax.decoding.cost.VerifyCost`)."""
    ts = [t for t in ratio if t > 1]
    if not ts:
        return 0.0, 0.0
    x = np.log2(np.asarray(ts, np.float64))
    y = np.asarray([ratio[t] - 1 for t in ts], np.float64)
    if len(ts) > 1:
        jump, slope = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
        if jump >= 0 and slope >= 0:
            return float(jump), float(slope)
        if slope < 0:  # flat or falling: a pure jump
            return max(float(y.mean()), 0.0), 0.0
    return 0.0, max(float(x @ y / (x @ x)), 0.0)  # one point, or no jump: slope alone
