"""`specjax.bench.paged_attention`: its four forms attend alike, its table, and its
argument checks, on tiny shapes."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.bench import paged_attention as bench

SHAPE = dict(layers=2, kv_heads=1, group=2, head=64)


@pytest.mark.parametrize("t,batch,kv_dtype", [(1, 1, "float32"), (3, 1, "float32"),
                                              (3, 2, "float32"), (3, 1, "int8"),
                                              (1, 2, "bfloat16")])
def test_forms_compute_the_same_attention(t, batch, kv_dtype):
    a = bench.inputs(t, 20, **SHAPE, batch=batch, kv_dtype=kv_dtype)
    assert a["k_pages"].dtype == kv_dtype and (a["k_scales"] is not None) == (
        kv_dtype == "int8")
    assert a["q"].shape[0] == batch and a["table"].shape[0] == batch
    outs = {}
    for form in bench.FORMS:
        fn, args = bench.program(form, a)
        outs[form] = np.asarray(fn(*args))
    assert not np.allclose(outs[bench.FORMS[0]], np.asarray(a["q"]))  # attention ran
    # in-pages forms attend over whatever the pages hold at the new slots, beside forms
    # over k_new/v_new: equal within each pair
    for pair in ((0, 2), (1, 3)):
        np.testing.assert_allclose(outs[bench.FORMS[pair[1]]], outs[bench.FORMS[pair[0]]],
                                   rtol=1e-5, atol=1e-6)


def test_main_prints_a_row_per_context_and_query_count(capsys):
    assert bench.main(["--queries", "1,2", "--contexts", "8,40", "--layers", "2",
                       "--kv-heads", "1", "--group", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 8 |")
            or line.startswith("| 40 |")]
    assert len(rows) == 4 and all(len(r.split("|")) == 2 + 3 + len(bench.FORMS) + 2
                                  for r in rows)  # ends, context, T, dtype, forms, 2 ratios
    assert bench.main(["--queries", "1", "--contexts", "8", "--layers", "1", "--kv-heads",
                       "1", "--group", "2", "--repeats", "1", "--kernel-only"]) == 0
    out = capsys.readouterr().out
    assert "jnp" not in out and "kernel, in pages, ms | kernel, beside, ms |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    assert len(row.split("|")) == 2 + 3 + len(bench.KERNEL_FORMS)  # no ratios
    assert bench.main(["--queries", "1", "--contexts", "8", "--layers", "1", "--kv-heads",
                       "1", "--group", "2", "--repeats", "1", "--kernel-only",
                       "--kv-dtypes", "float32,int8"]) == 0
    out = capsys.readouterr().out
    assert "| kernel, beside / float32 pages' |" in out
    rows = {line.split("|")[3].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| 8 |")}
    assert set(rows) == {"float32", "int8"}
    assert rows["float32"][-3:-1] == [" 1.00 ", " 1.00 "]  # float32 over itself
    with pytest.raises(SystemExit):
        bench.main(["--kv-dtypes", "float16"])
    with pytest.raises(SystemExit):
        bench.main(["--head-dim", "96"])
    with pytest.raises(SystemExit):
        bench.main(["--layers", "0"])
