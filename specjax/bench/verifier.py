"""What the verifier costs per speculative step, apart from the target's forward.

Times the jitted `specjax.verify.verify` (rejection sampling at T = 1, the greedy walk at
T = 0) on chains of k drafts over SmolLM2's vocabulary (49,152), batch 1 and 4, in two
cases: every draft accepted (the target's logits peak on each draft) and the first
rejected (random logits). Cells are interleaved over repeats and the medians printed.
It imports only `specjax.tree`, `specjax.sampling` and `specjax.verify`, so running this
file with another checkout first on PYTHONPATH times that checkout's verifier:

  python -m specjax.bench.verifier [--chains 1,4,8,16] [--batches 1,4] [--vocab 49152]
      [--repeats 15]
  PYTHONPATH=../specjax-old python specjax/bench/verifier.py   # the same cells, before
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib, tree as tree_lib
from specjax.verify import verify


def chain_case(batch: int, k: int, vocab: int, accepted: bool, seed: int = 0):
    """(logits [B, k+1, V], chain tree of k drafts): logits peaked on each draft token
    (every draft accepted at T <= 1) or plain normal noise (the first draft rejected
    with probability ~1 - 1/V)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, k))
    logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32)
    if accepted:
        rows, cols = np.meshgrid(np.arange(batch), np.arange(k), indexing="ij")
        logits[rows, cols, tokens] = 30.0
    return jnp.asarray(logits), tree_lib.chain(jnp.asarray(tokens, jnp.int32))


def time_cells(cells: dict, repeats: int) -> dict:
    """{name: median ms} of `fn()` per cell, the cells interleaved over `repeats`."""
    for fn in cells.values():
        jax.block_until_ready(fn())  # compiles
    times = {name: [] for name in cells}
    for _ in range(repeats):
        for name, fn in cells.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def cells(chains, batches, vocab: int) -> dict:
    """{(batch, k, accepted, temperature): a call of the jitted verifier}."""
    fn = jax.jit(lambda logits, tree, sampling, key: verify(logits, tree, sampling, key))
    out = {}
    for b in batches:
        keys = jax.random.split(jax.random.key(0), b)
        for k in chains:
            for accepted in (True, False):
                logits, tree = chain_case(b, k, vocab, accepted)
                for t in (0.0, 1.0):
                    s = sampling_lib.Sampling.create(t)
                    out[(b, k, accepted, t)] = (
                        lambda logits=logits, tree=tree, s=s, keys=keys:
                        fn(logits, tree, s, keys))
    return out


def ints(text: str) -> list[int]:
    # not specjax.cli_args.comma_list: this file must run against older checkouts, so it
    # imports nothing beyond tree, sampling and verify
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=ints, default=[1, 4, 8, 16])
    ap.add_argument("--batches", type=ints, default=[1, 4])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if min(args.chains) < 1 or min(args.batches) < 1 or args.vocab < 2 or args.repeats < 1:
        ap.error(f"--chains {args.chains}, --batches {args.batches} must be >= 1, "
                 f"--vocab {args.vocab} >= 2, --repeats {args.repeats} >= 1")
    res = time_cells(cells(args.chains, args.batches, args.vocab), args.repeats)
    print("| batch | drafts | case | T = 0 ms | T = 1 ms |\n|---:|---:|---|---:|---:|")
    for b in args.batches:
        for k in args.chains:
            for accepted in (True, False):
                case = "all accepted" if accepted else "first rejected"
                print(f"| {b} | {k} | {case} | {res[(b, k, accepted, 0.0)]:.2f} | "
                      f"{res[(b, k, accepted, 1.0)]:.2f} |")


if __name__ == "__main__":
    main()
