"""The same-run A/B driver (`specjax.bench.ab`): each round imports the checkout it was
given, rounds alternate, and the table's ratios and token agreement are computed right."""

import pytest

from specjax.bench import ab


def _fake_checkout(root, tag):
    """A stand-in checkout: a `specjax` package with just what a round with no workloads
    touches (`compile_cache.enable`)."""
    pkg = root / "specjax"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"TAG = {tag!r}\n")
    (pkg / "compile_cache.py").write_text("def enable(path):\n    return path\n")
    kernels = root / "pallas_kernels"  # pyproject maps it to specjax.pallas_kernels
    kernels.mkdir()
    (kernels / "__init__.py").write_text(f"TAG = {tag!r}\n")
    return root


def test_a_round_imports_the_checkout_it_is_given(tmp_path):
    """PYTHONPATH puts the checkout ahead of the installed (editable) specjax, and its
    own root folders stand for the mapped subpackages (the kernels), which the editable
    install would otherwise resolve to its own checkout."""
    root = _fake_checkout(tmp_path / "old", "old")
    res = ab._one(root.resolve(), [], str(tmp_path / "cache"))
    assert res == {"_specjax": str((root / "specjax" / "__init__.py").resolve()),
                   "_kernels": str((root / "pallas_kernels" / "__init__.py").resolve())}


def test_rounds_alternate_and_rows_compare_medians(monkeypatch, tmp_path):
    before, after = tmp_path / "b", tmp_path / "a"
    calls = []
    times = {before: iter([10.0, 12.0, 11.0]), after: iter([5.0, 6.0, 4.0])}

    def fake_one(root, workloads, cache_dir, env):
        calls.append(root)
        assert env == ({"X": "1"} if root == before else {})
        digest = "x" if root == before or len(calls) < 6 else "y"
        return {"_specjax": str(root), "_kernels": str(root),
                "toy/b1/plain": (next(times[root]), digest)}

    monkeypatch.setattr(ab, "_one", fake_one)
    rows = ab.compare(before, after, ["toy"], 3, "unused", {"before": {"X": "1"}})
    assert calls == [before, after, after, before, before, after]
    (row,) = rows
    assert row["before_ms"] == 11.0 and row["after_ms"] == 5.0
    assert row["speed"] == pytest.approx(2.2)
    assert row["spread"] == pytest.approx(max(2 / 11, 2 / 5))
    assert row["same_tokens"] is False  # the last round's tokens differ
    assert "| toy/b1/plain | 11.00 | 5.00 | 2.20x | 40% | NO |" in ab.markdown(rows)


def test_a_side_runs_under_its_own_environment(tmp_path):
    """`--before-env` / `--after-env` reach that side's interpreter: one checkout can be
    compared with itself under two settings (the matmul kernel on and off)."""
    root = _fake_checkout(tmp_path / "c", "c")
    (root / "specjax" / "compile_cache.py").write_text(
        "import os\n\ndef enable(path):\n    assert os.environ['SPECJAX_X'] == 'on'\n")
    ab._one(root.resolve(), [], str(tmp_path / "cache"), {"SPECJAX_X": "on"})
    with pytest.raises(SystemExit, match="failed"):
        ab._one(root.resolve(), [], str(tmp_path / "cache"), {"SPECJAX_X": "off"})
    assert ab.parse_env(["A=1", "B=x=y", "C="], "--after-env") == {
        "A": "1", "B": "x=y", "C": ""}


def test_bad_arguments_name_the_value(tmp_path, capsys):
    with pytest.raises(SystemExit, match="not a specjax checkout"):
        ab.main(["--before", str(tmp_path)])
    with pytest.raises(SystemExit):
        ab.main(["--before", ".", "--workloads", "toy,nope"])
    err = capsys.readouterr().err
    assert "'toy,nope'" in err and "choose from toy,smollm2,smollm2_t1,long" in err
    for bad in ("NOEQUALS", "=1", "PYTHONPATH=/x"):
        with pytest.raises(SystemExit, match=f"--after-env '{bad}': expected NAME=VALUE"):
            ab.main(["--before", ".", "--after-env", bad])


def test_every_workload_has_a_round():
    """Each name `--workloads` accepts runs a round of its own."""
    assert set(ab.ROUNDS) == set(ab.WORKLOADS)
    assert len(set(ab.ROUNDS.values())) == len(ab.WORKLOADS)
