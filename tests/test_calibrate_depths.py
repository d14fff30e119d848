"""calibrate.depth_overheads: the step's overhead per draft depth lies between the depth-1
and the full-depth measurements, ends on each exactly, and is never negative: a figure
of -4e-19 from rounding once stopped a calibrated run (generate rejects it)."""

from __future__ import annotations

import pytest

import specjax
from specjax.calibrate import depth_overheads
from specjax.speculators import NGram


@pytest.mark.parametrize("shallow, full", [(0.003797274170556705, 0.0), (0.1, 0.4),
                                           (0.7, 0.05), (0.0, 0.0)])
def test_between_the_two_and_exact_at_the_ends(shallow, full):
    got = depth_overheads(shallow, full, 4)
    assert got[0] == shallow and got[-1] == full
    assert all(min(shallow, full) <= x <= max(shallow, full) for x in got)
    assert depth_overheads(shallow, full, 1) == [full]


def test_generate_takes_them(tiny_target):
    """The figures that once came out negative are a valid step_overhead."""
    out = specjax.generate(tiny_target, [[1, 2, 3, 1, 2, 3]], max_new_tokens=4,
                           ignore_eos=True, speculator=NGram(k=4),
                           step_overhead=depth_overheads(0.003797274170556705, 0.0, 4))
    assert len(out.tokens[0]) == 4
