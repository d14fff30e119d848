"""What XLA:CPU's matmuls cost at the few rows a verify forward feeds them.

A verify forward of T tokens multiplies every weight matrix by T rows. Where those
matmuls stayed memory-bound (one read of the weights for all T rows), verifying a few
tokens would cost about one decode step and speculation would pay at modest acceptance.
This script times the target's MLP (gate, up, down for every layer, random weights of
its shapes, each layer's matrices their own arrays as in the CPU decode layout) at T
rows, three ways side by side: one GEMM per matrix as XLA compiles it, the same without
XLA:CPU's YNNPACK fusions, and T one-row GEMVs per matrix; interleaved rounds in a
seeded order, each program timed right after an untimed run of itself, medians. Other
XLA:CPU backends are tried by setting `XLA_FLAGS` for the whole run.

  python -m specjax.bench.matmul_rows [--hidden 576] [--intermediate 1536] [--layers 30]
      [--rows 1,2,3,5,9,17] [--repeats 15]
"""

from __future__ import annotations

import argparse
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.suite import ints
from specjax.calibrate import NO_YNN, interleaved_medians

FORMS = ("gemm", "gemm, no YNNPACK", "per-row GEMVs")


def mlp_weights(hidden: int, intermediate: int, layers: int, seed: int = 0) -> list[dict]:
    """Per layer {gate, up: [D, F], down: [F, D]} float32, seeded; separate arrays."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    return [{"gate": w(hidden, intermediate), "up": w(hidden, intermediate),
             "down": w(intermediate, hidden)} for _ in range(layers)]


def _gemm(x, w):  # [T, I] @ [I, O] -> [T, O]
    return x @ w


def _per_row(x, w):  # the same product as T one-row matmuls
    return jnp.concatenate([x[t:t + 1] @ w for t in range(x.shape[0])], axis=0)


def mlp_stack(matmul: Callable) -> Callable:
    """x [T, D], weights -> x after every layer's residual MLP, each product by `matmul`."""

    def run(x, weights):
        for layer in weights:
            h = jax.nn.silu(matmul(x, layer["gate"])) * matmul(x, layer["up"])
            x = x + matmul(h, layer["down"])
        return x

    return run


def compiled(form: str, x, weights):
    """`form`'s program for x's row count, compiled."""
    fn = mlp_stack(_per_row if form == "per-row GEMVs" else _gemm)
    lowered = jax.jit(fn).lower(x, weights)
    return lowered.compile(compiler_options=NO_YNN if "no YNNPACK" in form else None)


def measure(weights: list[dict], rows: tuple[int, ...], repeats: int,
            seed: int = 0) -> dict[tuple[str, int], float]:
    """Median seconds of each (form, T), over `repeats` interleaved rounds."""
    rng = np.random.default_rng(seed)
    hidden = weights[0]["gate"].shape[0]
    programs = {}
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, hidden), np.float32))
        for form in FORMS:
            fn = compiled(form, x, weights)
            fn(x, weights).block_until_ready()
            programs[form, t] = (fn, (x, weights))
    return interleaved_medians(programs, repeats)


def markdown(seconds: dict[tuple[str, int], float], rows: tuple[int, ...],
             weight_bytes: int) -> str:
    """The table: ms and cost relative to the one-row GEMM, per form and T."""
    base = seconds["gemm", rows[0]]
    head = "| T | " + " | ".join(f"{f}, ms | ×" for f in FORMS) + " |"
    lines = [head, "|---:|" + "---:|---:|" * len(FORMS)]
    for t in rows:
        cells = " | ".join(f"{seconds[f, t] * 1e3:.2f} | {seconds[f, t] / base:.2f}"
                           for f in FORMS)
        lines.append(f"| {t} | {cells} |")
    gbs = weight_bytes / base / 1e9
    lines.append(f"\nT = {rows[0]} reads the {weight_bytes / 1e6:.0f} MB of weights at "
                 f"{gbs:.1f} GB/s (× = cost over that GEMM's)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.matmul_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576, help="D (SmolLM2-135M: 576)")
    ap.add_argument("--intermediate", type=int, default=1536, help="F (SmolLM2-135M: 1536)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,5,9,17", help="T values; the first is the base")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds")
    args = ap.parse_args(argv)
    rows = ints(args.rows, "--rows", ap)
    for flag in ("hidden", "intermediate", "layers", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}={getattr(args, flag)} must be >= 1")
    weights = mlp_weights(args.hidden, args.intermediate, args.layers)
    seconds = measure(weights, rows, args.repeats)
    nbytes = sum(int(a.nbytes) for layer in weights for a in layer.values())
    print(markdown(seconds, rows, nbytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
