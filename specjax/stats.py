"""Generation statistics, named once: per row and in total. Host-only (numpy); the
on-device policy that reads the loop's counters is `specjax.decoding.policy`.

- acceptance_rate α = accepted draft tokens / drafted positions (for a chain, k per
  step; for a tree, its depth per step: α is per speculated position).
- mean_accepted_length τ = tokens emitted per target forward in decoding, bonus included.
- expected_speedup: Leviathan et al.'s E[tokens per step] / (n c + v), with α per draft
  position (`specjax.decoding.policy.expected_tokens`: E = 1 + Σ_d Π_{i<=d} α_i, whose
  products are the measured fractions of steps accepting at least d drafts, so E = 1 +
  accepted per target call), n the draft calls per target call (k for a chain draft, 1
  for Medusa's heads), c one draft call's cost relative to a target step, and the verify
  forward's cost v relative to a one-token step (the mean over the decode forwards of
  `VerifyCost`'s v(T), `specjax.decoding.cost`; the paper's v = 1 is
  `expected_speedup_free_verify`). Print it beside the measured speedup (which needs an
  autoregressive run of the same prompts).
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


def accepted_at_least(hist):
    """Steps that accepted at least d drafts, d = 1..Dm, from hist [..., Dm+1] (steps
    that accepted exactly j): numpy or jax, for the rule and for the host's stats."""
    return hist[..., ::-1].cumsum(axis=-1)[..., ::-1][..., 1:]


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
    # generate calls that ran the speculative loop; 0: plain decoding's programs ran
    # (no speculator, or the rule could never draft: `policy.may_draft`)
    speculative_calls: int = 0
    # speculative steps that asked a row for a draft, and those where the speculator
    # proposed one (all rows; `proposal_rate`)
    asked: int = 0
    proposed: int = 0

    @property
    def proposal_rate(self) -> float | None:
        """P(the speculator proposes at least one token | a row asked it to draft), over
        all rows (None where no row was asked): what `generate(proposal_prior=)` takes."""
        return self.proposed / self.asked if self.asked else None

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
    early and wait (docs/benchmarks.md compares both with measured speedups)."""
    cost = np.asarray(verify_cost, np.float64) + np.asarray(draft_calls) * cost_ratio
    return float(np.max(decode_tokens, initial=0)), float(np.max(cost, initial=0.0))


def build_stats(*, new_tokens, target_calls, draft_calls, drafted, accepted, hist,
                cost_ratio, ttft_s, decode_s, compile_s, verified=None,
                verify_cost=None, batch=None, tried=None,
                speculative_calls: int = 0, asked=0, proposed=0) -> GenerationStats:
    """From per-row numpy counters (decode phase) and timings. verify_cost: per row, the
    summed modelled cost of its decode forwards (`VerifyCost`; None: 1 per forward).
    batch: (plain steps, modelled cost) when the rows are several batches
    (`merge_stats`); else they are one (`batch_speedup`). tried: [B, Dm] per row, or
    [Dm] summed (`Counters.tried`). speculative_calls: how many of the calls ran the
    speculative loop. asked, proposed: per row or summed (`Counters.asked`, `.proposed`)."""
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
    return GenerationStats(**total, compile_s=compile_s, speculative_calls=speculative_calls,
                           asked=int(np.sum(asked)), proposed=int(np.sum(proposed)),
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
        tried=_padded_sum([p.tried_hist for p in parts]),
        speculative_calls=sum(p.speculative_calls for p in parts),
        asked=sum(p.asked for p in parts), proposed=sum(p.proposed for p in parts))
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


def loop_kind(speculative_calls: int, calls: int) -> str:
    """Which loop a method's `generate` calls ran: "plain" (plain decoding's programs, the
    rule having seen that drafting could never pay, `policy.may_draft`), "speculative",
    or "s/n speculative" where only s of the n calls did."""
    if speculative_calls == 0:
        return "plain"
    if speculative_calls == calls:
        return "speculative"
    return f"{speculative_calls}/{calls} speculative"


def untimed_methods(speculators: dict[str, Any], calls: dict[str, tuple[int, int]]) -> list[str]:
    """The methods after the first (the autoregressive baseline) whose warm-up ran plain
    decoding's programs in every call. `policy.may_draft` reads the prompts' shapes and
    the rule, not their tokens, so they run those programs in every call: timing them
    would time the baseline's programs again (noise read as a loss or a gain), so
    comparisons run them once for their tokens and report the baseline's rounds.
    calls: {name: (speculative_calls, calls)} of each method's warm-up."""
    return [name for name in list(speculators)[1:] if speculators[name] is not None
            and loop_kind(*calls[name]) == "plain"]
