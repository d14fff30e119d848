"""What XLA:CPU's matmuls cost at the few rows a verify forward feeds them.

A verify forward of T tokens multiplies every weight matrix by T rows. Where those
matmuls stayed memory-bound (one read of the weights for all T rows), verifying a few
tokens would cost about one decode step and speculation would pay at modest acceptance.
This script times the target's MLP (gate, up, down for every layer, random weights of
its shapes, each layer's matrices their own arrays as in the CPU decode layout) at T
rows, side by side: one GEMM per matrix as XLA compiles it, the same without XLA:CPU's
YNNPACK fusions, T one-row GEMVs per matrix, and specjax's few-row kernel
(`specjax.rows_matmul`, what the CPU decode layout runs; XLA's GEMM above its
`MAX_ROWS`, or above `--kernel-max-rows`, which finds where the kernel stops paying);
interleaved rounds in a seeded order, each program timed right after an untimed run of
itself, medians. Other XLA:CPU backends are tried by setting `XLA_FLAGS` for the whole
run.

`--attention` puts each layer's attention projections before its MLP (q and o of
[D, D], k and v of [D, KV]; their outputs mixed elementwise, no attention itself) and
compares two GEMM forms instead: q, k and v as three matmuls, or as one over their
concatenation (`specjax.model.fuse_qkv` on the same params, as the CPU decode layout
holds them).

  python -m specjax.bench.matmul_rows [--hidden 576] [--intermediate 1536] [--layers 30]
      [--rows 1,2,3,5,9,17] [--repeats 15] [--attention [--kv-width 192]]
      [--kernel-max-rows 32]
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rows_matmul
from specjax.calibrate import NO_YNN
from specjax.cli_args import at_least_one, comma_list
from specjax.model import fuse_qkv
from specjax.models.transformer import FUSED_QKV
from specjax.timing import interleaved_medians

FORMS = ("gemm", "gemm, no YNNPACK", "per-row GEMVs", "rows kernel")
ATTENTION_FORMS = ("q/k/v separate", "q/k/v fused")


def mlp_weights(hidden: int, intermediate: int, layers: int, seed: int = 0,
                kv_width: int | None = None) -> list[dict]:
    """Per layer {gate, up: [D, F], down: [F, D]} float32, seeded; separate arrays. With
    `kv_width` also "self_attn", the attention projections as a model layer holds them
    ({q_proj, o_proj: {"kernel": [D, D]}, k_proj, v_proj: {"kernel": [D, KV]}})."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    def layer():
        out = {"gate": w(hidden, intermediate), "up": w(hidden, intermediate),
               "down": w(intermediate, hidden)}
        if kv_width is not None:
            widths = {"q_proj": hidden, "k_proj": kv_width, "v_proj": kv_width,
                      "o_proj": hidden}
            out["self_attn"] = {n: {"kernel": w(hidden, o)} for n, o in widths.items()}
        return out

    return [layer() for _ in range(layers)]


def _gemm(x, w):  # [T, I] @ [I, O] -> [T, O]
    return x @ w


def _per_row(x, w):  # the same product as T one-row matmuls
    return jnp.concatenate([x[t:t + 1] @ w for t in range(x.shape[0])], axis=0)


def _attention(matmul: Callable, x, attn: dict):
    """x [T, D] -> the layer's q/k/v products mixed elementwise, through o (no softmax:
    the projections' matmuls are what is timed)."""
    kernel = lambda n: attn[n]["kernel"]
    if FUSED_QKV in attn:
        d = kernel("o_proj").shape[0]
        kv = (kernel(FUSED_QKV).shape[1] - d) // 2
        q, k, v = jnp.split(matmul(x, kernel(FUSED_QKV)), [d, d + kv], axis=-1)
    else:
        q, k, v = (matmul(x, kernel(n)) for n in ("q_proj", "k_proj", "v_proj"))
    return matmul(q * jnp.sum(k * v, axis=-1, keepdims=True), kernel("o_proj"))


def mlp_stack(matmul: Callable) -> Callable:
    """x [T, D], weights -> x after every layer's residual MLP (after its residual
    attention projections where the layer has them), each product by `matmul`."""

    def run(x, weights):
        for layer in weights:
            if "self_attn" in layer:
                x = x + _attention(matmul, x, layer["self_attn"])
            h = jax.nn.silu(matmul(x, layer["gate"])) * matmul(x, layer["up"])
            x = x + matmul(h, layer["down"])
        return x

    return run


