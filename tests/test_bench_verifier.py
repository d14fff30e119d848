"""The verifier's timing script (`specjax.bench.verifier`): its cases mean what they
say, its table prints, bad arguments exit naming the value."""

from __future__ import annotations

import jax
import pytest

from specjax import sampling as sampling_lib
from specjax.bench import verifier
from specjax.verify import verify


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cases_accept_all_or_none(temperature):
    keys = jax.random.split(jax.random.key(0), 2)
    s = sampling_lib.Sampling.create(temperature)
    for accepted, want in ((True, 5), (False, 0)):
        logits, tree = verifier.chain_case(2, 5, 512, accepted)
        res = verify(logits, tree, s, keys)
        assert res.num_accepted.tolist() == [want, want]


def test_main_prints_every_cell(capsys):
    verifier.main(["--chains", "1,3", "--batches", "2", "--vocab", "64", "--repeats", "1"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 2 |")]
    assert len(rows) == 4 and "| 2 | 3 | first rejected |" in rows[-1]


@pytest.mark.parametrize("argv, named", [(["--chains", "0,2"], "--chains [0, 2]"),
                                         (["--batches", "x"], "'x'")])
def test_bad_arguments_exit_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        verifier.main(argv)
    assert e.value.code != 0 and named in capsys.readouterr().err
