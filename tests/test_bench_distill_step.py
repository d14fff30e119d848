"""specjax.bench.distill_step: each size runs the trainer's own step (its state carried
from call to call), the table reads against the whole vocabulary, bad flags name
themselves."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.bench import distill_step
from specjax.config import tiny_llama


def test_each_size_steps_its_own_draft():
    target = specjax.init_model(tiny_llama(vocab_size=128, num_layers=3), seed=0)
    kept = tuple(range(0, 128, 2))
    progs = distill_step.programs(target, (0, 2), {"all": None, 64: kept}, batch=2,
                                  seq_len=8)
    assert set(progs) == {"all", 64, "target forward"}
    fn, args = progs["target forward"]
    assert fn(*args).shape == (2, 8, 128)
    for size in ("all", 64):
        run, _ = progs[size]
        first, second = float(run()), float(run())
        assert np.isfinite(first) and first != second, size  # the state moved on
    table = distill_step.report({"all": 2.0, 64: 1.5, "target forward": 1.0})
    assert "| 64 ids | 1.50 | 0.75× |" in table and "| target forward | 1.00 | – |" in table


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--sizes", "all,x"], "'x' is neither 'all' nor an integer"),
    (["--layers", "0,a"], "--layers='0,a' must be comma-separated integers"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit):
        distill_step.main(argv)
    assert message in capsys.readouterr().err
