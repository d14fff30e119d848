"""What the few-row matmul kernels' races against XLA's matmul see on this machine: for
each weight shape of a model, the weight bytes each form reads per second at 1, 5 and
17 rows (`specjax.rows_matmul.race_times`, the timing `kernel_wins` and
`transposed_wins` decide by, with more rounds): the [I, O] kernel, the transposed-weight
kernel on the same weights stored [O, I] (what the CPU decode layout stores where it
wins) and XLA's product, and the verdicts the races would give (the transposed kernel's
against the winner of the other two). SmolLM2-135M's shapes by default
(q/o, k/v, the fused q/k/v, gate/up, down, LM head), from its config; no weights are loaded.

`--kernel-forms` times the kernel's two forms for 2-8 rows against each other instead
(register blocks, and the sweep it takes for wide weights at few rows,
`rows_matmul.sweeps`), on the same copies of each weight: the figures its width rule
rests on.

  python -m specjax.bench.matmul_race [--hidden 576] [--intermediate 1536] [--kv-width 192]
      [--vocab 49152] [--rows 1,5,17] [--rounds 9] [--kernel-forms [--rows 2,3,4,5,8]]
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from specjax import rows_matmul
from specjax.cli_args import comma_list

FORM_ROWS = (2, 3, 4, 5, 8)  # --kernel-forms' default row counts


def shapes(hidden: int, intermediate: int, kv_width: int, vocab: int) -> dict:
    """{name: (in, out)} of a Llama-family model's weight shapes (q/k/v: fused, as the
    decode layout multiplies them, `specjax.model.fuse_qkv`)."""
    return {"q/o": (hidden, hidden), "k/v": (hidden, kv_width),
            "q/k/v": (hidden, hidden + 2 * kv_width),
            "gate/up": (hidden, intermediate), "down": (intermediate, hidden),
            "LM head": (hidden, vocab)}


def rows_of(name: str, shape: tuple[int, int], times: dict) -> list[dict]:
    """One row per row count: GB/s of weights each form read, and the shape's verdicts
    (each race sums the times over row counts; where "transposed" was timed, its race
    is against the [I, O] weight's winner, as `rows_matmul.transposed_wins` races)."""
    nbytes = rows_matmul.race_copies(shape) * shape[0] * shape[1] * 4
    wins = rows_matmul.verdict(times)
    out = []
    for r, t in times.items():
        row = dict(weight=name, shape=f"{shape[0]}x{shape[1]}", rows=r,
                   kernel_gbs=nbytes / t["kernel"] / 1e9, xla_gbs=nbytes / t["xla"] / 1e9,
                   verdict="kernel" if wins else "XLA")
        if "transposed" in t:
            rival = "kernel" if wins else "xla"
            wins_t = rows_matmul.verdict(times, "transposed", rival)
            row.update(transposed_gbs=nbytes / t["transposed"] / 1e9,
                       verdict_t="transposed" if wins_t else row["verdict"])
        out.append(row)
    return out


def form_rows(name: str, shape: tuple[int, int], times: dict) -> list[dict]:
    """One row per row count: GB/s of weights each kernel form read, and the form the
    kernel takes there by the weight's width."""
    nbytes = rows_matmul.race_copies(shape) * shape[0] * shape[1] * 4
    return [dict(weight=name, shape=f"{shape[0]}x{shape[1]}", rows=r,
                 blocks_gbs=nbytes / t["register blocks"] / 1e9,
                 sweep_gbs=nbytes / t["sweep"] / 1e9,
                 takes="sweep" if rows_matmul.sweeps(r, shape[1]) else "register blocks")
            for r, t in times.items()]


def forms_markdown(rows: list[dict]) -> str:
    lines = ["| weight | shape | rows | register blocks GB/s | sweep GB/s | sweep time / "
             "blocks | the kernel takes |", "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['weight']} | {r['shape']} | {r['rows']} | {r['blocks_gbs']:.2f} | "
              f"{r['sweep_gbs']:.2f} | {r['blocks_gbs'] / r['sweep_gbs']:.2f} | "
              f"{r['takes']} |" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    t = all("transposed_gbs" in r for r in rows)
    lines = ["| weight | shape | rows | kernel GB/s | XLA GB/s | kernel / XLA | race picks |"
             + (" transposed GB/s | transposed / XLA | its race picks |" if t else ""),
             "|---|---|---:|---:|---:|---:|---|" + ("---:|---:|---|" if t else "")]
    lines += [f"| {r['weight']} | {r['shape']} | {r['rows']} | {r['kernel_gbs']:.2f} | "
              f"{r['xla_gbs']:.2f} | {r['kernel_gbs'] / r['xla_gbs']:.2f} | {r['verdict']} |"
              + (f" {r['transposed_gbs']:.2f} | {r['transposed_gbs'] / r['xla_gbs']:.2f} | "
                 f"{r['verdict_t']} |" if t else "") for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.matmul_race",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--hidden", 576), ("--intermediate", 1536), ("--kv-width", 192),
                          ("--vocab", 49152)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--rows", default=None, help="row counts (default: the race's "
                    f"{','.join(map(str, rows_matmul.RACE_ROWS))}; with --kernel-forms "
                    f"{','.join(map(str, FORM_ROWS))})")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--kernel-forms", action="store_true",
                    help="time the kernel's register blocks against its sweep at 2-8 rows")
    args = ap.parse_args(argv)
    rows = (tuple(comma_list(ap, "--rows", args.rows, int, minimum=1)) if args.rows
            else tuple(FORM_ROWS if args.kernel_forms else rows_matmul.RACE_ROWS))
    if args.kernel_forms and not all(2 <= r <= rows_matmul.FEW_ROWS for r in rows):
        ap.error(f"--rows={args.rows} with --kernel-forms: the forms differ at 2-"
                 f"{rows_matmul.FEW_ROWS} rows only")
    dims = (args.hidden, args.intermediate, args.kv_width, args.vocab, args.rounds)
    if min(dims) < 1:
        ap.error(f"sizes and --rounds must be >= 1, got {dims}")
    if not (rows_matmul.available() and rows_matmul.available_t()):
        print("the few-row matmul kernels are not available here (no C++ compiler, or "
              f"{rows_matmul.ENV}=off)", file=sys.stderr)
        return 2
    out = []
    race_forms = {"kernel": rows_matmul._rows, "transposed": rows_matmul.transposed_product,
                  "xla": jnp.matmul}
    forms = {name: rows_matmul.in_form(name) for name in ("register blocks", "sweep")}
    for name, shape in shapes(*dims[:4]).items():
        if args.kernel_forms:
            out += form_rows(name, shape, rows_matmul.race_times(shape, rows, args.rounds,
                                                                 forms=forms))
        else:
            out += rows_of(name, shape, rows_matmul.race_times(shape, rows, args.rounds,
                                                               forms=race_forms))
    print(forms_markdown(out) if args.kernel_forms else markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
