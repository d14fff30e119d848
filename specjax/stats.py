"""Generation statistics, named once: per row and in total.

- acceptance_rate α = accepted draft tokens / drafted positions (for a chain, k per
  step; for a tree, its depth per step: α is per speculated position).
- mean_accepted_length τ = tokens emitted per target forward in decoding, bonus included.
- expected_speedup: Leviathan et al.'s E[tokens per step] / (n c + v), with α per draft
  position (`expected_tokens`: E = 1 + Σ_d Π_{i<=d} α_i, whose products are the measured
  fractions of steps accepting at least d drafts, so E = 1 + accepted per target call),
  n the draft calls per target call (k for a chain draft, 1 for Medusa's heads), c one
  draft call's cost relative to a target step, and the verify forward's cost v relative to
  a one-token step (the mean over the decode forwards of `VerifyCost`'s v(T), see
  `VERIFY_COST`; the paper's v = 1 is `expected_speedup_free_verify`). Print it beside
  the measured speedup (which needs an autoregressive run of the same prompts).
  In total over a batch, the same model for the batch as it ran (`batch_speedup`):
  plain decoding's steps over the modelled cost of the longest-running row, since the
  loop waits for its last row; per row (`rows`), the row's own figure.
- expected_speedup_iid: the paper's closed form (1 - α^(k+1)) / ((1 - α)(n c + v)) with
  one α for every position. Acceptance is rarely i.i.d. (a draft that gets depth 1 right
  tends to get depth 2 right too), so at k > 1 it undercounts what the loop can reach.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from flax import struct


def _interpolate(t, ts, vs):
    """vs at t, linear between the points (ts rising) and along the last segment past
    them (a forward past the table keeps its last per-token cost)."""
    import jax.numpy as jnp

    last = (vs[-1] - vs[-2]) / (ts[-1] - ts[-2])
    return jnp.where(t > ts[-1], vs[-1] + (t - ts[-1]) * last, jnp.interp(t, ts, vs))


@struct.dataclass
class VerifyCost:
    """The cost of a target forward over T inputs relative to a one-token step:
        v(T) = max(1 + jump · [T > 1] + slope · log2(T), per_token · T).

    Leviathan et al. assume verification is free (v = 1), which holds while the forward
    is memory-bound (GPU/TPU decode at small T). On XLA:CPU one token runs the weights
    through a memory-bound GEMV; two or more run a GEMM that repacks the weights every
    call, so the cost jumps at T = 2 and then grows slowly with T
    (`python -m specjax.bench.verify_cost` fits both numbers; table in docs/benchmarks.md).
    The jump is why a CPU either verifies deep drafts or none. Past a few dozen tokens
    the forward turns compute-bound and its cost grows linearly (per_token, about a
    prefill token's share of a decode step); a batch verifies rows × T tokens at once,
    so at batch > 1 that is where wide trees land (`relative`). A pytree, so the loop
    takes it as traced numbers (`generate(verify_cost=VerifyCost(...))`).

    measured: a [2, P] table (T, cost(T) / cost(1)) that replaces the formula, linear
    between its points and past the last one (`from_table`): the formula's three
    numbers missed the measured CPU curve by up to a third around T = 33, which is
    where Medusa's 27-node tree verifies.

    branch: what the speculative loop's verify forward costs on top, relative: it runs
    inside a `lax.switch` over widths (XLA:CPU 1.08x a bare step, `python -m
    specjax.bench.branching`, "cond, KV outside"), while a step that drafts nothing
    runs bare in the plain-step loop (`speculative`).

    rows, by_rows: tables measured at larger batches ([A] batch sizes > 1, rising;
    [A, P] cost(T) / cost(1) at each, on `measured`'s T grid; `from_table(by_rows=)`).
    A batch-1 table scaled by rows × T (`relative`) overpriced verification at batch 16
    on XLA:CPU 1.2–4x, because 16 rows at T = 1 already run a GEMM (docs/benchmarks.md).
    """

    jump: Any = 0.0
    slope: Any = 0.0
    per_token: Any = 0.0
    branch: Any = 0.0
    measured: Any = None
    rows: Any = None
    by_rows: Any = None

    @classmethod
    def from_table(cls, ratios: dict, branch: float = 0.0,
                   by_rows: dict | None = None) -> "VerifyCost":
        """From measured {T: cost(T) / cost(1)} at batch 1 (`python -m
        specjax.bench.verify_cost`), and optionally {batch: {T: ratio}} measured at larger
        batches (`--batch N`) over the same T."""
        ts = sorted(ratios)
        rows = table = None
        if by_rows:
            rows = sorted(by_rows)
            for b in rows:
                if sorted(by_rows[b]) != ts:
                    raise ValueError(f"by_rows[{b}] measures T = {sorted(by_rows[b])}; "
                                     f"the batch-1 table measures T = {ts}")
            table = np.asarray([[by_rows[b][t] for t in ts] for b in rows], np.float64)
            rows = np.asarray(rows, np.float64)
        return cls(branch=branch, measured=np.asarray([ts, [ratios[t] for t in ts]],
                                                      np.float64), rows=rows, by_rows=table)

    def __call__(self, tokens):
        """v at `tokens` inputs in one forward at batch 1 (numpy or jax arrays, or a
        float >= 1)."""
        import jax.numpy as jnp

        t = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
        if self.measured is not None:
            return _interpolate(t, jnp.asarray(self.measured[0]), jnp.asarray(self.measured[1]))
        return jnp.maximum(1.0 + self.jump * (t > 1.0) + self.slope * jnp.log2(t),
                           self.per_token * t)

    def relative(self, tokens_per_row, rows):
        """Cost of a forward verifying `tokens_per_row` for each of `rows` rows, relative
        to the plain decode step of those rows: v(rows · T) / v(rows) (batch 1: v(T)).

        With tables at larger batches (`by_rows`; batch 1 is `measured`): at a measured
        batch, its own ratio; between two, their ratios at T blended linearly in
        log2(rows); past the largest, b, that table scaled as above:
        v_b(rows/b · T) / v_b(rows/b). rows: a scalar (the loop's static batch)."""
        import jax.numpy as jnp

        rows = jnp.maximum(jnp.asarray(rows, jnp.float32), 1.0)
        t = jnp.asarray(tokens_per_row, jnp.float32)
        if self.by_rows is None:
            return self(rows * t) / self(rows)
        if rows.ndim:
            raise ValueError(f"rows has shape {rows.shape}; one batch size (a scalar) "
                             "is what picks the measured tables")
        anchors = jnp.concatenate([jnp.ones((1,), jnp.float32),
                                   jnp.asarray(self.rows, jnp.float32)])  # [A+1]
        tables = jnp.concatenate([jnp.asarray(self.measured[1], jnp.float32)[None],
                                  jnp.asarray(self.by_rows, jnp.float32)])  # [A+1, P]
        ts = jnp.asarray(self.measured[0], jnp.float32)
        t = jnp.maximum(t, 1.0)
        i = jnp.sum(anchors <= rows) - 1  # the largest measured batch <= rows
        j = jnp.minimum(i + 1, anchors.shape[0] - 1)
        w = jnp.log2(rows / anchors[i]) / jnp.maximum(jnp.log2(anchors[j] / anchors[i]), 1e-9)
        between = ((1.0 - w) * _interpolate(t, ts, tables[i])
                   + w * _interpolate(t, ts, tables[j]))
        scale = rows / anchors[i]
        past = _interpolate(scale * t, ts, tables[i]) / _interpolate(scale, ts, tables[i])
        return jnp.where(i == j, past, between)

    def speculative(self, tokens_per_row, rows):
        """`relative` for a forward the speculative step runs (inside its verify
        switch): times 1 + branch."""
        return self.relative(tokens_per_row, rows) * (1.0 + self.branch)

    def describe(self) -> str:
        log = f"1 + {float(self.jump):.3g}·[T > 1] + {float(self.slope):.3g}·log2 T"
        out = f"v(T) = {log}"
        if self.measured is not None:
            points = ", ".join(f"{int(t)}: {float(v):.2f}" for t, v in
                               zip(*np.asarray(self.measured)))
            out = f"v(T) interpolated from measured {{T: v}} = {{{points}}}"
            if self.by_rows is not None:
                for r, vs in zip(np.asarray(self.rows), np.asarray(self.by_rows)):
                    points = ", ".join(f"{int(t)}: {float(v):.2f}" for t, v in
                                       zip(np.asarray(self.measured)[0], vs))
                    out += f"; at batch {int(r)} {{{points}}}"
        elif float(self.per_token) > 0:
            out = f"v(T) = max({log}, {float(self.per_token):.3g}·T)"
        if float(self.branch) > 0:
            out += f", × {1 + float(self.branch):.3g} in the verify switch"
        return out

    def validated(self) -> "VerifyCost":
        """Host-side check, naming the bad value; returns float32 leaves."""
        for name in ("jump", "slope", "per_token", "branch"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float, np.floating, np.integer)) and np.isfinite(x)
                    and x >= 0):
                raise ValueError(f"VerifyCost {name}={x!r} must be a finite number >= 0")
        table = None
        if self.measured is not None:
            table = np.asarray(self.measured, np.float64)
            if (table.ndim != 2 or table.shape[0] != 2 or table.shape[1] < 2
                    or table[0, 0] != 1 or table[1, 0] != 1 or np.any(np.diff(table[0]) <= 0)
                    or not np.all(np.isfinite(table)) or np.any(table[1] <= 0)):
                raise ValueError(
                    f"VerifyCost measured={self.measured!r} must be [2, P >= 2] rows (T, "
                    "cost) with T rising from 1, cost(1) = 1 and every cost finite and > 0")
            table = table.astype(np.float32)
        rows, by_rows = self._validated_rows(table)
        return VerifyCost(np.float32(self.jump), np.float32(self.slope),
                          np.float32(self.per_token), np.float32(self.branch), table,
                          rows, by_rows)

    def _validated_rows(self, table):
        """(rows, by_rows) as float32, checked against the batch-1 `table`."""
        if self.rows is None and self.by_rows is None:
            return None, None
        rows = np.asarray(self.rows, np.float64)
        by_rows = np.asarray(self.by_rows, np.float64)
        if (table is None or rows.ndim != 1 or rows.size == 0 or np.any(rows <= 1)
                or np.any(rows != np.round(rows)) or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"VerifyCost rows={self.rows!r} must be batch sizes > 1, "
                             "rising, beside a measured batch-1 table")
        if (by_rows.shape != (rows.size, table.shape[1]) or not np.all(np.isfinite(by_rows))
                or np.any(by_rows <= 0) or np.any(by_rows[:, 0] != 1)):
            raise ValueError(
                f"VerifyCost by_rows={self.by_rows!r} must be [{rows.size}, {table.shape[1]}]"
                " costs (one row per batch size, on measured's T), each finite and > 0, 1 "
                "at T = 1")
        return rows.astype(np.float32), by_rows.astype(np.float32)


# Per backend. CPU: the ratios `python -m specjax.bench.verify_cost` measured on
# SmolLM2-135M-Instruct's shapes at batch 1, 4 and 16 (`--batch`), compiled as generate
# compiles; branch from `python -m specjax.bench.branching` (docs/benchmarks.md).
# GPU/TPU: not measured yet; set to the memory-bound regime (what the Pallas kernels aim
# for: a 64-node verify at <= 1.3x one token).
VERIFY_COST = {"cpu": VerifyCost.from_table(
                   {1: 1.0, 2: 1.16, 3: 1.19, 5: 1.28, 9: 1.54, 17: 2.04, 33: 2.65, 65: 4.60,
                    129: 7.64},
                   branch=0.08,
                   by_rows={4: {1: 1.0, 2: 1.11, 3: 1.22, 5: 1.37, 9: 1.82, 17: 2.65,
                                33: 3.60, 65: 6.54, 129: 12.02},
                            16: {1: 1.0, 2: 1.15, 3: 1.31, 5: 1.61, 9: 2.07, 17: 3.29,
                                 33: 5.11, 65: 9.60, 129: 17.99}}),
               "gpu": VerifyCost(slope=0.05),
               "tpu": VerifyCost(slope=0.05)}


def default_verify_cost() -> VerifyCost:
    import jax

    return VERIFY_COST.get(jax.default_backend(), VERIFY_COST["gpu"])


def leviathan_speedup(alpha: float, k: float, cost_ratio: float,
                      verify_cost: float = 1.0, draft_calls: float | None = None) -> float:
    """Expected walltime improvement of speculative decoding (Leviathan et al. 2023, Thm 3.8):
    E[tokens per step] / (n c + v), with c one draft call's cost and n the draft calls
    per step (default k: a chain draft, one call per position; Medusa makes one call
    whatever k), v the verify forward's cost relative to one target step (1 in the
    paper)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        tokens = k + 1
    else:
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens_per_cost(tokens, k, cost_ratio, verify_cost, draft_calls)


def tokens_per_cost(tokens: float, k: float, cost_ratio: float,
                    verify_cost: float = 1.0, draft_calls: float | None = None) -> float:
    """Expected speedup from E[tokens per target call] (α per position), k drafted
    positions per call, n draft calls per target call (default k), one call's cost
    ratio c and the verify cost: E / (n c + v)."""
    if k <= 0:
        return 1.0
    n = k if draft_calls is None else draft_calls
    return float(tokens / (n * cost_ratio + verify_cost))


def expected_tokens(alpha):
    """E[tokens per step] when drafting k = 0..D positions: [..., D + 1].

    alpha: [..., D] acceptance per draft position, α_d = P(accept depth d | depth d-1
    accepted), giving E(k) = 1 + Σ_{d<=k} Π_{i<=d} α_i. A constant α is Leviathan et
    al.'s i.i.d. model, (1 - α^(k+1)) / (1 - α). Per position is what drafts do:
    acceptance is often all-or-nothing (a draft that gets the first token right tends
    to get the next ones right too), which one α undercounts for deep drafts.
    """
    import jax.numpy as jnp

    a = jnp.clip(jnp.asarray(alpha, jnp.float32), 0.0, 1.0)
    reach = jnp.cumprod(a, axis=-1)  # P(depth d accepted)
    zero = jnp.zeros(a.shape[:-1] + (1,), jnp.float32)
    return 1.0 + jnp.concatenate([zero, jnp.cumsum(reach, axis=-1)], axis=-1)


def accepted_at_least(hist):
    """Steps that accepted at least d drafts, d = 1..Dm, from hist [..., Dm+1] (steps
    that accepted exactly j): numpy or jax, for the rule and for the host's stats."""
    return hist[..., ::-1].cumsum(axis=-1)[..., ::-1][..., 1:]


def position_acceptance(hist, tried, prior: tuple[float, float] = (3.0, 4.0), mean=None):
    """Running acceptance per draft position, α_d = P(accept depth d | depth d-1
    accepted), from the loop's counters: hist [B, Dm+1] (steps that accepted j drafts)
    and tried [B, Dm] (steps that verified depth d with depth d-1 accepted).

    Shrinkage towards a prior of `prior[1]` tries: at depth 1, `prior[0]` accepts in
    them (0.75) until a row has data; at depth d > 1, the row's own α_{d-1}. Depth d is
    tried only after depth d-1 was accepted, so a draft rejected at depth 1 leaves the
    deeper estimates without data: with a fixed prior there they stayed at 0.75 and kept
    a row drafting k = 8 until α_1 alone fell below about 0.3 (six wasted 9-token
    verifies per row for n-gram at T = 1); chained, they fall with α_1.

    mean: [Dm] prior acceptance per depth that replaces those defaults where it is not
    NaN (a calibration run's `GenerationStats.acceptance_by_position`), still over
    `prior[1]` pseudo-tries."""
    import jax.numpy as jnp

    at_least = accepted_at_least(jnp.asarray(hist))  # [B, Dm]
    pseudo, n0 = prior  # pseudo-accepts in n0 pseudo-tries
    out = []
    for d in range(at_least.shape[1]):  # static Dm: a short loop over depths
        if mean is not None:
            pseudo = jnp.where(jnp.isnan(mean[d]), pseudo, n0 * mean[d])
        out.append((at_least[:, d] + pseudo) / (tried[:, d] + n0))
        pseudo = n0 * out[-1]
    return jnp.stack(out, axis=1) if out else jnp.asarray(at_least, jnp.float32)


def leviathan_optimal_k(alpha, cost_ratio: float, k_max: int, verify_cost=None,
                        draft_calls=None):
    """argmax_k over 0..k_max of E[tokens](k) / (n_k c + v_k), per row (numpy or jax).

    alpha: [B] one rate per row, or [B, k_max] per position (`expected_tokens`);
    verify_cost: [k_max+1] cost of the verify forward for each k (default 1: free);
    draft_calls: [k_max+1] draft calls n_k that drafting k positions takes (default k,
    a chain draft; Medusa's heads are one call whatever k)."""
    import jax.numpy as jnp

    a = jnp.asarray(alpha, jnp.float32)
    if a.ndim == 1:
        a = jnp.repeat(a[:, None], k_max, axis=1)
    ks = jnp.arange(k_max + 1, dtype=jnp.float32)  # [K+1]
    v = jnp.ones_like(ks) if verify_cost is None else jnp.asarray(verify_cost, jnp.float32)
    n = ks if draft_calls is None else jnp.asarray(draft_calls, jnp.float32)
    gain = expected_tokens(a[:, :k_max]) / (n * cost_ratio + v)  # cost_ratio may be traced
    return jnp.argmax(gain, axis=-1).astype(jnp.int32)


def batch_verify_bucket(alpha, drafted_depth, active, bucket_depths: Sequence[int],
                        bucket_cost):
    """Which verify width the whole batch should run, once every row has drafted.

    The target forward is one batched call whose width is set by the deepest node
    verified in any row, so a row that drafts deep makes every row pay for that width.
    Per-row rules (`leviathan_optimal_k`) cannot see this: at batch 8 one row with an
    n-gram match made the other seven verify 5 tokens for nothing. After drafting, the
    draft cost is spent; what is left is the batch's expected tokens per unit of verify
    cost,
        score(b) = sum_r E_r[tokens | depth <= min(D_b, drafted_r)] / v_b
    (`expected_tokens`; for a tree, a lower bound). This mirrors vLLM/SGLang turning
    speculation off as the batch grows, but per step and from measured acceptance.

    alpha: [B] per-row acceptance, or [B, Dm] per position (Dm >= the deepest bucket);
    drafted_depth: [B] deepest valid node per row; active: [B] bool; bucket_depths:
    [NB] static depths D_b, rising; bucket_cost: [NB] the verify forward's cost at each
    bucket (one-token step = 1). Returns the bucket index (int32 scalar); ties go to
    the cheaper bucket.
    """
    import jax.numpy as jnp

    a = jnp.asarray(alpha, jnp.float32)
    if a.ndim == 1:
        a = jnp.repeat(a[:, None], max(bucket_depths), axis=1)
    e = expected_tokens(a)  # [B, Dm+1]
    d = jnp.asarray(bucket_depths, jnp.int32)[None, :]  # [1, NB]
    reach = jnp.minimum(drafted_depth.astype(jnp.int32)[:, None], d)  # [B, NB]
    tokens = jnp.take_along_axis(e, reach, axis=1)
    total = jnp.sum(jnp.where(active[:, None], tokens, 0.0), axis=0)
    return jnp.argmax(total / jnp.asarray(bucket_cost, jnp.float32)).astype(jnp.int32)


@dataclasses.dataclass
class GenerationStats:
    """Totals as attributes; `rows` holds the same fields per row."""

    new_tokens: int
    target_calls: int
    draft_calls: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    mean_k: float
    cost_ratio: float
    expected_speedup: float
    expected_speedup_free_verify: float
    expected_speedup_iid: float
    mean_verified: float  # target inputs per decode forward (1 = a plain step)
    verify_cost: float  # v: that forward's modelled cost relative to a one-token step
    wall_s: float
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    compile_s: float
    accepted_hist: list  # counts of steps that accepted 0, 1, ..., Dm drafts (all rows)
    rows: list = dataclasses.field(default_factory=list)
    # steps that verified depth d = 1..Dm with depth d - 1 accepted (all rows)
    tried_hist: list = dataclasses.field(default_factory=list)
    # The batch as it ran (`batch_speedup`): steps plain decoding's loop would take (the
    # longest row's decode tokens) and the modelled cost of this loop (the longest-running
    # row's forwards and draft calls), in one-token target steps, summed over calls
    batch_plain_steps: float = 0.0
    batch_cost: float = 0.0

    @property
    def acceptance_by_position(self) -> list:
        """α_d = P(accept depth d | depth d - 1 accepted) for d = 1..Dm over all rows
        (None where depth d was never tried): what `generate(acceptance_prior=)` takes."""
        at_least = accepted_at_least(np.asarray(self.accepted_hist, np.float64))
        return [float(a / t) if t else None for a, t in zip(at_least, self.tried_hist)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"tokens={self.new_tokens} α={self.acceptance_rate:.3f} "
                f"τ={self.mean_accepted_length:.2f} tok/s={self.tokens_per_s:.1f} "
                f"TTFT={self.ttft_s * 1e3:.1f}ms TPOT={self.tpot_s * 1e3:.2f}ms "
                f"expected_speedup={self.expected_speedup:.2f}")


def batch_speedup(decode_tokens, verify_cost, draft_calls, cost_ratio) -> tuple[float, float]:
    """(plain steps, modelled cost) of one batch, in one-token target steps of the batch.

    A batch's loop runs until its last row finishes, every step as wide as its widest
    row, so it costs what its longest-running row accumulated (rows are active on a
    prefix of the steps); plain decoding of the same rows takes as many steps as the
    longest row has decode tokens. Their ratio is the analytical speedup of the batch:
    at batch 1 Leviathan's figure, at batch > 1 it also counts the rows that finish
    early and wait (docs/benchmarks.md, batch 4: the draft model's mean-row figure was
    2.61x against a measured decode speedup of 1.48x; this one is 1.48x)."""
    cost = np.asarray(verify_cost, np.float64) + np.asarray(draft_calls) * cost_ratio
    return float(np.max(decode_tokens, initial=0)), float(np.max(cost, initial=0.0))


def build_stats(*, new_tokens, target_calls, draft_calls, drafted, accepted, hist,
                cost_ratio, ttft_s, decode_s, compile_s, verified=None,
                verify_cost=None, batch=None, tried=None) -> GenerationStats:
    """From per-row numpy counters (decode phase) and timings. verify_cost: per row, the
    summed modelled cost of its decode forwards (`VerifyCost`; None: 1 per forward).
    batch: (plain steps, modelled cost) when the rows are several batches
    (`merge_stats`); else they are one (`batch_speedup`). tried: [B, Dm] per row, or
    [Dm] summed (`LoopState.tried`)."""
    new_tokens = np.asarray(new_tokens)
    if verified is None:
        verified = np.asarray(target_calls)
    if verify_cost is None:
        verify_cost = np.asarray(target_calls, np.float64)
    rows = []
    for b in range(len(new_tokens)):
        rows.append(_row(int(new_tokens[b]), int(target_calls[b]), int(draft_calls[b]),
                         int(drafted[b]), int(accepted[b]), int(verified[b]), cost_ratio,
                         float(verify_cost[b]), ttft_s, decode_s))
    total = _row(int(new_tokens.sum()), int(np.sum(target_calls)), int(np.sum(draft_calls)),
                 int(np.sum(drafted)), int(np.sum(accepted)), int(np.sum(verified)),
                 cost_ratio, float(np.sum(verify_cost)), ttft_s, decode_s,
                 decode_tokens=int(np.maximum(new_tokens - 1, 0).sum()))
    if batch is None:
        batch = batch_speedup(np.maximum(new_tokens - 1, 0), verify_cost, draft_calls,
                              cost_ratio)
    total["batch_plain_steps"], total["batch_cost"] = batch
    if total["target_calls"] and batch[1] > 0:  # else no decode step: 1.0 from _row
        total["expected_speedup"] = batch[0] / batch[1]
    wall = ttft_s + decode_s
    total["tokens_per_s"] = float(new_tokens.sum() / wall) if wall > 0 else 0.0
    total["tpot_s"] = float(np.mean([r["tpot_s"] for r in rows])) if rows else 0.0
    tried = np.zeros(np.shape(hist)[-1] - 1) if tried is None else np.asarray(tried)
    return GenerationStats(**total, compile_s=compile_s,
                           accepted_hist=[int(x) for x in np.asarray(hist).sum(0)], rows=rows,
                           tried_hist=[int(x) for x in
                                       tried.sum(axis=tuple(range(tried.ndim - 1)))])


def _padded_sum(lists) -> np.ndarray:
    out = np.zeros(max(len(x) for x in lists), np.int64)
    for x in lists:
        out[:len(x)] += np.asarray(x, np.int64)
    return out


def merge_stats(parts: Sequence[GenerationStats]) -> GenerationStats:
    """One `GenerationStats` for `generate` calls run one after another (a prompt set in
    batches): counters and wall times add up, so α, τ and tokens/s are over all of them;
    `ttft_s` is the mean per call, `tpot_s` the mean per row; per-row entries are kept."""
    if not parts:
        raise ValueError("merge_stats needs at least one GenerationStats")
    rows = [r for p in parts for r in p.rows]
    field = lambda name: [r[name] for r in rows]
    hist = _padded_sum([p.accepted_hist for p in parts])
    ttft = sum(p.ttft_s for p in parts)
    merged = build_stats(
        new_tokens=field("new_tokens"), target_calls=field("target_calls"),
        draft_calls=field("draft_calls"), drafted=field("drafted"), accepted=field("accepted"),
        hist=hist[None], cost_ratio=parts[0].cost_ratio, ttft_s=ttft,
        decode_s=sum(p.wall_s for p in parts) - ttft,
        compile_s=sum(p.compile_s for p in parts),
        verified=[round(r["mean_verified"] * r["target_calls"]) for r in rows],
        verify_cost=[r["verify_cost"] * r["target_calls"] for r in rows],
        batch=(sum(p.batch_plain_steps for p in parts), sum(p.batch_cost for p in parts)),
        tried=_padded_sum([p.tried_hist for p in parts]))
    return dataclasses.replace(merged, ttft_s=ttft / len(parts), rows=rows,
                               tpot_s=float(np.mean(field("tpot_s"))) if rows else 0.0)


def _row(new, calls, dcalls, drafted, accepted, verified, c, vsum, ttft_s, decode_s,
         decode_tokens: int | None = None) -> dict:
    alpha = accepted / drafted if drafted else 0.0
    if decode_tokens is None:
        decode_tokens = max(new - 1, 0)  # the first token comes from prefill
    tau = decode_tokens / calls if calls else 0.0
    k = drafted / calls if calls else 0.0
    n = dcalls / calls if calls else 0.0  # draft calls per target call
    reach = 1.0 + accepted / calls if calls else 1.0  # E[tokens] from α per position
    mean_verified = verified / calls if calls else 1.0
    v = vsum / calls if calls else 1.0  # mean modelled cost of one decode forward
    wall = ttft_s + decode_s
    return dict(new_tokens=new, target_calls=calls, draft_calls=dcalls, drafted=drafted,
                accepted=accepted, acceptance_rate=alpha, mean_accepted_length=tau, mean_k=k,
                cost_ratio=c, expected_speedup=tokens_per_cost(reach, k, c, v, n),
                expected_speedup_free_verify=tokens_per_cost(reach, k, c, 1.0, n),
                expected_speedup_iid=leviathan_speedup(alpha, k, c, v, n),
                mean_verified=mean_verified, verify_cost=v,
                wall_s=wall, ttft_s=ttft_s,
                tpot_s=decode_s / decode_tokens if decode_tokens else 0.0,
                tokens_per_s=new / wall if wall > 0 else 0.0)
