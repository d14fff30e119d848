"""A pass of `generate` over a prompt set, split in calls of `batch` rows, so that the
comparison and the benchmark suite can time methods side by side call by call
(`specjax.timing.side_by_side_calls`) and join each pass's calls into one record."""

from __future__ import annotations

import functools
import time

from specjax.calibrate import calibrated_kwargs
from specjax.stats import GenerationStats, merge_stats


def generate_calls(target, speculator, prompts: list[list[int]], *, new: int, batch: int,
                   temperature: float = 0.0, seed: int = 0, adaptive: bool = True,
                   cost_ratio: float | None = None, calibration=None, kv_cache_dtype=None,
                   verification: str | None = None) -> list:
    """`prompts` through `generate` in consecutive calls of `batch` rows, exactly `new`
    tokens each, not yet made: one zero-argument call per `batch` rows returning (tokens
    per row, stats, wall seconds without compilation). Call i samples with seed
    `seed + i`; `cost_ratio` and `calibration` (a `specjax.calibrate.Calibration`:
    acceptance prior and step overhead) go to generate (None: the speculator's
    parameter-count estimate, the defaults), as do `kv_cache_dtype` (the target's cache)
    and `verification` (None: the speculator's default)."""
    from specjax.decoding.generate import generate  # read per pass: tests patch it

    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    kw = dict(max_new_tokens=new, temperature=temperature, ignore_eos=True,
              speculator=speculator, adaptive=adaptive,
              cost_ratio=None if speculator is None else cost_ratio,
              **calibrated_kwargs(calibration, speculator), kv_cache_dtype=kv_cache_dtype,
              verification=None if speculator is None else verification)

    def call(rows: list[list[int]], call_seed: int):
        t0 = time.perf_counter()
        out = generate(target, rows, seed=call_seed, **kw)
        # A prompt length not seen yet compiles inside its call (and a long session's
        # program cache may have dropped one): the steady state is what is timed.
        return out.tokens, out.stats, time.perf_counter() - t0 - out.stats.compile_s

    return [functools.partial(call, prompts[i:i + batch], seed + i // batch)
            for i in range(0, len(prompts), batch)]


def merge_pass(parts: list) -> tuple[list[list[int]], GenerationStats, float]:
    """One pass from its calls' (tokens, stats, wall seconds), in prompt order: the tokens
    joined, the stats merged (`specjax.stats.merge_stats`; one call's as they are), the
    walls summed."""
    tokens = [row for toks, _, _ in parts for row in toks]
    stats = parts[0][1] if len(parts) == 1 else merge_stats([s for _, s, _ in parts])
    return tokens, stats, sum(wall for _, _, wall in parts)
