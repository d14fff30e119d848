"""The per-step timing of a speculative loop's passes (`specjax.bench.loop_steps`) on a
tiny target with an n-gram speculator."""

from __future__ import annotations

import json

import pytest

from specjax.bench import loop_steps
from specjax.calibrate import Calibration
from specjax.speculators import NGram

NEW = 12
# a block repeated: the n-gram finds drafts, so the full pass takes fewer steps
PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]]


def test_each_pass_is_timed_against_plain_decoding(tiny_target):
    passes = loop_steps.pass_kwargs(NGram(k=3), Calibration(), 0.0, NEW)
    assert list(passes) == ["plain", "adaptive", "no_peek", "full", "idle"]
    assert passes["adaptive"]["speculator"].peeks and not passes["no_peek"]["speculator"].peeks
    assert list(loop_steps.pass_kwargs(NGram(k=3, peek=False), Calibration(), 0.0,
                                       NEW)) == ["plain", "adaptive", "full", "idle"]
    res = loop_steps.time_passes(tiny_target, PROMPTS, passes, temperature=0.0,
                                 new_tokens=NEW, rounds=1)
    assert res["plain"]["step_ratio"] == 1.0
    # the prefill samples each call's first token; the loop steps emit the rest
    assert res["plain"]["steps"] == res["idle"]["steps"] == (NEW - 1) * len(PROMPTS)
    assert res["full"]["steps"] <= res["plain"]["steps"]  # each step emits >= 1 token
    assert all(r["step_ratio"] > 0 and r["decode_s"] > 0 for r in res.values())
    table = loop_steps.format_table(res).splitlines()
    speedup = res["plain"]["decode_s"] / res["full"]["decode_s"]
    assert f"| {speedup:.2f}× |" in table[5]  # the full pass's decode speedup
    assert [line.split(" | ")[0] for line in table[2:]] == ["| plain", "| adaptive",
                                                             "| no_peek", "| full", "| idle"]


def test_bad_arguments_name_the_value(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="rounds >= 1 \\(got 0\\)"):
        loop_steps.time_passes(tiny_target, PROMPTS, {"plain": {}}, temperature=0.0,
                               new_tokens=NEW, rounds=0)
    with pytest.raises(SystemExit, match="results.json is missing"):
        loop_steps.main(["--workdir", str(tmp_path)])
    (tmp_path / "results.json").write_text(json.dumps({"settings": {}, "priors": {}}))
    with pytest.raises(SystemExit, match="records no prompt ids"):
        loop_steps.main(["--workdir", str(tmp_path)])