def compiled(form: str, x, weights, kernel_max_rows: int = rows_matmul.MAX_ROWS):
    """`form`'s program for x's row count, compiled (an attention form takes the
    weights `form_weights` gives it; the kernel runs up to `kernel_max_rows` rows)."""
    kernel = functools.partial(rows_matmul.matmul, max_rows=kernel_max_rows, race=False)
    fn = mlp_stack({"per-row GEMVs": _per_row, "rows kernel": kernel}.get(form, _gemm))
    lowered = jax.jit(fn).lower(x, weights)
    return lowered.compile(compiler_options=NO_YNN if "no YNNPACK" in form else None)


def form_weights(form: str, weights: list[dict]) -> list[dict]:
    """The weights `form` multiplies: q/k/v fused by the decode layout's `fuse_qkv` for
    "q/k/v fused" (once, outside any timed program)."""
    if form != "q/k/v fused":
        return weights
    return [dict(layer, self_attn=fuse_qkv(layer["self_attn"])) for layer in weights]


def measure(weights: list[dict], rows: tuple[int, ...], repeats: int, seed: int = 0,
            forms: tuple[str, ...] = FORMS,
            kernel_max_rows: int = rows_matmul.MAX_ROWS) -> dict[tuple[str, int], float]:
    """Median seconds of each (form, T), over `repeats` interleaved rounds."""
    rng = np.random.default_rng(seed)
    hidden = weights[0]["gate"].shape[0]
    per_form = {form: form_weights(form, weights) for form in forms}
    programs = {}
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, hidden), np.float32))
        for form in forms:
            fn = compiled(form, x, per_form[form], kernel_max_rows)
            fn(x, per_form[form]).block_until_ready()
            programs[form, t] = (fn, (x, per_form[form]))
    return interleaved_medians(programs, repeats)


def markdown(seconds: dict[tuple[str, int], float], rows: tuple[int, ...],
             weight_bytes: int, forms: tuple[str, ...] = FORMS) -> str:
    """The table: ms and cost relative to the first form at the first T, per form and T."""
    base = seconds[forms[0], rows[0]]
    head = "| T | " + " | ".join(f"{f}, ms | ×" for f in forms) + " |"
    lines = [head, "|---:|" + "---:|---:|" * len(forms)]
    for t in rows:
        cells = " | ".join(f"{seconds[f, t] * 1e3:.2f} | {seconds[f, t] / base:.2f}"
                           for f in forms)
        lines.append(f"| {t} | {cells} |")
    gbs = weight_bytes / base / 1e9
    lines.append(f"\n{forms[0]} at T = {rows[0]} reads the {weight_bytes / 1e6:.0f} MB of "
                 f"weights at {gbs:.1f} GB/s (× = cost over its time)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.matmul_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576, help="D (SmolLM2-135M: 576)")
    ap.add_argument("--intermediate", type=int, default=1536, help="F (SmolLM2-135M: 1536)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,5,9,17", help="T values; the first is the base")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds")
    ap.add_argument("--attention", action="store_true",
                    help="add each layer's q/k/v/o projections; compare q/k/v separate "
                         "and fused")
    ap.add_argument("--kv-width", type=int, default=192,
                    help="k and v projections' width with --attention (SmolLM2-135M: 192)")
    ap.add_argument("--kernel-max-rows", type=int, default=rows_matmul.MAX_ROWS,
                    help="the rows kernel form runs the kernel up to this many rows "
                         f"(default: its MAX_ROWS, {rows_matmul.MAX_ROWS})")
    args = ap.parse_args(argv)
    rows = tuple(comma_list(ap, "--rows", args.rows, int, minimum=1))
    at_least_one(ap, args, ("hidden", "intermediate", "layers", "repeats", "kv_width",
                            "kernel_max_rows"))
    forms = ATTENTION_FORMS if args.attention else FORMS
    if "rows kernel" in forms and not rows_matmul.available():
        forms = tuple(f for f in forms if f != "rows kernel")  # it warned why
    weights = mlp_weights(args.hidden, args.intermediate, args.layers,
                          kv_width=args.kv_width if args.attention else None)
    seconds = measure(weights, rows, args.repeats, forms=forms,
                      kernel_max_rows=args.kernel_max_rows)
    nbytes = sum(int(a.nbytes) for a in jax.tree.leaves(weights))
    print(markdown(seconds, rows, nbytes, forms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
