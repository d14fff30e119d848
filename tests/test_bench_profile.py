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
W = "jit(run)/while/body"  # the decode loop's op_name prefix
T = f"{W}/Transformer"  # the op_name prefix of the model's ops

HLO = f"""
%fused_computation.9 (param_0.1: f32[3,15,256], param_1.1: f32[3,256,64]) -> f32[3,15,64] {{
  %param_0.1 = f32[3,15,256]{{2,1,0}} parameter(0)
  %param_1.1 = f32[3,256,64]{{2,1,0}} parameter(1)
  ROOT %dot.9 = f32[3,15,64]{{2,1,0}} dot(%param_0.1, %param_1.1), lhs_batch_dims={{0}}
}}

%fused_computation.11 (param_0.2: f32[1,{CONFIG.hidden_size}]) -> f32[1,{CONFIG.vocab_size}] {{
  %param_0.2 = f32[1,{CONFIG.hidden_size}]{{1,0}} parameter(0)
  ROOT %dot.11 = f32[1,{CONFIG.vocab_size}]{{1,0}} dot(%param_0.2, %w), lhs_contracting_dims={{1}}
}}

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
  %fusion.13 = f32[1,64]{{1,0}} fusion(%p.1), metadata={{op_name="{T}/while/body/layers/add"}}
  %while.9 = (s32[], f32[2]{{0}}) while(%t), condition=%c, body=%b
  %ynn_fusion.10 = f32[3,15,64]{{2,1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_computation.9
  %ynn_fusion.12 = f32[1,{CONFIG.vocab_size}]{{1,0}} fusion(%p.1), calls=%fused_computation.11
}}
"""


def test_each_op_gets_its_part_from_metadata_or_matmul_shapes():
    ops = profile.hlo_ops(HLO, CONFIG)
    want = {"dot.1": "LM head", "dot.2": "MLP", "dot.3": profile.PARTS[0],
            "dot.4": profile.PARTS[1], "fusion.5": "MLP", "fusion.6": profile.PARTS[1],
            "fusion.7": "norms and residuals", "fusion.8": profile.PARTS[5],
            "fusion.13": "norms and residuals",  # the in-place layout's scanned layers
            # XLA:CPU's YNNPACK fusions: no metadata, a part by the dot they compute
            "ynn_fusion.10": profile.PARTS[1], "ynn_fusion.12": "LM head"}
    assert {k: ops[k][1] for k in want} == want
    assert ops["while.9"][0] == "while"


E, D = "cond/EagleHead", "DraftModel/Transformer/layers_0"  # model code in a phase
# a speculative loop: a draft branch whose ops run in the propose scope (one dot untagged,
# with the target MLP's shapes), the verifier's and the commit's ops in theirs
SPEC_HLO = f"""
%grow.1 (p: f32[1,{CONFIG.intermediate_size}]) -> f32[1,{CONFIG.hidden_size}] {{
  %p = f32[1,{CONFIG.intermediate_size}]{{1,0}} parameter(0)
  %fusion.20 = f32[1,64]{{1,0}} fusion(%p), metadata={{op_name="{W}/spec_propose/{E}/mlp/mul"}}
  %dot.21 = f32[1,{CONFIG.hidden_size}]{{1,0}} dot(%p, %w), lhs_contracting_dims={{1}}
}}

ENTRY %main {{
  %p.2 = f32[1,{CONFIG.intermediate_size}]{{1,0}} parameter(1)
  %dot.22 = f32[1,{CONFIG.hidden_size}]{{1,0}} dot(%p.2, %w.2), lhs_contracting_dims={{1}}
  %fusion.23 = f32[1,64]{{1,0}} fusion(%p.2), metadata={{op_name="{T}/layers_1/mlp/mul"}}
  %fusion.24 = s32[1]{{0}} fusion(%p.2), metadata={{op_name="{W}/switch/spec_accept/cumprod"}}
  %fusion.25 = s32[1]{{0}} fusion(%p.2), metadata={{op_name="{W}/spec_commit/{D}/mlp/mul"}}
  %fusion.26 = s32[1]{{0}} fusion(%p.2), metadata={{op_name="{W}/spec_decide/reduce_max"}}
}}
"""


def test_a_speculative_steps_phases_take_their_ops_whatever_model_code_runs_there():
    ops = profile.hlo_ops(SPEC_HLO, CONFIG)
    propose, accept, commit, rule = profile.PARTS[7], profile.PARTS[8], profile.PARTS[9], \
        profile.PARTS[6]
    # the untagged dot in the draft's branch is the draft's; the one in the entry
    # computation, beside the target's ops, is the target's MLP by its shapes
    want = {"fusion.20": propose, "dot.21": propose, "dot.22": "MLP", "fusion.23": "MLP",
            "fusion.24": accept, "fusion.25": commit, "fusion.26": rule}
    assert {k: ops[k][1] for k in want} == want


