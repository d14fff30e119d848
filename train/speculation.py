"""Short real speculative generations for evaluation: held-out prompts and α and τ of
the speculator that trained heads go into (`specjax.speculators.head_speculator`). The
heads job records one
at the end of every run; the quickstart's comparison runs every method through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import specjax
from specjax.passes import generate_calls, merge_pass


@dataclasses.dataclass(frozen=True)
class SpeculativeEval:
    """A short greedy speculative run on held-out prompts, at the end of a heads run."""

    num_prompts: int = 4
    prompt_len: int = 32  # tokens taken from one held-out document per prompt
    new_tokens: int = 32
    seed: int = 0  # which documents and offsets the prompts come from
    eagle_tree: tuple[int, int, int] = (4, 4, 16)  # EAGLE-2 tree: top_k, depth, total_tokens

    def __post_init__(self):
        if min(self.num_prompts, self.prompt_len, self.new_tokens) < 1:
            raise ValueError(f"num_prompts={self.num_prompts}, prompt_len={self.prompt_len} "
                             f"and new_tokens={self.new_tokens} must be positive")


def speculative_run(target: specjax.Model, speculator, prompts, *, new_tokens: int,
                    temperature: float = 0.0, seed: int = 0, adaptive: bool = False,
                    batch: int | None = None, cost_ratio: float | None = None,
                    calibration=None) -> tuple[list[list[int]], dict[str, Any]]:
    """(generated tokens, record) of `specjax.generate` over `prompts`: α, τ, mean k,
    tokens/s, TTFT/TPOT, the accepted-length histogram and compile time.

    Full depth every step by default, so α and τ measure the drafts themselves: the
    adaptive rule would turn drafting off wherever it does not pay on this machine
    (on CPU most small trees; docs/speculators.md), and τ would then measure the rule.
    batch: rows per generate call (None: all prompts in one call); the record then sums
    the calls (α, τ and k over all steps, tokens/s over all decode time).
    cost_ratio: the draft's measured cost, for the adaptive rule and the analytical figure;
    calibration: the rule's starting acceptance per depth and the step's overhead
    (`specjax.calibrate.Calibration`; None: generate's defaults)."""
    return run_record([call() for call in generate_calls(
        target, speculator, prompts, new=new_tokens,
        batch=len(prompts) if batch is None else batch,
        temperature=temperature, seed=seed, adaptive=adaptive, cost_ratio=cost_ratio,
        calibration=calibration)])


def run_record(parts: list) -> tuple[list[list[int]], dict[str, Any]]:
    """(tokens, record) of one pass from its generate calls' (tokens, stats, wall
    seconds), in prompt order (`specjax.passes.generate_calls`): `speculative_run`'s
    record, its stats summed over the calls (`specjax.passes.merge_pass`)."""
    tokens, s, _ = merge_pass(parts)
    return tokens, dict(alpha=s.acceptance_rate, tau=s.mean_accepted_length, k=s.mean_k,
                        draft_calls_per_call=s.draft_calls / max(s.target_calls, 1),
                        cost_ratio=s.cost_ratio, verify_cost=s.verify_cost,
                        analytical=s.expected_speedup,
                        mean_verified=s.mean_verified, tokens_per_s=s.tokens_per_s,
                        ttft_ms=s.ttft_s * 1e3, tpot_ms=s.tpot_s * 1e3,
                        accepted_hist=s.accepted_hist, compile_s=s.compile_s,
                        speculative_calls=s.speculative_calls, calls=len(parts),
                        acceptance_by_position=s.acceptance_by_position)
