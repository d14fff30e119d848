"""The adaptive policy: how deep each row drafts and how wide the batch verifies.

One call per step, `decide`, evaluates the rule (Leviathan et al.'s expected tokens per
unit of cost, per row and per draft position) and prices the verify buckets once; the
`Decision` then answers the step's questions (depth limits and probes, the verify width).
"""

from __future__ import annotations

import functools
import statistics
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.attention import reads_used_slots
from specjax.decoding.cost import VerifyCost
from specjax.decoding.state import Counters, LoopState, Probes
from specjax.speculators.base import Speculator
from specjax.stats import accepted_at_least

# A row the rule keeps at k = 0 drafts one token every PROBE_GAP steps to re-measure its
# acceptance, the gap doubling after each rejected probe up to PROBE_GAP_MAX
PROBE_GAP, PROBE_GAP_MAX = 16, 256
PROBE_LOOKAHEAD = 4  # accepted probes a probe's worth is judged over (`decide`)
# A row drafts only where the rule expects at least this much more tokens per unit of
# cost than plain decoding: its α and cost estimates carry a few percent of error, and
# a gain inside that error is as likely a loss (docs/speculators.md)
DRAFT_MARGIN = 0.05


@struct.dataclass
class Rule:
    """What the adaptive rule reads besides the loop's counters; traced, so one compiled
    program serves every value."""

    cost_ratio: jax.Array  # [] c: one draft call's cost in one-token target steps
    adaptive: jax.Array  # [] bool: False drafts full depth every step
    vcost: VerifyCost  # the verify forward's cost model
    # [Dm] float32 prior acceptance per depth (`generate(acceptance_prior=)`); NaN: the
    # default there (`position_acceptance`)
    prior: jax.Array
    # [] bool: each row decides as if it ran alone (verify costs at batch 1, no
    # batch-wide verify width), so a row's tokens do not depend on its batch
    per_row: jax.Array = np.bool_(False)
    # [Dm+1] or [] the speculative step's cost beyond its draft calls and verify forward
    # (tree building, the verifier, the commit), in one-token target steps, by draft
    # depth (entry 0: a step that verifies nothing); measured by
    # `specjax.calibrate.calibrations` (`generate(step_overhead=)`, `overhead_at`)
    overhead: jax.Array = np.float32(0.0)
    # [] the expected gain over plain decoding a depth k > 0 must show (`DRAFT_MARGIN`)
    margin: jax.Array = np.float32(DRAFT_MARGIN)
    # [] prior P(the speculator proposes | asked to draft) (`generate(proposal_prior=)`);
    # NaN: 1, a speculator that always proposes
    proposal: jax.Array = np.float32(np.nan)
    # [] what a step at k = 0 costs inside the speculative loop beyond a plain
    # decoding step (the speculator's commit and queue calls, the loop's control flow),
    # in one-token target steps; measured by `specjax.calibrate.idle_overhead`
    # (`generate(idle_overhead=)`). Probes must be worth it (`probe_value`)
    idle: jax.Array = np.float32(0.0)
    # [] steps a row at k = 0 waits before its first probe (`probe_schedule`)
    probe_gap: jax.Array = np.int32(PROBE_GAP)
    # [Dm] or [] the tries each `prior` α_d was measured from (`generate(prior_tries=)`);
    # NaN: unknown, the prior taken as exact. The choice of a call's programs reads the
    # prior at its lower confidence bound (`cautious_prior`)
    prior_tries: jax.Array = np.float32(np.nan)