def test_steps_count_the_lm_head_of_every_verify_width():
    """Each verify width's target forward is its own branch with its own LM head: the
    steps are all of them, not only the costliest one's."""
    v, d = CONFIG.vocab_size, CONFIG.hidden_size
    hlo = "\n".join(f"""%branch_{i} (p: f32[{t},{d}]) -> f32[{t},{v}] {{
  %p = f32[{t},{d}]{{1,0}} parameter(0)
  %head.{i} = f32[{t},{v}]{{1,0}} dot(%p, %w), lhs_contracting_dims={{1}}
  %copy.{i} = f32[{t},{v}]{{1,0}} copy(%head.{i}), metadata={{op_name="{T}/lm_head/copy"}}
}}
""" for i, t in ((0, 1), (1, 5)))
    ops = profile.hlo_ops(hlo, CONFIG)
    assert ops["head.1"] == ("dot", "LM head", "branch_1")
    events = []
    for step in range(6):  # widths 1, 5, 1, 5, ...: 10 ms apart
        i = step % 2
        events += [{"name": f"head.{i}", "ts": step * 10_000, "dur": 1000 + 2000 * i},
                   {"name": f"copy.{i}", "ts": step * 10_000 + 3000, "dur": 100}]
    r = profile.breakdown(events, ops)
    assert r["steps"] == 6 and r["wall_ms"] == pytest.approx(10.0)
    assert r["ms"]["LM head"] == pytest.approx((3 * 1.1 + 3 * 3.1) / 6)


def test_the_table_shows_a_phase_only_where_the_loop_has_it():
    ms = {p: 0.0 for p in profile.PARTS} | {"MLP": 4.0, profile.PARTS[7]: 1.0}
    table = profile.markdown({"steps": 3, "wall_ms": 5.0, "ms": ms}, CONFIG, 1)
    assert f"| {profile.PARTS[7]} | 1.00 | 20% | – |" in table
    assert profile.PARTS[8] not in table and profile.PARTS[6] not in table
    assert "| LM head | 0.00 | 0% | – |" in table  # a model part shows even at 0


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
    kinds = profile.markdown_kinds(r, 2)  # one row per op kind, costliest first
    assert kinds.splitlines()[2:] == ["| dot | MLP | 5.000 | 1 |", "| dot | LM head | 2.000 | 1 |"]


@pytest.mark.parametrize("args", [["--batch", "0"], ["--new", "1"], ["--speculator", "x"],
                                  ["--repeats", "0"], ["--llamacpp", "x.gguf", "--batch", "2"],
                                  ["--top", "-1"], ["--temperature", "-1"],
                                  ["--speculator", "eagle"], ["--dtype", "float16"]])
def test_bad_arguments_exit_with_a_message(args, capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(args)
    assert e.value.code == 2 and args[-2] in capsys.readouterr().err


def test_a_workdir_without_the_speculator_exits_with_a_message(tmp_path, capsys):
    """A run directory whose EAGLE stage never finished: named, before any loading."""
    heads = tmp_path / "eagle3" / "heads"
    heads.mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        profile.main(["--workdir", str(tmp_path), "--speculator", "eagle"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "has no trained eagle" in err and str(heads) in err


@pytest.mark.slow  # a traced run in a subprocess with XLA's dump, for a bench script
def test_a_traced_tiny_model_splits_its_step_into_parts(tmp_path):
    """jax.profiler's op names and XLA's dump agree: every part of a real loop shows up."""
    code = f"""
import json, os, shutil, sys
sys.path.insert(0, {str(tmp_path)!r})
dump = {str(tmp_path / "hlo")!r}
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # the suite's compile flags
                           + f" --xla_dump_to={{dump}} --xla_dump_hlo_module_re=jit_run")
import specjax
from specjax.bench import profile
from specjax.config import tiny_llama
from specjax.speculators import Eagle
model = specjax.init_model(tiny_llama(vocab_size=96), seed=0)
r = profile.profile(model, [[1, 2, 3, 4, 5, 6, 7]], 12, dump, {str(tmp_path / "trace")!r})
r["step_ms"] = profile.step_ms(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 12)
print(json.dumps(r))
shutil.rmtree(dump)  # the speculative loop's dump replaces the plain one's
eagle = Eagle.random(model, version=3, hidden_layers=(0, 1, 1), draft_vocab_size=64,
                     top_k=2, depth=2, total_tokens=4)
print(json.dumps(profile.profile(model, [[1, 2, 3, 4, 5, 6, 7]], 12, dump,
                                 {str(tmp_path / "trace_eagle")!r}, eagle)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r, spec = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert r["steps"] >= 10 and r["wall_ms"] > 0 and r["step_ms"] > 0
    for part in ("LM head", "MLP", profile.PARTS[0], profile.PARTS[1]):
        assert r["ms"][part] > 0, (part, r)
    assert all(r["ms"][p] == 0 for p in profile.PARTS[6:]), r  # no phases without drafts
    # EAGLE-3 at full depth: each speculative step (the target's LM head counts them) has
    # every phase, beside the target forward's parts
    assert 2 <= spec["steps"] <= 11, spec
    for part in profile.PARTS[:4] + profile.PARTS[7:]:
        assert spec["ms"][part] > 0, (part, spec)
