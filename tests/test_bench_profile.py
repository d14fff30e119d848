"""The decode-step profile (`specjax.bench.profile`): the HLO parse, the part each op
belongs to, the per-step sums, and a real traced run of a tiny model in its own process
(XLA reads its dump flag when jax starts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specjax.bench import profile
from specjax.config import tiny_llama

CONFIG = tiny_llama(vocab_size=96)  # hidden 64, heads of 16: no size collides with 96
T = "jit(run)/while/body/Transformer"  # the op_name prefix of the model's ops

HLO = f"""
ENTRY %main {{
  %p.1 = f32[1,{CONFIG.hidden_size}]{{1,0}} parameter(0)
  %p.2 = f32[1,{CONFIG.intermediate_size}]{{1,0}} parameter(1)
  %dot.1 = f32[1,{CONFIG.vocab_size}]{{1,0}} dot(%p.1, %w.1), lhs_contracting_dims={{1}}
  %dot.2 = f32[1,{CONFIG.hidden_size}]{{1,0}} dot(%p.2, %w.2), lhs_contracting_dims={{1}}
  %dot.3 = f32[1,{CONFIG.num_heads * CONFIG.head_dim}]{{1,0}} dot(%p.1, %w.3), x={{1}}
  %dot.4 = f32[2,3,40]{{2,1,0}} dot(%a, %b), lhs_batch_dims={{0}}
  %fusion.5 = f32[1,64]{{1,0}} fusion(%p.1), kind=kLoop, metadata={{op_name="{T}/layers_3/mlp/mul"}}
  %fusion.6 = f32[2,40]{{1,0}} fusion(%p.1), metadata={{op_name="{T}/layers_0/self_attn/gather"}}
  %fusion.7 = f32[1]{{0}} fusion(%p.1), metadata={{op_name="{T}/layers_0/input_layernorm/mul"}}
  %fusion.8 = s32[1]{{0}} fusion(%p.1), metadata={{op_name="jit(run)/while/body/reduce_min"}}
  %while.9 = (s32[], f32[2]{{0}}) while(%t), condition=%c, body=%b
}}
"""


def test_each_op_gets_its_part_from_metadata_or_matmul_shapes():
    ops = profile.hlo_ops(HLO, CONFIG)
    want = {"dot.1": "LM head", "dot.2": "MLP", "dot.3": profile.PARTS[0],
            "dot.4": profile.PARTS[1], "fusion.5": "MLP", "fusion.6": profile.PARTS[1],
            "fusion.7": "norms and residuals", "fusion.8": profile.PARTS[5]}
    assert {k: ops[k][1] for k in want} == want
    assert ops["while.9"][0] == "while"


def test_breakdown_sums_per_step_and_leaves_out_containers():
    ops = profile.hlo_ops(HLO, CONFIG)
    events = []
    for step in range(4):  # LM head at 0, 10, 20, 30 ms; the loop op spans everything
        t = step * 10_000
        events += [{"name": "dot.1", "ts": t, "dur": 2000},
                   {"name": "dot.2", "ts": t + 2000, "dur": 5000},
                   {"name": "fusion.8", "ts": t + 7000, "dur": 100}]
    events.append({"name": "while.9", "ts": 0, "dur": 40_000})
    r = profile.breakdown(events, ops)
    assert r["steps"] == 4 and r["wall_ms"] == pytest.approx(10.0)
    assert r["ms"]["LM head"] == pytest.approx(2.0) and r["ms"]["MLP"] == pytest.approx(5.0)
    assert r["ms"][profile.PARTS[5]] == pytest.approx(0.1)
    assert sum(r["ms"].values()) == pytest.approx(7.1)  # the while loop not counted
    table = profile.markdown(r, CONFIG, 1)
    mlp_gbs = profile.weight_bytes(CONFIG)["MLP"] / 5e-3 / 1e9
    assert f"| MLP | 5.00 | 70% | {mlp_gbs:.1f} |" in table
    with pytest.raises(ValueError, match="found 1 LM head"):
        profile.breakdown(events[:3], ops)


@pytest.mark.parametrize("args", [["--batch", "0"], ["--new", "1"], ["--speculator", "x"],
                                  ["--repeats", "0"], ["--llamacpp", "x.gguf", "--batch", "2"]])
def test_bad_arguments_exit_with_a_message(args, capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(args)
    assert e.value.code == 2 and args[-2] in capsys.readouterr().err


def test_a_traced_tiny_model_splits_its_step_into_parts(tmp_path):
    """jax.profiler's op names and XLA's dump agree: every part of a real loop shows up."""
    code = f"""
import json, os, sys
sys.path.insert(0, {str(tmp_path)!r})
dump = {str(tmp_path / "hlo")!r}
os.environ["XLA_FLAGS"] = f"--xla_dump_to={{dump}} --xla_dump_hlo_module_re=jit_run"
import specjax
from specjax.bench import profile
from specjax.config import tiny_llama
model = specjax.init_model(tiny_llama(vocab_size=96), seed=0)
r = profile.profile(model, [[1, 2, 3, 4, 5, 6, 7]], 12, dump, {str(tmp_path / "trace")!r})
r["step_ms"] = profile.step_ms(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 12)
print(json.dumps(r))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["steps"] >= 10 and r["wall_ms"] > 0 and r["step_ms"] > 0
    for part in ("LM head", "MLP", profile.PARTS[0], profile.PARTS[1]):
        assert r["ms"][part] > 0, (part, r)
