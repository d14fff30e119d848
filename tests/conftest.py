"""Shared fixtures: tiny random models, built locally and seeded (no downloads)."""

import contextlib
import os
import shutil
import tempfile

# The suite's time is almost all XLA:CPU compilation of tiny programs; cheaper backend
# passes compile them ~2.5x faster (numerics are unchanged: the same HLO ops run), and at
# that level XLA:CPU's older elemental emitters compile the decode loops faster than its
# MLIR fusion emitters (at the default level they are slower: users keep XLA's
# defaults). Set before jax is imported; subprocesses and notebook kernels
# inherit it (tests/multidevice.py adds its device count to it).
# option: (the suite's value, XLA's default); the defaults serve `real_decode_options`
_COMPILE_OPTIONS = {"xla_backend_optimization_level": (0, 3),
                    "xla_llvm_disable_expensive_passes": (True, False),
                    "xla_cpu_use_fusion_emitters": (False, True)}
_FAST_COMPILE = " ".join(f"--{name}={str(fast).lower()}"
                         for name, (fast, _) in _COMPILE_OPTIONS.items())
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()
# Many tests compile the same programs (the same tiny models at the same shapes, in other
# modules after each module's caches are dropped, and in the other xdist worker): jax's
# persistent compilation cache, in one temporary directory per run, compiles each once.
# The process that creates the directory removes it at the end; xdist workers and
# subprocesses inherit the variable, and every process that imports this conftest or
# runs the CLI (which reads the same variable, so nothing is written to ~/.cache)
# turns the cache on there. Set it to a directory to keep the cache, or to `off`.
_RUN_CACHE = None
if not os.environ.get("SPECJAX_COMPILATION_CACHE"):
    _RUN_CACHE = tempfile.mkdtemp(prefix="specjax-tests-jax-cache-")
    os.environ["SPECJAX_COMPILATION_CACHE"] = _RUN_CACHE

# The few-row matmul kernel races XLA's matmul per weight shape before its first use
# (`specjax.rows_matmul.kernel_wins`); the tests take it wherever it applies, so that
# they test it, and what they assert does not hang on this machine's race.
os.environ.setdefault("SPECJAX_CPU_MATMUL", "on")

import numpy as np
import pytest

try:
    import specjax
    import specjax.pallas_kernels  # noqa: F401
    import specjax.train  # noqa: F401
except ModuleNotFoundError as e:  # a source checkout that is not installed
    if e.name not in ("specjax.pallas_kernels", "specjax.train"):
        raise
    raise pytest.UsageError(
        "specjax.train and specjax.pallas_kernels are the root folders train/ and "
        "pallas_kernels/, mapped by the install: run `pip install -e '.[test]'` first "
        f"({e})") from e
from specjax.config import tiny_llama

specjax.compile_cache.enable()


# The longest test files (2-core CPU, 2026-11-29: 10, 5, 3 min... down to 1 min), run
# first. xdist hands out whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`: by default it orders them by their number of tests, which
# put the one-test notebooks and the few-test quickstart last, running alone for
# minutes after the other worker had finished); longest first, the short files at the
# end fill the gaps. A file missing here only runs later.
_LONGEST_FIRST = ("tests/test_speculative.py", "tests/test_speculators_heads.py",
                  "tests/test_quickstart.py", "tests/test_bench_suite.py",
                  "tests/test_sharding.py", "tests/test_draft_vocab.py",
                  "tests/test_real_smollm2.py", "tests/test_export.py",
                  "tests/test_train_heads.py", "tests/test_decode_outputs.py",
                  "tests/test_verify_exact.py", "tests/test_models.py",
                  "notebooks/01_quickstart.ipynb", "tests/test_kv_quant.py",
                  "tests/test_seeds.py", "notebooks/04_smollm2.ipynb",
                  "tests/test_example_speculator.py",
                  "notebooks/02_train_eagle_head.ipynb", "tests/test_train_sharding.py")


def pytest_collection_modifyitems(config, items):
    """The files in `_LONGEST_FIRST` first, in its order; the rest after, as collected."""
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config):
    """In a full parallel run (the README's command), the xdist controller, otherwise idle,
    builds speculators' venv in the background from the start (`tests/speculators_env.py`;
    its file lock makes test_export's tests wait for it rather than build it again), so a
    clean machine does not wait for pip inside a test. A failed build is left to those
    tests, which build again and report it."""
    if (hasattr(config, "workerinput") or not config.getoption("numprocesses", 0)
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS
            or config.option.keyword):  # a -k selection may not reach the export tests
        return
    import threading

    from tests.speculators_env import speculators_python

    def build():
        try:
            speculators_python()
        except Exception:  # noqa: BLE001 - the tests that need it build and report it
            pass

    threading.Thread(target=build, name="speculators-venv", daemon=True).start()


