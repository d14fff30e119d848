"""The verify-cost calibration (`specjax.calibrate`) on a tiny model, its fit, and the
bench script's docs section and argument checks (`specjax.bench.verify_cost`)."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import calibrate, timing
from specjax.bench import verify_cost
from specjax.config import tiny_llama


def test_measure_fits_the_log2_model_to_its_own_ratios(tmp_path):
    result = calibrate.measure_verify_cost([1, 2, 5], batch=2, repeats=2, context=20,
                                           config=tiny_llama(vocab_size=64))
    assert set(result["seconds"]) == {1, 2, 5} and min(result["seconds"].values()) > 0
    assert result["ratio"][1] == 1.0
    assert (result["jump"], result["slope"]) == calibrate.fit_verify_cost(result["ratio"])
    assert result["per_token"] == 0.0  # no T >= 33 measured
    # the same programs under XLA's defaults, side by side
    assert set(result["seconds_no_ynn"]) == {1, 2, 5}
    assert result["ratio_no_ynn"][1] == 1.0
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkeep me\n")
    text = verify_cost.markdown({1: result}, {1: 2}, "python -m specjax.bench.verify_cost")
    from specjax.bench.decode import write_section

    write_section(doc, text, verify_cost.START, verify_cost.END)
    out = doc.read_text()
    assert "keep me" in out and out.count(verify_cost.START) == 1
    assert f"slope {result['slope']:.3f}, per_token" in out and "| 5 |" in out
    assert "no YNNPACK" in out
    assert "- command: `python -m specjax.bench.verify_cost`" in out
    assert verify_cost.from_table_call({1: result}) in out


def test_fit_recovers_jump_and_slope():
    true = {t: 1 + (0.8 + 0.1 * np.log2(t) if t > 1 else 0) for t in (1, 2, 3, 5, 9, 17)}
    jump, slope = calibrate.fit_verify_cost(true)
    assert jump == pytest.approx(0.8) and slope == pytest.approx(0.1)
    # a falling curve is a pure jump; a curve through 1 a pure slope; T = 1 alone: free
    assert calibrate.fit_verify_cost({1: 1.0, 2: 2.0, 4: 1.8}) == (pytest.approx(0.9), 0.0)
    assert calibrate.fit_verify_cost({1: 1.0, 2: 1.3, 4: 1.6}) == (0.0, pytest.approx(0.3))
    assert calibrate.fit_verify_cost({1: 1.0}) == (0.0, 0.0)


def test_fit_per_token_and_the_batched_cost():
    """per_token from the compute-bound T only; VerifyCost takes the larger of the two
    regimes, and a batch's verify forward costs v(rows · T) / v(rows)."""
    from specjax.decoding.cost import VerifyCost

    ratio = {1: 1.0, 2: 1.5, 17: 2.2, 33: 3.3, 65: 6.5, 129: 12.9}
    assert calibrate.fit_per_token(ratio) == pytest.approx(0.1)
    assert calibrate.fit_per_token({1: 1.0, 17: 2.0}) == 0.0
    vc = VerifyCost(jump=0.5, slope=0.1, per_token=0.1)
    np.testing.assert_allclose(vc(np.asarray([1, 16, 64])), [1.0, 1.9, 6.4], rtol=1e-6)
    np.testing.assert_allclose(vc.relative(np.asarray([1, 16]), 4),
                               [1.0, 6.4 / (1.5 + 0.1 * 2)], rtol=1e-6)
    assert vc.relative(16, 1) == pytest.approx(1.9)
    assert "0.1·T" in vc.describe() and "per_token" not in VerifyCost().describe()
    with pytest.raises(ValueError, match="per_token=-1"):
        VerifyCost(per_token=-1.0).validated()
    # inside the speculative step's verify switch every forward costs 1 + branch more
    br = VerifyCost(jump=0.5, slope=0.1, per_token=0.1, branch=0.25)
    np.testing.assert_allclose(br.speculative(np.asarray([1, 16]), 4),
                               1.25 * vc.relative(np.asarray([1, 16]), 4), rtol=1e-6)
    assert "1.25 in the verify switch" in br.describe()
    with pytest.raises(ValueError, match="branch=-0.5"):
        VerifyCost(branch=-0.5).validated()


