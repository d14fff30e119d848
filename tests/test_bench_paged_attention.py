"""`specjax.bench.paged_attention`: its four forms attend alike, its table, and its
argument checks, on tiny shapes."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.bench import paged_attention as bench

SHAPE = dict(layers=2, kv_heads=1, group=2, head=64)


@pytest.mark.parametrize("t,batch", [(1, 1), (3, 1), (3, 2)])
def test_forms_compute_the_same_attention(t, batch):
    a = bench.inputs(t, 20, **SHAPE, batch=batch)
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
    assert len(rows) == 4 and all(len(r.split("|")) == 2 + 2 + len(bench.FORMS) + 2
                                  for r in rows)  # ends, context, T, forms, 2 ratios
    assert bench.main(["--queries", "1", "--contexts", "8", "--layers", "1", "--kv-heads",
                       "1", "--group", "2", "--repeats", "1", "--kernel-only"]) == 0
    out = capsys.readouterr().out
    assert "jnp" not in out and "kernel, in pages, ms | kernel, beside, ms |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    assert len(row.split("|")) == 2 + 2 + len(bench.KERNEL_FORMS)  # no ratios
    with pytest.raises(SystemExit):
        bench.main(["--head-dim", "96"])
    with pytest.raises(SystemExit):
        bench.main(["--layers", "0"])
