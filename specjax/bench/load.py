"""Seconds `specjax.load` takes to open a GGUF checkpoint, its file parsed by gguf's own
`GGUFReader` against `specjax.checkpoint.gguf.reader_class` (the same reader slicing a
plain view of its memory map), timed alternately in one process after a warm-up load of
each, so both see the same page cache and machine load; medians over the rounds.
`--transformers` also times transformers' `from_pretrained(..., gguf_file=)` on the
same file both ways (it parses with the same library).

  python -m specjax.bench.load [--checkpoint GGUF] [--repeats 5] [--transformers]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

STOCK, VIEW = "gguf.GGUFReader", "reader_class"


def _reader(kind: str):
    """The reader class `kind` names."""
    import gguf

    from specjax.checkpoint import gguf as specjax_gguf

    return gguf.GGUFReader if kind == STOCK else specjax_gguf.reader_class()


def load_specjax(path: Path, kind: str) -> None:
    """`specjax.load(path)` with the GGUF parsed by reader `kind`."""
    import specjax
    from specjax.checkpoint import gguf as specjax_gguf

    reader = _reader(kind)
    with mock.patch.object(specjax_gguf, "reader_class", lambda: reader):
        specjax.load(path, dtype="float32")


def load_transformers(path: Path, kind: str) -> None:
    """transformers' float32 GGUF load of `path`, parsed by reader `kind`."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # transformers imports `gguf.GGUFReader` inside its loaders, at each call
    with mock.patch.object(gguf, "GGUFReader", _reader(kind)):
        AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                             dtype=torch.float32)


def measure(loaders: dict, repeats: int) -> dict:
    """{(loader, reader): [seconds per round]}: every pair once untimed, then `repeats`
    rounds, the readers' order flipped every round."""
    pairs = [(name, kind) for name in loaders for kind in (STOCK, VIEW)]
    for name, kind in pairs:
        loaders[name](kind)
    times = {pair: [] for pair in pairs}
    for r in range(repeats):
        for name in loaders:
            for kind in (STOCK, VIEW) if r % 2 == 0 else (VIEW, STOCK):
                t0 = time.perf_counter()
                loaders[name](kind)
                times[name, kind].append(time.perf_counter() - t0)
    return times


def report(times: dict) -> str:
    lines = ["| load | parsed by | median s | range s |", "|---|---|---:|---|"]
    for (name, kind), ts in times.items():
        lines.append(f"| {name} | {kind} | {statistics.median(ts):.2f} | "
                     f"{min(ts):.2f}-{max(ts):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None,
                    help="a .gguf file (default: the packaged SmolLM2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers' GGUF load (needs torch)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    if args.checkpoint is None:
        from specjax.checkpoint.packaged import smollm2

        path = Path(smollm2())
    else:
        path = Path(args.checkpoint)
        if path.suffix != ".gguf" or not path.is_file():
            ap.error(f"--checkpoint={args.checkpoint!r} must be a .gguf file")
    loaders = {"specjax.load": lambda kind: load_specjax(path, kind)}
    if args.transformers:
        loaders["transformers"] = lambda kind: load_transformers(path, kind)
    print(f"{path.name}, median of {args.repeats} alternating rounds after a warm-up")
    print(report(measure(loaders, args.repeats)))


if __name__ == "__main__":
    main()
