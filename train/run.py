"""The gin front end of `train/`: run one configured job.

    python -m specjax.train.run configs/experiments/pretrain_mini_stdlib.gin --workdir runs/mini \\
        --gin "trainer.TrainConfig.steps = 200"

Library modules never import gin; the .gin files name them through
`from __gin__ import dynamic_registration`. A run file says which job runs with
`run.launch.job = @jobs.pretrain` (or `@jobs.distill`). Unknown or misspelled
bindings are errors (`skip_unknown=False`), and `%gin.REQUIRED` values must be bound.
The full config is written to `<workdir>/config.gin` (a previous, different one is
kept as `config.gin.<n>`). Gin files written before `train/` installed as
`specjax.train` (`from train import jobs`) still parse, so old run directories resume
(`upgrade_gin`). jax's persistent compilation cache is on, as for `specjax
run` (`--compilation-cache DIR|off`, `specjax.compile_cache`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import gin

CONFIGS_ROOT = Path(__file__).resolve().parent.parent / "configs"
GIN_FILE = "config.gin"
_search_paths: set[str] = set()
# `from train import jobs`: the module names of run directories from before specjax.train
_LEGACY_IMPORT = re.compile(r"^from\s+((?:train|pallas_kernels)(?:\.\w+)*)\s+import\s+(\w+)",
                            re.M)
_MOVED = {"train.corpus": "specjax.corpus"}  # modules that left train/ for the library


def _upgraded_import(m: re.Match) -> str:
    module = f"{m[1]}.{m[2]}"
    if module in _MOVED:
        parent, name = _MOVED[module].rsplit(".", 1)
        return f"from {parent} import {name}"
    return f"from specjax.{m[1]} import {m[2]}"


def upgrade_gin(text: str) -> str:
    """Gin text with the module names of old run directories (top-level `train`,
    `pallas_kernels`) renamed to the installed ones (`specjax.train`, `specjax.corpus`)."""
    return _LEGACY_IMPORT.sub(_upgraded_import, text)


def launch(workdir: str, job: Callable[..., Any]) -> Any:
    """The gin entry point: calls the configured `job` on `workdir`."""
    return job(workdir=workdir)


class _QuietIncludeLookups(logging.Filter):
    """gin logs an ERROR for every search-path prefix an include is not found under."""

    def filter(self, record):
        return not record.getMessage().startswith("Path not found:")


def _module_file_exists(check: Callable[[str], bool]) -> Callable[[str], bool]:
    """gin's check for an include inside an importable package, False where it would
    crash: a folder on sys.path named like an include's first part (a `runs/` workdir
    in the current directory beside `include 'runs/data.gin'`) imports as a namespace
    package without a file, which gin 0.5 passes to os.path and fails on."""
    def exists(path: str) -> bool:
        try:
            return check(path)
        except TypeError:
            return False
    return exists


@contextlib.contextmanager
def _quiet_gin_lookups():
    """gin's include lookups without its ERROR per search-path miss, and without its
    crash on a namespace package (`_module_file_exists`)."""
    flt = _QuietIncludeLookups()
    root = logging.getLogger()
    root.addFilter(flt)
    readers = list(gin.config._FILE_READERS)  # no public API wraps a registered reader
    gin.config._FILE_READERS[:] = [(read, _module_file_exists(check)) for read, check in readers]
    try:
        yield
    finally:
        gin.config._FILE_READERS[:] = readers
        root.removeFilter(flt)


def parse(gin_files: Sequence[str | Path], bindings: Sequence[str] = (), *,
          finalize: bool = True, search_paths: Sequence[str | Path] = ()) -> None:
    """Clears gin and parses `gin_files` then `bindings`. Includes (`include
    'models/tiny.gin'`) resolve against `search_paths`, then `CONFIGS_ROOT`."""
    gin.clear_config()
    for path in (*search_paths, CONFIGS_ROOT):
        if str(path) not in _search_paths:
            gin.add_config_file_search_path(str(path))
            _search_paths.add(str(path))
    for f in gin_files:
        if not Path(f).exists():
            raise FileNotFoundError(f"gin file {str(f)!r} does not exist")
    texts = [Path(f).read_text() for f in gin_files]
    with _quiet_gin_lookups():
        if not any(_LEGACY_IMPORT.search(t) for t in texts):
            gin.parse_config_files_and_bindings([str(f) for f in gin_files], list(bindings),
                                                finalize_config=finalize, skip_unknown=False)
            return
        for text in texts:  # an old run's config.gin: parsed with the modules renamed
            gin.parse_config(upgrade_gin(text), skip_unknown=False)
        gin.parse_config(list(bindings), skip_unknown=False)
        if finalize:
            gin.finalize()


def _save_gin(workdir: Path, text: str) -> None:
    path = workdir / GIN_FILE
    if path.exists() and upgrade_gin(path.read_text()) != text:
        n = 1
        while (workdir / f"{GIN_FILE}.{n}").exists():
            n += 1
        path.rename(workdir / f"{GIN_FILE}.{n}")
        logging.getLogger("specjax.train").warning("%s changed; the previous one is %s.%d", path,
                                           GIN_FILE, n)
    path.write_text(text)


def run_config(gin_file: str | Path, bindings: Sequence[str] = (), *,
               workdir: str | Path) -> Any:
    """Parses `gin_file` + `bindings` and runs the job it configures in `workdir`."""
    parse([gin_file], bindings)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    _save_gin(workdir, gin.config_str())
    return gin.get_configurable(launch)(workdir=str(workdir))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specjax.train.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gin_file")
    parser.add_argument("--workdir", required=True, help="run directory (resumed if it exists)")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING",
                        help="extra gin binding, e.g. 'trainer.TrainConfig.steps = 10'")
    parser.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                        help="jax's persistent compilation cache (default: "
                             "$SPECJAX_COMPILATION_CACHE, else ~/.cache/specjax/jax)")
    args = parser.parse_args(argv)
    from specjax import compile_cache

    try:
        compile_cache.enable(args.compilation_cache)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("specjax.train").setLevel(logging.INFO)
    result = run_config(args.gin_file, args.gin, workdir=args.workdir)
    if not hasattr(result, "train"):  # a job that trains nothing (jobs.offline_features)
        print(result)
        return
    print(f"workdir: {result.workdir}\nexport: {result.export_dir}\neval: {result.train.eval}")
    speculative = result.summary.get("speculative")
    if speculative:  # heads runs: the end-of-run generation through their speculator
        print(f"speculative (greedy, {speculative['prompts']} prompts): "
              f"alpha={speculative['alpha']:.3f} tau={speculative['tau']:.2f}")


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: gin registered the
    # functions of `specjax.train.run`, and `launch` must be that one.
    from specjax.train.run import main as _main

    _main()