def test_measured_table_interpolates_and_extrapolates():
    """`VerifyCost.from_table`: the measured ratios at their T, linear between them and
    along the last segment beyond; bad tables are named."""
    from specjax.decoding.cost import VerifyCost

    vc = VerifyCost.from_table({1: 1.0, 2: 1.6, 10: 2.0, 20: 4.0}).validated()
    np.testing.assert_allclose(vc(np.asarray([1, 2, 6, 10, 15, 20, 30])),
                               [1.0, 1.6, 1.8, 2.0, 3.0, 4.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(vc.relative(5, 2), 2.0 / 1.6, rtol=1e-6)  # v(10) / v(2)
    assert "{1: 1.00, 2: 1.60, 10: 2.00, 20: 4.00}" in vc.describe()
    for bad in ({1: 1.0}, {2: 1.5, 3: 2.0}, {1: 1.2, 2: 1.5}, {1: 1.0, 2: float("nan")}):
        with pytest.raises(ValueError, match="measured="):
            VerifyCost.from_table(bad).validated()


def test_tables_at_larger_batches_anchor_the_batch_scaling():
    """`from_table(by_rows=)`: at a measured batch the cost is that batch's own table;
    between two, a blend linear in log2(rows); past the largest, that table scaled by
    rows x T (as batch 1 alone is: v(rows·T) / v(rows)); inside a traced loop too; bad
    tables are named."""
    import jax

    from specjax.decoding.cost import VerifyCost

    one = {1: 1.0, 2: 1.6, 10: 2.0, 20: 4.0}
    four = {1: 1.0, 2: 1.1, 10: 1.5, 20: 2.5}
    vc = VerifyCost.from_table(one, by_rows={4: four}).validated()
    plain = VerifyCost.from_table(one).validated()
    ts = np.asarray([1, 2, 10, 20])
    np.testing.assert_allclose(vc.relative(ts, 4), [1.0, 1.1, 1.5, 2.5], rtol=1e-6)
    np.testing.assert_allclose(vc.relative(ts, 1), plain.relative(ts, 1), rtol=1e-6)
    # batch 2, halfway from 1 to 4 in log2: the mean of the two tables' ratios
    np.testing.assert_allclose(vc.relative(ts, 2), [1.0, 1.35, 1.75, 3.25], rtol=1e-6)
    # batch 8 = 4 rows anchored, x2: v4(2T) / v4(2); T = 5 -> v4(10) / v4(2)
    np.testing.assert_allclose(vc.relative(5, 8), 1.5 / 1.1, rtol=1e-6)
    assert float(vc.relative(5, 8)) < float(plain.relative(5, 8))  # 1.36 against 2.5
    traced = jax.jit(lambda v, t: v.speculative(t, 8))(vc, np.float32(5))
    np.testing.assert_allclose(traced, 1.5 / 1.1, rtol=1e-6)
    assert "at batch 4 {1: 1.00, 2: 1.10, 10: 1.50, 20: 2.50}" in vc.describe()
    with pytest.raises(ValueError, match=r"by_rows\[4\] measures T = \[1, 2\]"):
        VerifyCost.from_table(one, by_rows={4: {1: 1.0, 2: 1.1}})
    bad_rows = [(dict(rows=[1.0], by_rows=[[1.0, 1.1, 1.5, 2.5]]), "rows="),
                (dict(rows=[4.0], by_rows=[[1.2, 1.1, 1.5, 2.5]]), "by_rows="),
                (dict(rows=[4.0], by_rows=[[1.0, 1.1]]), "by_rows=")]
    for kw, match in bad_rows:
        with pytest.raises(ValueError, match=match):
            VerifyCost(measured=vc.measured, **kw).validated()
    with pytest.raises(ValueError, match="one batch size"):
        vc.relative(5, np.asarray([4, 8]))


@pytest.mark.parametrize("argv, match", [(["--tokens", "2,5"], "--tokens must start at 1"),
                                         (["--tokens", "1,x"], "--tokens='1,x'"),
                                         (["--repeats", "0"], "--repeats='0'"),
                                         (["--batches", "4,1"], "--batches='4,1'"),
                                         (["--batches", "2"], "--batches='2'"),
                                         (["--batches", "1,4", "--repeats", "3,2,1"],
                                          "--repeats='3,2,1'")])
def test_bad_arguments_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        verify_cost.main(argv + ["--out", ""])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_measure_times_a_far_context_beside_the_near_one():
    """--far: every T timed again after more cached tokens, in units of the near
    context's one-token step, which is what `VerifyCost.from_table(far=)` takes."""
    result = calibrate.measure_verify_cost([1, 3], batch=1, repeats=2, context=8, far=72,
                                           config=tiny_llama(vocab_size=64))
    assert set(result["far_seconds"]) == set(result["far"]) == {1, 3}
    assert result["far"][3] == result["far_seconds"][3] / result["seconds"][1]
    assert result["attended"] == (8, 72)  # the CPU kernel reads the cached tokens only
    result.update(context=8, far_context=72)
    text = verify_cost.markdown({1: result}, {1: 2},
                                "python -m specjax.bench.verify_cost --far 72")
    assert "| ms after 72 | that / cost(T=1) after 8 (`far`) | that / cost(T=1) after 72 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| 3 |"))
    fs = result["far_seconds"]
    assert row.endswith(f"| {fs[3] * 1e3:.2f} | {result['far'][3]:.2f} | {fs[3] / fs[1]:.2f} |")
    assert "contexts=(8, 72), far={1: {1: " in text


