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


def round_order(n: int, r: int) -> np.ndarray:
    """[n] round `r`'s order of n interleaved timings: a permutation seeded by r."""
    return np.random.default_rng(r).permutation(n)