def verify_buckets(widths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(depth, width) of the verify forwards compiled for a speculator's `depth_widths`:
    a plain step, depth 1 (probes, one-token n-gram matches), half and full depth; a
    forward's cost grows with its width, and four bound the compile time."""
    dm = len(widths) - 1
    out: list[tuple[int, int]] = []
    for d in sorted({0, min(1, dm), (dm + 1) // 2, dm}):
        if out and out[-1][1] == widths[d]:
            out[-1] = (d, widths[d])  # same forward: let it serve the deeper depth
        else:
            out.append((d, int(widths[d])))
    return tuple(out)


def bucket_per_depth(buckets) -> list[int]:
    """For k = 0..Dm: the bucket verified when the deepest kept node has depth k."""
    dm = buckets[-1][0]
    return [next(i for i, (d, _) in enumerate(buckets) if d >= k) for k in range(dm + 1)]


def probe_schedule(next_probe, gap, step, drafted, probed, accepted, base=PROBE_GAP):
    """The next probe step and gap per row [B] after loop step `step`: a rejected probe
    doubles the gap (up to PROBE_GAP_MAX, or `base` [] if longer), an accepted draft
    resets it to `base` (`Rule.probe_gap`), and a row that drafted (by choice or
    probing) waits at least a gap from this step, to the next step t with (t + 1) a
    multiple of its gap. The gaps are `base` times powers of two, so rows probe on a
    shared clock: at batch > 1 one speculative step serves every row due, not one step
    per row."""
    longest = jnp.maximum(PROBE_GAP_MAX, base)
    gap = jnp.where(accepted > 0, base,
                    jnp.where(probed, jnp.minimum(2 * gap, longest), gap))
    aligned = (step + 2 * gap) // gap * gap - 1  # the first t >= step + gap on the clock
    return jnp.where(drafted, aligned, next_probe), gap


def initial_probes(batch: int, gap=PROBE_GAP) -> Probes:
    """Every row's first probe at step gap - 1 (`Rule.probe_gap`)."""
    gap = jnp.asarray(gap, jnp.int32)
    return Probes(next_probe=jnp.full((batch,), gap - 1, jnp.int32),
                  probe_gap=jnp.full((batch,), gap, jnp.int32))


def expected_tokens(alpha):
    """E[tokens per step] when drafting k = 0..D positions: [..., D + 1].

    alpha: [..., D] acceptance per draft position, α_d = P(accept depth d | depth d-1
    accepted): E(k) = 1 + Σ_{d<=k} Π_{i<=d} α_i (a constant α is Leviathan et al.'s
    i.i.d. model). Per position because acceptance tends to be all-or-nothing.
    """
    a = jnp.clip(jnp.asarray(alpha, jnp.float32), 0.0, 1.0)
    reach = jnp.cumprod(a, axis=-1)  # P(depth d accepted)
    zero = jnp.zeros(a.shape[:-1] + (1,), jnp.float32)
    return 1.0 + jnp.concatenate([zero, jnp.cumsum(reach, axis=-1)], axis=-1)


PRIOR_TRIES = 4.0  # pseudo-tries the acceptance estimates are shrunk with

# Standard errors below a calibrated prior at which the choice of a call's programs
# reads it (`cautious_prior`). A calibration on 4 prompts read α₁ 0.30 where the 16
# timed prompts then accepted 0.16-0.20, and the call, drafting on an expected gain of
# 8 %, ran 0.95× plain decoding. One standard error at each depth: the call's gain
# multiplies the depths' acceptances, so a one-sided 95 % bound (1.645) at each falls far
# below 95 % for the product, and would have turned a greedy n-gram that gains 25-28 % on
# repetitive edits to plain decoding (docs/benchmarks.md, "n-gram over a corpus").
CALL_CONFIDENCE_Z = 1.0


def cautious_prior(prior, tries, z: float = CALL_CONFIDENCE_Z):
    """prior α_d [Dm] at the lower end of its Wilson score interval from tries [Dm] or []
    (the calibration's tries at each depth; NaN or 0: unknown, the prior kept): the α a
    call's choice to draft must hold at, since it cannot be undone inside the call and
    the prior is a mean over a few calibration prompts. NaN priors stay NaN (the
    default's)."""
    p = jnp.asarray(prior, jnp.float32)
    n = jnp.broadcast_to(jnp.asarray(tries, jnp.float32), p.shape)
    known = jnp.isfinite(n) & (n > 0)
    n = jnp.where(known, n, 1.0)
    z2 = z * z
    centre = p + z2 / (2.0 * n)
    spread = z * jnp.sqrt(jnp.clip(p * (1.0 - p), 0.0) / n + z2 / (4.0 * n * n))
    low = jnp.clip((centre - spread) / (1.0 + z2 / n), 0.0, 1.0)
    return jnp.where(known, low, p)


def position_acceptance(hist, tried, prior: tuple[float, float] = (3.0, PRIOR_TRIES),
                        mean=None):
    """Running acceptance per draft position α_d [B, Dm] from the counters hist [B, Dm+1]
    and tried [B, Dm], shrunk towards `prior[0]` accepts in `prior[1]` tries at depth 1
    and the row's own α_{d-1} deeper (so a rejected draft's deeper estimates fall with
    α_1), or towards `mean` [Dm] where it is not NaN."""
    at_least = accepted_at_least(jnp.asarray(hist))  # [B, Dm]
    pseudo, n0 = prior  # pseudo-accepts in n0 pseudo-tries
    out = []
    for d in range(at_least.shape[1]):  # static Dm: a short loop over depths
        if mean is not None:
            pseudo = jnp.where(jnp.isnan(mean[d]), pseudo, n0 * mean[d])
        out.append((at_least[:, d] + pseudo) / (tried[:, d] + n0))
        pseudo = n0 * out[-1]
    return jnp.stack(out, axis=1) if out else jnp.asarray(at_least, jnp.float32)


# Pseudo-asks the proposal rate is shrunk with, for a speculator that cannot peek
# (`Speculator.peeks`). A lookup finds more matches as a generation goes on and its
# output repeats itself, so a row's first asks read it low; at 4 pseudo-asks a few early
# misses kept such a row at k = 0, where the rate is not re-measured, for the rest of
# the row (docs/benchmarks.md, "n-gram: the shortest match").
PROPOSAL_PRIOR_TRIES = 16.0


def proposal_rate(proposed, asked, prior=np.float32(np.nan)):
    """[B] P(the speculator proposes at least one token | the row asked it to draft), from
    the counters proposed and asked [B], shrunk towards `prior` (NaN: 1) with
    PROPOSAL_PRIOR_TRIES pseudo-steps. An n-gram speculator proposes only where its pattern
    recurs; a draft model always proposes."""
    p0 = jnp.where(jnp.isnan(prior), 1.0, jnp.clip(prior, 0.0, 1.0))
    return (jnp.asarray(proposed, jnp.float32) + PROPOSAL_PRIOR_TRIES * p0) / (
        jnp.asarray(asked, jnp.float32) + PROPOSAL_PRIOR_TRIES)


def asked_step_cost(step, empty, proposal):
    """What a step that asks the speculator to draft costs on average: `step` where it
    proposes (with probability `proposal`), `empty` where it finds nothing and the step
    verifies only its root (shapes broadcast)."""
    return proposal * step + (1.0 - proposal) * empty


def leviathan_gain(alpha, cost_ratio: float, k_max: int, verify_cost=None,
                   draft_calls=None, proposal=None, overhead=None, empty=None):
    """[B, k_max+1] E[tokens](k) / (n_k c + v_k + o_k) for k = 0..k_max, per row, per
    step that asks the speculator for k tokens.

    alpha: [B] one rate per row, or [B, k_max] per position (`expected_tokens`);
    verify_cost: [k_max+1] cost of the verify forward for each k (default 1: free);
    draft_calls: [k_max+1] draft calls n_k that drafting k positions takes (default k);
    proposal: [B] P(the speculator proposes | asked) (None: 1). A step that asks and gets
    nothing verifies only its root, one token, so tokens and cost mix with it:
    p (E_k - 1) + 1 over p (v_k + o_k) + (1 - p) u + n_k c. An n-gram that finds a
    match at 3 % of steps gains little from a deep prior, yet every asked step pays for
    the speculative step;
    overhead: [k_max+1] the step's cost beyond its draft calls and verify, o_k (default
    0), per asked step as `specjax.calibrate.step_overhead` measures it;
    empty: [] u, what an asked step that gets no draft costs: its one-token forward in
    the verify switch and that step's overhead (default 1 + o_k)."""
    a = jnp.asarray(alpha, jnp.float32)
    if a.ndim == 1:
        a = jnp.repeat(a[:, None], k_max, axis=1)
    ks = jnp.arange(k_max + 1, dtype=jnp.float32)  # [K+1]
    v = jnp.ones_like(ks) if verify_cost is None else jnp.asarray(verify_cost, jnp.float32)
    n = ks if draft_calls is None else jnp.asarray(draft_calls, jnp.float32)
    o = 0.0 if overhead is None else jnp.asarray(overhead, jnp.float32)
    e = expected_tokens(a[:, :k_max])  # [B, K+1]
    step = v + o  # [K+1] or [B, K+1]: an asked step that gets its draft
    if proposal is not None:
        p = jnp.clip(jnp.asarray(proposal, jnp.float32), 0.0, 1.0)[:, None]
        u = jnp.where(ks > 0, 1.0 + o if empty is None else empty, 1.0)  # k = 0: plain
        e, step = p * (e - 1.0) + 1.0, asked_step_cost(step, u, p)
    return e / (n * cost_ratio + step)  # cost_ratio may be traced


def peeking_gain(alpha, cost_ratio: float, k_max: int, verify_cost, draft_calls, match,
                 overhead, idle, margin=0.0):
    """[B, k_max+1] tokens per unit of cost over all of a row's steps, k = 0..k_max, for a
    speculator that peeks (`Speculator.peeks`) at a row deciding alone: `leviathan_gain`'s
    mix of the drafting step (n_k c + v_k + o_k, raised by 1 + margin: the margin guards
    the drafting estimates only) at the share match [B] of steps where the lookup finds
    a draft, and the loop's plain step (1 + idle, [] `Rule.idle`) at the others; k = 0
    is plain decoding's programs, 1 (docs/speculators.md, the adaptive rule)."""
    ks = jnp.arange(k_max + 1, dtype=jnp.float32)
    drafting = (jnp.asarray(draft_calls, jnp.float32) * cost_ratio
                + jnp.asarray(verify_cost, jnp.float32) + jnp.asarray(overhead, jnp.float32))
    drafting = drafting * jnp.where(ks > 0, 1.0 + margin, 1.0)
    gain = leviathan_gain(alpha, 0.0, k_max, drafting, proposal=match, empty=1.0 + idle)
    return jnp.where(ks > 0, gain, 1.0)


def leviathan_optimal_k(alpha, cost_ratio: float, k_max: int, verify_cost=None,
                        draft_calls=None, margin=0.0, proposal=None, overhead=None,
                        empty=None):
    """argmax_k over 0..k_max of `leviathan_gain`, per row, a k > 0 counted only where it
    beats k = 0 by the factor 1 + margin."""
    gain = leviathan_gain(alpha, cost_ratio, k_max, verify_cost, draft_calls, proposal,
                          overhead, empty)
    ks = jnp.arange(k_max + 1)
    gain = gain / jnp.where(ks > 0, 1.0 + margin, 1.0)
    return jnp.argmax(gain, axis=-1).astype(jnp.int32)


def probe_value(alpha1, gain, upkeep):
    """[B] bool: whether keeping a row at k = 0 able to probe is worth its upkeep: the
    chance that its next PROBE_LOOKAHEAD probes are all accepted (alpha1 [B], its
    depth-1 acceptance, to that power) times the share of the cost drafting would then
    save (1 - 1 / gain, gain [B]: tokens per unit of cost at the hopeful α and k over a
    plain step's) covers what every step at k = 0 costs (upkeep [B] or []: the
    speculative loop's `Rule.idle` and the probes' own loss, `probe_loss`). A rough value
    of the information a probe buys: a row whose drafts are rarely accepted is better
    decoded by plain decoding's programs than kept probing."""
    chance = jnp.clip(jnp.asarray(alpha1, jnp.float32), 0.0, 1.0) ** PROBE_LOOKAHEAD
    return chance * (1.0 - 1.0 / jnp.maximum(gain, 1e-6)) >= upkeep


def probe_loss(alpha1, probe_cost, gap):
    """[B] what a row's probes lose against plain steps, per step: a probe costs
    probe_cost [] or [B] (a 2-token verify and one draft call, in plain steps; mixed
    with an empty step where the speculator may find no draft) for 1 + alpha1 [B]
    tokens (alpha1: P(the probe is accepted)), once every `gap` [] steps (its first
    gap: later ones only grow). A measured upkeep of 0 (`Rule.idle`, a noisy timing
    clipped at 0) would otherwise make any chance of turning drafting on worth probing
    for, however rarely drafts are accepted."""
    loss = jnp.maximum(probe_cost - 1.0 - jnp.asarray(alpha1, jnp.float32), 0.0)
    return loss / jnp.maximum(jnp.asarray(gap, jnp.float32), 1.0)


def slowest_row_z(batch: int) -> float:
    """The expected largest of `batch` standard normal draws (Blom's approximation;
    0 at batch 1): how many standard errors below its estimate the unluckiest row of a
    batch is expected to land."""
    if batch <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((batch - 0.375) / (batch + 0.25))


def slowest_row_acceptance(alpha, tried, batch: int):
    """α [B, Dm] lowered by `slowest_row_z(batch)` standard errors, each α_d an estimate
    from tried[:, d] + PRIOR_TRIES tries. A batch ends with its unluckiest row, and
    while each row has only a few tries that row's acceptance is well below the estimate
    every row shares (a calibrated prior is a mean over prompts)."""
    a = jnp.asarray(alpha, jnp.float32)
    n = jnp.asarray(tried, jnp.float32) + PRIOR_TRIES
    return jnp.clip(a - slowest_row_z(batch) * jnp.sqrt(a * (1.0 - a) / n), 0.0, 1.0)


def batch_step_times(alpha, depth, active, remaining, bucket_depths: Sequence[int],
                     bucket_cost):
    """([NB] time, [NB] rate) if every step ran bucket b: the batch's modelled time to
    finish, the slowest active row's remaining[r] · cost_b / E_r[tokens | depth <=
    min(D_b, depth_r)], and the active rows' mean tokens per unit of cost.

    alpha [B] or [B, Dm]; depth, active, remaining [B]."""
    a = jnp.asarray(alpha, jnp.float32)
    if a.ndim == 1:
        a = jnp.repeat(a[:, None], max(max(bucket_depths), 1), axis=1)
    e = expected_tokens(a)  # [B, Dm+1]
    d = jnp.asarray(bucket_depths, jnp.int32)[None, :]  # [1, NB]
    reach = jnp.minimum(jnp.asarray(depth).astype(jnp.int32)[:, None], d)  # [B, NB]
    tokens = jnp.take_along_axis(e, reach, axis=1)
    cost = jnp.asarray(bucket_cost, jnp.float32)[None, :]
    live = jnp.asarray(active)[:, None]
    time = jnp.max(jnp.where(live, jnp.asarray(remaining, jnp.float32)[:, None] * cost / tokens,
                             0.0), axis=0)
    rate = (jnp.sum(jnp.where(live, tokens, 0.0), axis=0)
            / jnp.maximum(jnp.sum(live), 1) / cost[0])
    return time, rate


def batch_verify_bucket(alpha, drafted_depth, active, bucket_depths: Sequence[int],
                        bucket_cost):
    """The verify bucket [] the whole batch should run once every row has drafted (one
    deep row makes every row pay its width): the most tokens per unit of verify cost,
    Σ_r E_r[tokens | depth <= min(D_b, drafted_r)] / cost_b, ties to the cheaper bucket.
    The batch's slowest row was weighed before drafting (`speculation_pays`); which row
    drew a short draft this step is luck that evens out over the rows, so one step's
    slowest row does not decide here."""
    ones = jnp.ones(jnp.shape(drafted_depth), jnp.float32)
    _, rate = batch_step_times(alpha, drafted_depth, active, ones, bucket_depths, bucket_cost)
    return jnp.argmax(rate).astype(jnp.int32)


def speculation_pays(alpha, limit, active, remaining, bucket_depths: Sequence[int],
                     bucket_cost, margin, alpha_low=None):
    """[] bool: whether steps with each row drafting to limit [B] would beat plain steps
    (each costing 1) by the factor 1 + margin in some bucket: finish the batch sooner,
    or as soon with more tokens per unit of cost (`batch_step_times`; bucket_cost
    includes the draft calls). A `generate` batch ends with its last row and its
    forwards keep their shape to the end, so a row that gains nothing holds every row to
    the verify's cost: at batch > 1 no row that would finish last may lose, where the
    summed tokens would let the rows that gain outvote it. The time is read at
    alpha_low (default alpha), what the unluckiest row may see
    (`slowest_row_acceptance`); the tokens per cost, a sum over rows, at alpha. At
    batch 1 this is the row's own rule."""
    low = alpha if alpha_low is None else alpha_low
    time, _ = batch_step_times(low, limit, active, remaining, bucket_depths, bucket_cost)
    _, rate = batch_step_times(alpha, limit, active, remaining, bucket_depths, bucket_cost)
    plain = jnp.max(jnp.where(active, jnp.asarray(remaining, jnp.float32), 0.0))
    sooner = time * (1.0 + margin) < plain
    as_soon = (time <= plain) & (rate > 1.0 + margin)
    return jnp.any(sooner | as_soon)


@struct.dataclass
class Decision:
    """The rule's verdict for one loop step (plain steps leave it unchanged: only
    accepted drafts and tries move α)."""

    rule: Rule
    alpha: jax.Array  # [B, Dm] acceptance per position
    limit: jax.Array  # [B] the depth k each row drafts: its own k, or 0 for every row
    # where the batch as a whole would not gain (`speculation_pays`)
    own: jax.Array  # [B] the depth k each row's own rule picks
    # [B] bool: whether a probe could change the row's own k, and is worth the upkeep
    # of a speculative loop (`probe_value`)
    worth: jax.Array
    hopeful: jax.Array  # [B, Dm] α after PROBE_LOOKAHEAD accepted probes
    hopeful_k: jax.Array  # [B] the row's own k at that α
    # [B, Dm] alpha and hopeful as the batch's slowest row may find them
    # (`slowest_row_acceptance`), which the batch decisions read
    alpha_low: jax.Array
    hopeful_low: jax.Array
    # [B] bool: whether the row's own k beats plain decoding's programs by the factor
    # 1 + margin over all of its steps, the loop's upkeep where it drafts nothing
    # included: what choosing the speculative loop for a call needs (`may_draft`). Only a
    # speculator that peeks mixes in such steps (`peeking_gain`); elsewhere own > 0
    # already says so
    call_pays: jax.Array
    cost: jax.Array  # [NB] each verify bucket's cost as the rule prices it
    spent: jax.Array  # [NB+1] each bucket's cost at the batch, then no forward's
    call_cost: jax.Array  # [Dm+1] c · the draft calls that drafting k positions takes
    max_new: jax.Array  # [] the call's budget of new tokens per row
    # [B] expected tokens per unit of cost at the row's own k over plain decoding's, at
    # its α: 1 at k = 0 (`prior_gain`)
    gain: jax.Array
    depths: tuple[int, ...] = struct.field(pytree_node=False, default=())  # per bucket

    def remaining(self, st: LoopState):
        """[B] new tokens each row may still emit."""
        return remaining_tokens(st, self.max_new)

    def probing(self, st: LoopState):
        """[B] bool: the rows that draft one token this step to re-measure α. A row
        probes once its schedule says so (`probe_schedule`) and where accepted probes
        could make it draft; at batch > 1 only if they could also make the batch draft,
        every row due probing at once (the schedules are aligned), since one probe puts
        every row through a speculative step."""
        active = ~st.done
        due = ((self.limit == 0) & (st.steps >= st.probes.next_probe) & self.rule.adaptive
               & active & self.worth)
        return due & (self._pays_if_probes_pass(due, active, self.remaining(st))
                      | self.rule.per_row)

    def probes_could_pay(self, active) -> jax.Array:
        """[] bool: whether probes could ever make the batch draft: had every row that
        may probe had its probes accepted, would it (`probing` with all of them due and
        every row as far from its end)."""
        return (self._pays_if_probes_pass(active & self.worth, active, jnp.ones_like(self.own))
                | self.rule.per_row) & jnp.any(active & self.worth)

    def _pays_if_probes_pass(self, due, active, remaining):
        """[] bool: `speculation_pays` with the `due` rows at their hopeful α and k."""
        k = jnp.where(due, self.hopeful_k, self.own)
        alpha = jnp.where(due[:, None], self.hopeful, self.alpha)
        low = jnp.where(due[:, None], self.hopeful_low, self.alpha_low)
        calls = self.call_cost[jnp.max(jnp.where(active, k, 0))]  # every row waits
        return speculation_pays(alpha, k, active, remaining, self.depths, self.cost + calls,
                                self.rule.margin, low)

    def depth_limits(self, st: LoopState, max_depth: int):
        """(depth limit [B], probed [B]): the rule's k, 1 where a k = 0 row probes
        (`probing`), full depth without the adaptive rule, 0 on finished rows."""
        adaptive, active = self.rule.adaptive, ~st.done
        probed = self.probing(st)
        limit = jnp.where(probed, 1, self.limit)  # a row at k = 0 re-measures now and then
        return jnp.where(adaptive & active, limit, jnp.where(active, max_depth, 0)), probed

    def bucket(self, row_depth, active, probed):
        """The verify bucket: the one that pays for the batch as a whole, never deeper
        than the deepest draft; probe steps (and rows deciding alone) verify every draft
        so that rows at k = 0 keep measuring."""
        covering = jnp.sum(jnp.asarray(self.depths) < jnp.max(row_depth))
        best = batch_verify_bucket(self.alpha, row_depth, active, self.depths, self.cost)
        rule = self.rule
        return jnp.where(rule.adaptive & ~jnp.any(probed) & ~rule.per_row,
                         jnp.minimum(best, covering), covering)


def remaining_tokens(st: LoopState, max_new) -> jax.Array:
    """[B] new tokens each row may still emit under the call's budget `max_new` []."""
    return max_new - (st.lengths - st.prompt_lens)


def decide(spec: Speculator, rule: Rule, buckets, st: LoopState, max_new,
           backend: str | None = None) -> Decision:
    """`decide_from` the loop's counters, for the rows still active and what they may
    still emit (`max_new` [] the call's budget per row), the verify priced at the
    context the attention `backend` reads (`attended`)."""
    return decide_from(spec, rule, buckets, st.counters, ~st.done,
                       remaining_tokens(st, max_new), max_new, attended(st, backend))


def attended(st: LoopState, backend: str | None = None) -> jax.Array:
    """[] cached tokens a forward's attention reads per row in the loop's state
    (`attended_tokens` over the active rows)."""
    pages = st.cache.k_pages  # [L, K, P, Z, H]
    return attended_tokens(backend, st.cache.capacity, jnp.where(~st.done, st.lengths, 0),
                           pages.shape[-1], pages.dtype)


def attended_tokens(backend: str | None, capacity: int, lengths, head_dim: int | None = None,
                    kv_dtype=None) -> jax.Array:
    """[] cached tokens a forward's attention reads per row: up to each row's length
    where the attention reads only used slots (`attention.reads_used_slots` for pages of
    `head_dim` and `kv_dtype`), so the longest of `lengths`; else every slot of the table
    (`capacity` tokens a row)."""
    if not reads_used_slots(backend, head_dim, kv_dtype):
        return jnp.float32(capacity)
    return jnp.max(jnp.asarray(lengths)).astype(jnp.float32)


def overhead_at(overhead, depths: np.ndarray) -> jax.Array:
    """`Rule.overhead` at each of `depths` (static ints): by depth, or one value for
    every depth."""
    o = jnp.atleast_1d(jnp.asarray(overhead, jnp.float32))
    return o[np.minimum(depths, o.shape[0] - 1)]


def may_draft(spec: Speculator, rule: Rule, batch: int, context: int = 0) -> bool:
    """Whether a `generate` call of `batch` rows whose attention reads `context` cached
    tokens at first (`attended`) that starts from the rule's prior could ever draft.
    False when, with no tries yet, every row is at k = 0 and no probe could pay: α moves
    only on drafting steps, so the speculator would never run, and the call is plain
    decoding (no speculator prefill, no speculative machinery). Also False where the
    rows would draft but expect to gain less than the margin over the whole call
    (`Decision.call_pays`), probes or not (such a row would draft from its first step,
    not probe): a lookup that matches at one step in ten, each match gaining 30 %, gains
    2-3 % over the call, inside the error of its estimates and of the speculative
    loop's measured upkeep (docs/speculators.md, the adaptive rule). The prior is read
    at its lower confidence bound (`cautious_prior`, from `Rule.prior_tries`): once a
    call runs the speculative loop it pays that loop's upkeep to its end, so the choice
    must hold for prompts whose acceptance falls below the calibration's mean."""
    return bool(_may_draft(spec, rule, verify_buckets(spec.shape.depth_widths), batch,
                           jnp.float32(context)))


@functools.partial(jax.jit, static_argnames=("buckets", "batch"))
def _may_draft(spec: Speculator, rule: Rule, buckets, batch: int, context) -> jax.Array:
    cautious = rule.replace(prior=cautious_prior(rule.prior, rule.prior_tries))
    d = _first_decision(spec, cautious, buckets, batch, context)
    drafts = d.limit > 0  # rows that draft from the first step: they do not probe
    return ~rule.adaptive | jnp.any(drafts & d.call_pays) | d.probes_could_pay(~drafts)


def prior_gain(spec: Speculator, rule: Rule, batch: int = 1, context: int = 0) -> float:
    """What the rule expects drafting to gain over plain decoding's programs before a
    call's first step, from its prior alone: expected tokens per unit of cost at the k
    it would pick for a row of a `batch`-row call reading `context` cached tokens, over
    plain decoding's (1.0 where it keeps k = 0). Comparing it across a speculator's
    shapes calibrated on the same prompts picks the shape that pays most
    (`specjax.calibrate.best_calibrated`)."""
    return float(_prior_gain(spec, rule, verify_buckets(spec.shape.depth_widths), batch,
                             jnp.float32(context)))


@functools.partial(jax.jit, static_argnames=("buckets", "batch"))
def _prior_gain(spec: Speculator, rule: Rule, buckets, batch: int, context) -> jax.Array:
    d = _first_decision(spec, rule, buckets, batch, context)
    return jnp.where(d.limit[0] > 0, d.gain[0], 1.0)


def _first_decision(spec: Speculator, rule: Rule, buckets, batch: int, context) -> Decision:
    """The rule's decision before a call's first step: no tries yet, every row alike (the
    batch rule is the row's)."""
    ones = jnp.ones((batch,), jnp.int32)
    return decide_from(spec, rule, buckets, Counters.zeros(batch, spec.shape.max_depth),
                       ones > 0, ones, jnp.int32(1), context)


def decide_from(spec: Speculator, rule: Rule, buckets, counters: Counters, active,
                remaining, max_new, context=None) -> Decision:
    """Per row, the k that maximises expected tokens per unit of cost (c paid per draft
    call, the verify forward's cost growing with its width, plus the step's measured
    overhead), and whether a probe pays; then, at batch > 1, whether the batch as a
    whole gains from drafting (`speculation_pays` at `slowest_row_acceptance`), every
    row kept at k = 0 if not.

    A probe drafts depth 1 only, so it is worth its cost only if PROBE_LOOKAHEAD
    accepted probes in a row would make the rule draft, and only where the chance of
    that covers the speculative loop's upkeep and what the probes themselves lose
    (`probe_value`, `probe_loss`). active, remaining: [B];
    context: [] cached tokens the verify attends over (None: the cost tables' own).
    """
    b = counters.hist.shape[0]
    rows = jnp.where(rule.per_row, 1.0, float(b))  # the batch the rule prices
    inputs = np.asarray([w + 1 for _, w in buckets])  # verified tokens per bucket
    depths = tuple(d for d, _ in buckets)
    over = overhead_at(rule.overhead, np.asarray(depths + (0,)))  # [NB+1]
    forward = rule.vcost.speculative(inputs, rows, context)
    cost = forward + over[:-1]
    spent = rule.vcost.speculative(np.append(inputs, 1), b, context) + over
    per_k = np.asarray(bucket_per_depth(buckets))
    calls = np.minimum(np.arange(spec.shape.max_depth + 1), spec.cost.calls_per_step)
    # k = 0 is a plain step (`DecodeLoop.plain_steps`); k > 0 a forward in the switch
    wide = inputs[per_k] > 1
    verify, step_over = jnp.where(wide, forward[per_k], 1.0), jnp.where(wide, over[per_k], 0.0)
    v = verify + step_over
    # an asked step that gets no draft still runs the switch: its smallest forward
    empty = forward[per_k[0]] + over[per_k[0]]
    gains = lambda a, q: leviathan_gain(a, rule.cost_ratio, spec.shape.max_depth, verify,
                                        calls, q, step_over, empty)
    best = lambda a, q: leviathan_optimal_k(a, rule.cost_ratio, spec.shape.max_depth, verify,
                                            calls, rule.margin, q, step_over, empty)
    hist, tried = counters.hist, counters.tried
    alpha = position_acceptance(hist, tried, mean=rule.prior)  # [B, Dm]
    hopeful = position_acceptance(hist.at[:, 1].add(PROBE_LOOKAHEAD),
                                  tried.at[:, 0].add(PROBE_LOOKAHEAD), mean=rule.prior)
    # At batch > 1 a row asked to draft pays the batch's verify width whether or not its
    # speculator finds a draft, so the first position's acceptance counts the steps it
    # finds none. At batch 1, or where rows decide alone, such a step verifies only its
    # root, so the gain mixes the steps that find a draft with those that do not
    # (`leviathan_gain`'s proposal); the hopeful case assumes the probes found theirs.
    # A speculator that peeks (`Speculator.peeks`) runs plain steps until a row has a
    # draft, so there a row's step that drafts always has one.
    shared = ~rule.per_row & (b > 1)
    p = proposal_rate(counters.proposed, counters.asked, rule.proposal)
    p_hopeful = proposal_rate(counters.proposed + PROBE_LOOKAHEAD,
                              counters.asked + PROBE_LOOKAHEAD, rule.proposal)
    alpha = alpha.at[:, 0].multiply(jnp.where(shared, p, 1.0))
    hopeful = hopeful.at[:, 0].multiply(jnp.where(shared, p_hopeful, 1.0))
    if spec.peeks:
        mix = mix_hopeful = jnp.ones_like(p)
    else:
        mix, mix_hopeful = jnp.where(shared, 1.0, p), jnp.where(shared, 1.0, p_hopeful)
    own, hopeful_k = best(alpha, mix), best(hopeful, mix_hopeful)
    g = gains(hopeful, mix_hopeful)
    if spec.peeks:
        # A row deciding alone drafts at the steps its lookup finds a match; its other
        # steps are the loop's plain steps, dearer by `Rule.idle` than plain decoding's
        # programs, which it would run at k = 0 (`peeking_gain`). The share of steps
        # with a match is the calibrated prior: a peeking row asks only where it has one,
        # so its own counters cannot measure it.
        match = jnp.broadcast_to(proposal_rate(0.0, 0.0, rule.proposal), p.shape)
        alone = lambda a, margin: peeking_gain(a, rule.cost_ratio, spec.shape.max_depth,
                                               verify, calls, match, step_over, rule.idle,
                                               margin)
        argmax = lambda gain: jnp.argmax(gain, axis=-1).astype(jnp.int32)
        own = jnp.where(shared, own, argmax(alone(alpha, rule.margin)))
        hopeful_k = jnp.where(shared, hopeful_k, argmax(alone(hopeful, rule.margin)))
        g = jnp.where(shared, g, alone(hopeful, 0.0))
        # the margin on the call's gain, not on its drafting steps' alone
        whole = jnp.take_along_axis(alone(alpha, 0.0), own[:, None], axis=1)[:, 0]
        call_pays = shared | (whole >= 1.0 + rule.margin)
        own_gain = jnp.where(shared, _gain_at(gains(alpha, mix), own), whole)
    else:
        call_pays = jnp.ones_like(own, bool)
        own_gain = _gain_at(gains(alpha, mix), own)
    hopeful_gain = _gain_at(g, hopeful_k)
    call_cost = rule.cost_ratio * jnp.asarray(calls, jnp.float32)
    # A probe is accepted only where the speculator proposes, and one that gets no draft
    # costs an empty step: at batch 1 both mix with the proposal rate (shared: in α₁).
    hit = alpha[:, 0] * mix
    probe_cost = asked_step_cost(v[1], empty, mix) + call_cost[1]
    upkeep = rule.idle + probe_loss(hit, probe_cost, rule.probe_gap)
    worth = (hopeful_k > 0) & probe_value(hit, hopeful_gain, upkeep)
    alpha_low = slowest_row_acceptance(alpha, tried, b)
    hopeful_low = slowest_row_acceptance(hopeful, tried.at[:, 0].add(PROBE_LOOKAHEAD), b)
    drafts = call_cost[jnp.max(jnp.where(active, own, 0))]
    pays = speculation_pays(alpha, own, active, remaining, depths, cost + drafts,
                            rule.margin, alpha_low)
    limit = jnp.where(pays | rule.per_row, own, 0)
    return Decision(rule=rule, alpha=alpha, limit=limit, own=own, worth=worth,
                    hopeful=hopeful, hopeful_k=hopeful_k, alpha_low=alpha_low,
                    hopeful_low=hopeful_low, call_pays=call_pays, cost=cost, spent=spent,
                    call_cost=call_cost, max_new=jnp.asarray(max_new, jnp.int32),
                    gain=own_gain, depths=depths)


def _gain_at(gain, k):
    """[B] gain [B, K+1] at each row's k over its k = 0."""
    return jnp.take_along_axis(gain, k[:, None], axis=1)[:, 0] / gain[:, 0]