def _fake_result(ratio: dict, far: dict | None = None) -> dict:
    out = dict(ratio=ratio, attended=(128, 1024))
    return out if far is None else dict(out, far=far)


def test_the_printed_table_is_the_verify_cost_it_measured():
    """`from_table_call`: the one `VerifyCost.from_table(...)` for every batch timed,
    which evaluates to the model built from the results themselves."""
    from specjax.decoding.cost import VerifyCost

    one = {1: 1.0, 2: 1.3, 5: 1.5}
    four = {1: 1.0, 2: 1.2, 5: 1.9}
    results = {1: _fake_result(one, {1: 2.0, 2: 2.2, 5: 2.5}),
               4: _fake_result(four, {1: 2.4, 2: 2.6, 5: 3.1})}
    call = verify_cost.from_table_call(results)
    got = eval(call, {"VerifyCost": VerifyCost})
    want = VerifyCost.from_table(one, by_rows={4: four}, contexts=(128, 1024),
                                 far={1: results[1]["far"], 4: results[4]["far"]})
    for b in (1, 4):
        for ctx in (128, 700, 5000):
            np.testing.assert_allclose(got.speculative(np.asarray([1, 2, 3, 5]), b, ctx),
                                       want.speculative(np.asarray([1, 2, 3, 5]), b, ctx))
    assert "far=" not in verify_cost.from_table_call({1: _fake_result(one)})
    with pytest.raises(ValueError, match="batches=\\[4\\]"):
        verify_cost.from_table_call({4: _fake_result(four)})


def test_one_command_writes_every_batch_table(tmp_path, capsys):
    """`--batches 1,2 --far N --out FILE` on a saved tiny checkpoint: one section with a
    table per batch and the from_table call holding both."""
    import specjax

    ckpt = tmp_path / "tiny"
    specjax.save_hf(specjax.init_model(tiny_llama(vocab_size=64), seed=0), ckpt)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkeep me\n")
    assert verify_cost.main(["--target", str(ckpt), "--tokens", "1,3", "--batches", "1,2",
                             "--repeats", "2,1", "--context", "8", "--far", "40",
                             "--out", str(doc)]) == 0
    out = doc.read_text()
    assert "keep me" in out and out.count(verify_cost.START) == 1
    assert "Batch 1:" in out and "Batch 2 (T tokens per row):" in out
    assert "batch 1: 2, batch 2: 1" in out
    assert "by_rows={2: {1: 1.00, 3: " in out and "contexts=(8, 40), far={1: {1: " in out
    # which kernel's table it measured: the rule prices with that kernel's
    printed = capsys.readouterr().out
    assert "decode matmuls: " in printed and "VERIFY_COST[" in printed


