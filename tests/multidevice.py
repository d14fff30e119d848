"""Runs a file of multi-device cases in a subprocess on 8 forced CPU devices.

XLA fixes the CPU device count when jax is first imported, so such cases cannot share
the main pytest process (which has one device). The files hold them under names that do
not start with `test_`, so the main run does not collect them with one device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cases(path: str, marker: str, keyword: str | None = None, timeout: int = 1500) -> None:
    """`pytest <path> -m <marker> [-k <keyword>]` with 8 CPU devices; fails with the
    subprocess's output."""
    # the suite's compile flags (tests/conftest.py sets them: codegen only, and compile
    # time dominates these cases) plus the device count
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    select = ["-m", marker] + (["-k", keyword] if keyword else [])
    # -n 0: in-process; the suite's `-n auto --dist loadfile` would start workers for one
    # file, of which one runs it all (each start imports jax: ~15 s a call)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-n", "0",
         *select],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def medusa_two_steps(model, workdir, mesh=None):
    """Two steps of online Medusa training on `model` as the frozen target (a random
    corpus; Adam eps 1e-4, see tests/train_sharding_cases.py): the run that
    `test_sharding.py::test_two_processes` makes on one device and on a two-process mesh."""
    import numpy as np

    from specjax.heads import MedusaConfig
    from specjax.train.data import TokenData
    from specjax.train.methods import TrainMedusa
    from specjax.train.optim import OptimConfig
    from specjax.train.trainer import TrainConfig, train

    rng = np.random.default_rng(0)
    data = TokenData(rng.integers(2, model.config.vocab_size, (32, 16), dtype=np.int32),
                     rng.integers(2, model.config.vocab_size, (8, 16), dtype=np.int32),
                     pad_id=0, seed=0, name="random")
    method = TrainMedusa(model.config, MedusaConfig(num_heads=2))
    config = TrainConfig(steps=2, batch_size=8, log_every=1, eval_batches=1, progress=False,
                         optim=OptimConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-4))
    return train(method, data, config, workdir, frozen=model.params,
                 init_params=method.initial_params(model.params), mesh=mesh)
