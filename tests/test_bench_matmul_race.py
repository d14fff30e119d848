"""`specjax.bench.matmul_race`: the race's timings per weight shape, as GB/s, with the
verdict `rows_matmul.race` reaches from the same times; bad flags named."""

import pytest

from specjax import rows_matmul
from specjax.bench import matmul_race


def test_rows_report_bytes_per_second_and_the_races_verdict(monkeypatch):
    times = {1: {"kernel": 0.002, "xla": 0.001}, 5: {"kernel": 0.002, "xla": 0.004}}
    rows = matmul_race.rows_of("down", (64, 32), times)
    nbytes = rows_matmul.race_copies((64, 32)) * 64 * 32 * 4
    assert rows_matmul.race_copies((64, 32)) == 64  # small weights: the most copies
    assert [r["rows"] for r in rows] == [1, 5]
    assert rows[0]["kernel_gbs"] == pytest.approx(nbytes / 0.002 / 1e9)
    assert rows[0]["xla_gbs"] == pytest.approx(nbytes / 0.001 / 1e9)
    assert {r["verdict"] for r in rows} == {"kernel"}  # 0.004 s in all against 0.005
    monkeypatch.setattr(rows_matmul, "race_times", lambda *a, **k: times)
    assert rows_matmul.race((64, 32)) is True
    times[5]["xla"] = 0.001  # XLA now 0.002 s in all
    assert rows_matmul.race((64, 32)) is False
    assert matmul_race.rows_of("down", (64, 32), times)[0]["verdict"] == "XLA"
    assert "| down | 64x32 | 1 |" in matmul_race.markdown(rows)


def test_a_small_run_prints_every_shape(capsys):
    assert matmul_race.main(["--hidden", "32", "--intermediate", "64", "--kv-width", "16",
                             "--vocab", "128", "--rows", "1,3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name, shape in (("q/o", "32x32"), ("k/v", "32x16"), ("q/k/v", "32x64"),
                        ("gate/up", "32x64"),
                        ("down", "64x32"), ("LM head", "32x128")):
        assert f"| {name} | {shape} | 3 |" in out


def test_bad_flags_name_the_value(capsys):
    with pytest.raises(SystemExit):
        matmul_race.main(["--rows", "1,x"])
    assert "--rows='1,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        matmul_race.main(["--rounds", "0"])
    assert "(576, 1536, 192, 49152, 0)" in capsys.readouterr().err
