"""Interleaved timing of compiled programs: every program measured under the same machine
load, for the calibration passes, the few-row matmul kernel's race against XLA and the
kernel benchmarks. It sits on the lowest floor so the model modules' kernels can use it."""

from __future__ import annotations

import statistics
import time

import numpy as np


def interleaved_medians(programs: dict, repeats: int) -> dict:
    """{key: median seconds} of compiled programs {key: (fn, args)}, timed in `repeats`
    interleaved rounds, so every program sees the same machine load: in a new order
    each round (`round_order`), each run once untimed right before its timed run (a
    program timed right after another's larger forward measured up to 1.6x slower, and
    generate's loop runs one program step after step)."""
    times = {key: [] for key in programs}
    keys = list(programs)
    for r in range(repeats):
        for i in round_order(len(keys), r):
            fn, args = programs[keys[i]]
            fn(*args).block_until_ready()
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times[keys[i]].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in times.items()}


def side_by_side(passes: dict, repeats: int) -> dict[str, list]:
    """{name: its passes' results}: `repeats` rounds running each of `passes` (name ->
    a call) once, in round r's `balanced_order`, so that methods timed side by side see
    the same machine load."""
    rounds = side_by_side_calls({name: [fn] for name, fn in passes.items()}, repeats)
    return {name: [calls[0] for calls in got] for name, got in rounds.items()}


def side_by_side_calls(passes: dict, repeats: int) -> dict[str, list[list]]:
    """{name: per round, its calls' results}: `passes` maps a name to its pass split in
    calls (a list of zero-argument calls, e.g. one per prompt); in each of `repeats`
    rounds call j of every pass runs before call j + 1 of any, the names in
    `balanced_order` row r * calls + j. Methods then pair call by call: a host whose
    speed changes by the second speeds or slows each method's share of a round alike,
    where whole passes side by side hand one method's pass the fast seconds."""
    names = list(passes)
    depth = max((len(calls) for calls in passes.values()), default=0)
    results = {name: [] for name in names}
    for r in range(repeats):
        got = {name: [] for name in names}
        for j in range(depth):
            for i in balanced_order(len(names), r * depth + j):
                if j < len(passes[names[i]]):
                    got[names[i]].append(passes[names[i]][j]())
        for name in names:
            results[name].append(got[name])
    return results


def round_order(n: int, r: int) -> np.ndarray:
    """[n] round `r`'s order of n interleaved timings: a permutation seeded by r."""
    return np.random.default_rng(r).permutation(n)


def balanced_order(n: int, r: int) -> list[int]:
    """[n] round `r`'s order of n methods timed side by side: row r (mod n) of a Williams
    design, a balanced Latin square. Over n rounds each method runs once at every
    position and, for an even n, right after every other method once; for an odd n > 3
    its predecessor still changes from one round to the next. The same programs measured
    6-10 % slower when they always ran first in a round, and a plain rotation kept each
    method's predecessor fixed."""
    base, low, high = [0], 1, n - 1  # 0, 1, n - 1, 2, n - 2, ...
    for j in range(1, n):
        if j % 2:
            base.append(low)
            low += 1
        else:
            base.append(high)
            high -= 1
    return [(b + r) % n for b in base[:n]]


def paired_speedup(base_s: list[float], method_s: list[float]) -> float:
    """Median over timed rounds of base_s[r] / method_s[r], seconds for the same work in
    round r (`paired_ratios`). Both ran side by side in each round, so a load that slows a
    whole round cancels in its ratio; a ratio of the medians keeps it (the medians can
    come from different rounds), which read identical programs as 0.94-0.98x on a noisy
    host."""
    return statistics.median(paired_ratios(base_s, method_s))


def paired_ratios(base_s: list[float], method_s: list[float]) -> list[float]:
    """[rounds] base_s[r] / method_s[r], the per-round ratios `paired_speedup` takes the
    median of; rounds that do not pair up, or a time that is not positive, are an error."""
    if len(base_s) != len(method_s) or not base_s:
        raise ValueError(f"paired rounds need equal, non-empty lists; got {len(base_s)} "
                         f"base and {len(method_s)} method rounds")
    if min(base_s) <= 0 or min(method_s) <= 0:
        raise ValueError(f"round times must be positive; got {base_s} and {method_s}")
    return [b / m for b, m in zip(base_s, method_s)]