@pytest.mark.parametrize("argv", [["--far", "64", "--context", "128"],
                                  ["--context", "-1"]])
def test_bad_contexts_exit_non_zero(argv, capsys):
    with pytest.raises(SystemExit) as e:
        verify_cost.main(argv + ["--out", ""])
    assert e.value.code != 0 and "--context=" in capsys.readouterr().err


def test_verify_cost_is_affine_in_the_context():
    """Measured at two contexts, each forward's cost is linear in the cached tokens, so
    v(T) moves from the near table to the far one and past it; without a context, or
    without a far table, the near table stands."""
    from specjax.decoding.cost import VerifyCost

    near = {1: 1.0, 2: 1.2, 5: 1.5}
    far = {1: {1: 2.0, 2: 2.8, 5: 4.0}}
    vc = VerifyCost.from_table(near, contexts=(100, 1100), far=far).validated()
    assert float(vc(2)) == pytest.approx(1.2) and float(vc(2, 100)) == pytest.approx(1.2)
    assert float(vc(2, 1100)) == pytest.approx(1.4)
    assert float(vc(2, 600)) == pytest.approx(2.0 / 1.5)  # (1.2 + 0.8) / (1 + 0.5)
    assert float(vc(5, 2100)) == pytest.approx((1.5 + 2 * 2.5) / 3.0)  # past the far one
    assert float(VerifyCost.from_table(near).validated()(2, 5000)) == pytest.approx(1.2)
    assert "measured after 1100" in vc.describe()
    by = VerifyCost.from_table(near, by_rows={4: {1: 1.0, 2: 1.5, 5: 2.0}},
                               contexts=(100, 1100),
                               far={1: far[1], 4: {1: 3.0, 2: 6.0, 5: 9.0}}).validated()
    assert float(by.relative(2, 4, 1100)) == pytest.approx(2.0)
    assert float(by.relative(2, 4, 100)) == pytest.approx(1.5)
    assert float(by.relative(2, 1, 1100)) == pytest.approx(1.4)


@pytest.mark.parametrize("kw, match", [
    (dict(contexts=(100, 1100)), "give both or neither"),
    (dict(contexts=(100, 1100), far={4: {1: 1.0, 2: 1.1, 5: 1.2}}), r"far\[1\]"),
    (dict(contexts=(100, 1100), far={1: {1: 1.0, 2: 1.1}}), r"far\[1\] measures T"),
])
def test_bad_far_tables_are_named(kw, match):
    from specjax.decoding.cost import VerifyCost

    with pytest.raises(ValueError, match=match):
        VerifyCost.from_table({1: 1.0, 2: 1.2, 5: 1.5}, **kw)


@pytest.mark.parametrize("contexts, far, match", [
    ((500, 100), [[1.0, 2.0]], "contexts="),
    ((100, 500), [[1.0, -2.0]], "far="),
    ((100, 500), [[1.0, 2.0], [1.0, 2.0]], "far="),
])
def test_bad_context_fields_are_refused_by_name(contexts, far, match):
    from specjax.decoding.cost import VerifyCost

    vc = VerifyCost(measured=[[1, 2], [1.0, 1.2]], contexts=contexts, far=far)
    with pytest.raises(ValueError, match=match):
        vc.validated()


def test_timed_rounds_shuffle_the_program_order(monkeypatch):
    """Every round times each program once, in an order of its own (a program timed
    right after a large forward measured slower), the same order for the same round."""
    rounds, order = [], timing.round_order

    def recorded(n, r):
        rounds.append(list(order(n, r)))
        return rounds[-1]

    monkeypatch.setattr(timing, "round_order", recorded)
    calibrate.measure_verify_cost([1, 3], batch=1, repeats=4, context=8, far=24,
                                  config=tiny_llama(vocab_size=64))
    assert len(rounds) == 4 and all(sorted(r) == list(range(6)) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # 6 programs: 2 T x (options, no YNN, far)
    assert rounds == [list(order(6, r)) for r in range(4)]
