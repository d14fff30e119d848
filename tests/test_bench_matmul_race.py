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
    times = {1: {"kernel": 0.002, "transposed": 0.0005, "xla": 0.001},
             5: {"kernel": 0.002, "transposed": 0.005, "xla": 0.004}}
    rows = matmul_race.rows_of("down", (64, 32), times)
    assert rows[0]["transposed_gbs"] == pytest.approx(nbytes / 0.0005 / 1e9)
    # the [I, O] kernel beat XLA (0.004 s against 0.005), so the transposed kernel races
    # it: 0.0055 s in all against 0.004
    assert {r["verdict_t"] for r in rows} == {"kernel"}
    assert "| 2.00 | kernel |" in matmul_race.markdown(rows)  # transposed / XLA at one row
    times[5]["kernel"] = 0.006  # now XLA beats the [I, O] kernel (0.005 s against 0.008)
    rows = matmul_race.rows_of("down", (64, 32), times)
    assert {r["verdict"] for r in rows} == {"XLA"}
    assert {r["verdict_t"] for r in rows} == {"XLA"}  # 0.0055 s against XLA's 0.005
    times[5]["transposed"] = 0.0042  # 0.0047 s: it beats XLA
    assert {r["verdict_t"] for r in matmul_race.rows_of("down", (64, 32), times)} == {
        "transposed"}


def test_a_small_run_prints_every_shape(capsys):
    assert matmul_race.main(["--hidden", "32", "--intermediate", "64", "--kv-width", "16",
                             "--vocab", "128", "--rows", "1,3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name, shape in (("q/o", "32x32"), ("k/v", "32x16"), ("q/k/v", "32x64"),
                        ("gate/up", "32x64"),
                        ("down", "64x32"), ("LM head", "32x128")):
        assert f"| {name} | {shape} | 3 |" in out
    assert "transposed GB/s" in out


def test_bad_flags_name_the_value(capsys):
    with pytest.raises(SystemExit):
        matmul_race.main(["--rows", "1,x"])
    assert "--rows='1,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        matmul_race.main(["--rounds", "0"])
    assert "(576, 1536, 192, 49152, 0)" in capsys.readouterr().err


def test_kernel_forms_run_every_shape_and_name_the_form_the_kernel_takes(capsys):
    """--kernel-forms: register blocks against the sweep per weight shape, and the form
    the kernel's width rule takes (`rows_matmul.sweeps`): an LM head's width sweeps at 2
    and 5 rows, gate/up's at 2 only."""
    wide, very_wide = rows_matmul.WIDE, rows_matmul.VERY_WIDE
    assert matmul_race.main(["--hidden", "32", "--intermediate", str(wide), "--kv-width",
                             "16", "--vocab", str(very_wide), "--rows", "2,5", "--rounds",
                             "1", "--kernel-forms"]) == 0
    out = capsys.readouterr().out
    assert f"| gate/up | 32x{wide} | 2 |" in out and f"| LM head | 32x{very_wide} | 5 |" in out
    assert out.count("| sweep |") == 3 and out.count("| register blocks |") == 9
    times = {2: {"register blocks": 0.004, "sweep": 0.002}}
    row = matmul_race.form_rows("LM head", (64, very_wide), times)[0]
    assert row["sweep_gbs"] == pytest.approx(2 * row["blocks_gbs"]) and row["takes"] == "sweep"


def test_kernel_forms_take_only_the_rows_where_they_differ(capsys):
    for rows in ("1,2", f"2,{rows_matmul.FEW_ROWS + 1}"):
        with pytest.raises(SystemExit):
            matmul_race.main(["--kernel-forms", "--rows", rows])
        assert f"--rows={rows} with --kernel-forms" in capsys.readouterr().err
