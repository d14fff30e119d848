"""specjax.train.step_time: each size runs the trainer's own step (its state carried
from call to call), the table reads against the whole vocabulary, bad flags name
themselves."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.config import tiny_llama
from specjax.train import step_time


def test_each_size_steps_its_own_draft():
    target = specjax.init_model(tiny_llama(vocab_size=128, num_layers=3), seed=0)
    kept = tuple(range(0, 128, 2))
    progs = step_time.programs(target, (0, 2), {"all": None, 64: kept}, batch=2,
                                  seq_len=8)
    assert set(progs) == {"all", 64, "target forward"}
    fn, args = progs["target forward"]
    assert fn(*args).shape == (2, 8, 128)
    for size in ("all", 64):
        run, _ = progs[size]
        first, second = float(run()), float(run())
        assert np.isfinite(first) and first != second, size  # the state moved on
    table = step_time.report({"all": 2.0, 64: 1.5, "target forward": 1.0})
    assert "| 64 ids | 1.50 | 0.75× |" in table and "| target forward | 1.00 | – |" in table


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--kept", "0"], "--kept=0 must be >= 1"),
    (["--layers", "0,a"], "--layers='0,a' must be comma-separated integers"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit):
        step_time.main(argv)
    assert message in capsys.readouterr().err