def pytest_unconfigure(config):
    """Removes the run's cache directory, in the process that created it."""
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_target():
    return specjax.init_model(tiny_llama(vocab_size=128), seed=0)


@pytest.fixture(scope="session")
def tiny_draft():
    return specjax.init_model(tiny_llama(vocab_size=128, num_layers=1, hidden_size=32,
                                         intermediate_size=64, num_heads=2, num_kv_heads=1),
                              seed=1)


def bfloat16_model(config, seed: int):
    """`init_model(config, seed)` with every param cast to bfloat16."""
    import jax

    model = specjax.init_model(config, seed=seed)
    return specjax.Model(config, jax.tree.map(lambda a: a.astype("bfloat16"), model.params))


def self_drafting_emits_plain(model, prompts, new_tokens: int, **kwargs):
    """`model` drafting for itself (`DraftModel`, k = 4, every step at full depth) emits
    plain decoding's tokens, and its verifies took drafts; returns the speculative run."""
    from specjax.speculators import DraftModel

    plain = specjax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True)
    out = specjax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                           speculator=DraftModel.create(model, k=4), adaptive=False, **kwargs)
    assert out.tokens == plain.tokens
    assert out.stats.accepted > out.stats.target_calls  # verifies took drafts
    return out


def greedy_reference(model, prompt, n):
    """Target-only greedy continuation by repeated full forwards (no cache, no loop)."""
    seq = list(prompt)
    width = -(-(len(prompt) + n) // 32) * 32  # one padded shape: causal, so padding is inert
    for _ in range(n):
        padded = seq + [0] * (width - len(seq))
        logits = np.asarray(specjax.forward(model, [padded]))[0, len(seq) - 1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


# notebooks/01_quickstart.ipynb's small run decodes these prompts with `tiny_target`'s and
# `tiny_draft`'s configs as test_speculative.py does, so it runs their compiled programs
# (the run's persistent cache) instead of compiling its own
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10] * 20, [3, 4, 5, 3, 4, 5, 3, 4]]


def flat_verify_cost(v: float):
    """At batch 4 (PROMPTS): a plain step costs 1, any verify forward (8+ tokens) `v`
    plain steps, so a test can put drafting just out of reach or within it."""
    from specjax.decoding.cost import VerifyCost

    return VerifyCost.from_table({1: 1.0, 4: 1.0, 5: v, 10_000: v})


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Drops every compiled program after each test module. One pytest process compiles
    hundreds of programs; keeping them all alive (jax's caches and `generate`'s) grew
    XLA:CPU's state until a late compile crashed in the full run (never in isolation)."""
    yield
    import jax

    from specjax.decoding.generate import LAYOUTS, PROGRAMS

    PROGRAMS.clear()
    LAYOUTS.clear()
    jax.clear_caches()


@pytest.fixture(scope="module")
def real_decode_options():
    """generate's programs compiled with XLA's defaults for the suite's options
    (per compilation, `specjax.xla_options`) in a module that decodes a real checkpoint:
    SmolLM2's 64 greedy steps at batch 4 run ~3.5x faster there, which outweighs their
    longer compile."""
    from specjax import xla_options

    defaults = {name: default for name, (_, default) in _COMPILE_OPTIONS.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(xla_options.DECODE_OPTIONS, "cpu",
                   {**xla_options.DECODE_OPTIONS["cpu"], **defaults})
        yield


@contextlib.contextmanager
def transformers_reads_gguf_fast():
    """transformers' GGUF loaders parse the file with `gguf.GGUFReader`, as specjax does;
    inside this block they get specjax's `reader_class` (the same parsing over a plain
    view of the mapped bytes, `specjax.checkpoint.gguf.reader_class`), which opens
    SmolLM2's file in ~1.5 s instead of ~5 s, and `gguf.get_tensor_name_map` built once
    per (architecture, layers): transformers asks for it once per module of the model
    (~400 times for SmolLM2, 40 ms each; the map is only read). The reference's parse
    and names are unchanged."""
    import functools

    import gguf

    from specjax.checkpoint.gguf import reader_class

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader_class())
        mp.setattr(gguf, "get_tensor_name_map",
                   functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def slow_cases(values, slow) -> list:
    """`values` as parametrize cases, those in `slow` marked `slow` (run with -m slow)."""
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]
