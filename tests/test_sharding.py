"""Sharding rules, layout snapshots and the memory planner (one device), plus the
multi-device cases of `tests/sharding_cases.py`, run in a subprocess with 8 CPU devices.

Snapshots: `tests/snapshots/sharding_<family>.json` hold param path -> logical axes and
PartitionSpec (and the cache's) for a published config per family, so a silent layout
change fails here. After an intended change, regenerate and review the diff:

    SPECJAX_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_sharding.py -k snapshot
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from multidevice import ROOT, medusa_two_steps, run_cases

import specjax
from specjax import sharding
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig, llama3_8b, llama3_70b, tiny_llama

SNAPSHOTS = Path(__file__).parent / "snapshots"


# ---------------------------------------------------------------------------- multi-device
def _run_cases(marker: str) -> None:
    run_cases("tests/sharding_cases.py", marker)


def test_multidevice():
    """Meshes 1×1, 1×8, 2×4, 8×1: generate, attention hook, loading, a training step."""
    _run_cases("not slow")


@pytest.mark.slow
def test_multidevice_slow():
    """The rest of the mesh × speculator matrix (NGram and DraftModel on 1×8 and 8×1)."""
    _run_cases("slow")


@pytest.mark.slow
def test_two_processes(tmp_path):
    """Multi-host in miniature: 2 processes × 4 CPU devices (gloo) = one 2×4 mesh, the same
    code as one host: load, generate (plain, NGram) and train Medusa heads."""
    import socket

    cfg = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=8,
                     num_kv_heads=4)
    model = specjax.init_model(cfg, seed=0)
    specjax.save_hf(model, tmp_path)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5, 5, 5, 5, 5], [10, 11, 12, 13]]
    want = specjax.generate(model, prompts, max_new_tokens=6, ignore_eos=True).tokens
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, SPECJAX_PROMPTS=json.dumps(prompts), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    procs = [subprocess.Popen([sys.executable, "tests/multihost_worker.py", str(i), port,
                               str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
        got = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        assert got == {"plain": want, "ngram": want}
    # training on the two-process mesh == one device (heads and eval loss, float32)
    one = medusa_two_steps(model, tmp_path / "one")
    got = np.load(tmp_path / "heads.npz")
    np.testing.assert_allclose(got["eval_loss"], one.eval["loss"], rtol=1e-5)
    for name, want_heads in one.params.items():
        np.testing.assert_allclose(got[name], np.asarray(want_heads), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    lines = (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2, 2]  # one writer: train ×2, eval


# ---------------------------------------------------------------------------- rules
def test_logical_axes_from_param_paths():
    axes = sharding.param_logical_axes
    assert axes("layers/self_attn/q_proj/kernel", 3) == ("layers", "embed", "heads")
    assert axes("layers/self_attn/k_proj/bias", 2) == ("layers", "kv_heads")
    assert axes("layers/mlp/down_proj/kernel", 3) == ("layers", "mlp", "embed")
    assert axes("embed_tokens/embedding", 2) == ("vocab", "embed")
    assert axes("lm_head/kernel", 2) == ("embed", "vocab")
    assert axes("norm/weight", 1) == ("embed",)
    assert axes("params/layers/input_layernorm/weight", 2) == ("layers", "embed")  # a draft's
    with pytest.raises(sharding.ShardingError, match="medusa/w/kernel: unknown param path"):
        axes("medusa/w/kernel", 2)
    with pytest.raises(sharding.ShardingError, match="norm/weight: a 3-d array"):
        axes("norm/weight", 3)


def test_rules_table_maps_every_logical_axis_once():
    names = [name for name, _ in sharding.RULES]
    assert len(names) == len(set(names))
    used = {a for _, axes in sharding.PARAM_AXES for a in axes} | {
        a for axes in sharding.CACHE_AXES.values() for a in axes} | {"layers"}
    assert used - {None} <= set(names)


def test_indivisible_axis_names_the_param_and_sizes():
    cfg = tiny_llama(num_heads=14, num_kv_heads=2, hidden_size=896, head_dim=64)
    # 14 heads × 64 = 896 divides 4, but 14 heads do not: a shard would split a head.
    with pytest.raises(sharding.ShardingError,
                       match=r"layers/self_attn/o_proj/kernel: heads=14 \(dim 896\) of shape "
                             r"\(2, 896, 896\) is not divisible by mesh axis model=4"):
        sharding.param_specs(cfg, {"data": 1, "model": 4})


def test_ngram_leaves_are_replicated():
    """The n-gram's traced n_min (a Python int) and its corpus index have specs, each
    replicated, so `generate(mesh=)` can lay the speculator out."""
    from specjax.speculators import NGram

    spec = NGram(k=3).with_corpus([[1, 2, 3, 4], [5, 6]])
    specs = sharding.tree_specs(spec, {"data": 2, "model": 4})
    assert specs.n_min == P() and specs.corpus.tokens == P(None)
    assert specs.corpus.slots == specs.corpus.spans == P(None, None)


def test_kv_heads_and_batch_replicate_when_indivisible():
    cfg = tiny_llama(num_heads=8, num_kv_heads=2)
    specs = sharding.param_specs(cfg, {"data": 2, "model": 4})
    assert specs["layers"]["self_attn"]["q_proj"]["kernel"] == P(None, None, "model")
    assert specs["layers"]["self_attn"]["k_proj"]["kernel"] == P(None, None, None)
    assert sharding.mesh_axis("batch", 3, {"data": 2}) is None
    assert sharding.mesh_axis("batch", 4, {"data": 2}) == "data"
    assert sharding.mesh_axis("kv_heads", 8, {"model": 16}) is None


def test_page_pool_goes_with_the_rows():
    mesh = {"data": 2, "model": 4}
    assert sharding.page_axis(8, mesh) == "data" and sharding.page_shards(8, mesh) == 4 // 2
    assert sharding.page_axis(3, mesh) is None and sharding.page_shards(3, mesh) == 1
    assert sharding.page_shards(8, None) == 1
    shared = tuple((a, None if a == "pages" else t) for a, t in sharding.RULES)
    assert sharding.page_axis(8, mesh, rules=shared) is None  # one replicated pool
    crossed = tuple((a, "model" if a == "pages" else t) for a, t in sharding.RULES)
    with pytest.raises(sharding.ShardingError, match="rules map 'pages' to 'model' but "
                                                     "'batch' to 'data'"):
        sharding.page_axis(8, mesh, rules=crossed)


def test_make_mesh_checks_sizes():
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        specjax.make_mesh({"data": -1, "model": -1})
    with pytest.raises(ValueError, match="needs 2 devices but 1 are given"):
        specjax.make_mesh({"data": 1, "model": 2})
    mesh = specjax.make_mesh({"data": -1, "model": 1})
    assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}


# ---------------------------------------------------------------------------- snapshots
def _qwen2_7b():
    return ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, qkv_bias=True,
                       model_type="qwen2", dtype="bfloat16")


def _qwen3_8b():
    return ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                       model_type="qwen3", dtype="bfloat16")


def _qwen25_05b():  # tied embeddings
    return ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_layers=24, num_heads=14, num_kv_heads=2, qkv_bias=True,
                       tie_word_embeddings=True, model_type="qwen2", dtype="bfloat16")


# family -> (config, mesh shape); Llama on model=16 shows the kv_heads replication rule.
FAMILIES = {
    "llama": (llama3_8b, {"data": 1, "model": 16}),
    "qwen2": (_qwen2_7b, {"data": 2, "model": 4}),
    "qwen3": (_qwen3_8b, {"data": 2, "model": 8}),
    "tied": (_qwen25_05b, {"data": 4, "model": 2}),
}


def _spec_json(spec: P) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def _layout(config: ModelConfig, mesh: dict) -> dict:
    shapes = specjax.param_shapes(config)
    flat = lambda tree: {sharding.rules.path_str(p): x for p, x in
                         jax.tree.leaves_with_path(tree, is_leaf=lambda x: isinstance(x, P))}
    specs = flat(sharding.param_specs(config, mesh))
    params = {path: {"shape": list(s.shape),
                     "logical": list(sharding.param_logical_axes(path, len(s.shape))),
                     "spec": _spec_json(specs[path])} for path, s in flat(shapes).items()}
    pages = (config.num_layers, config.num_kv_heads, 64, 16, config.head_dim)
    sds = jax.ShapeDtypeStruct
    cache = PagedKVCache(sds(pages, jnp.int8), sds(pages, jnp.int8),  # int8: with scales
                         sds((4, 16), jnp.int32), sds((4,), jnp.int32),
                         sds(pages[:-1], jnp.float32), sds(pages[:-1], jnp.float32))
    cspecs = sharding.cache_specs(cache, mesh)
    return {"mesh": mesh, "params": params,
            "cache": {f: {"shape": list(getattr(cache, f).shape),
                          "logical": list(sharding.CACHE_AXES[f]),
                          "spec": _spec_json(getattr(cspecs, f))} for f in sharding.CACHE_AXES}}


def _dump(layout: dict) -> str:
    """JSON with one line per array, so a layout change reads as a one-line diff."""
    def block(entries: dict) -> str:
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                  for k, v in sorted(entries.items())) + "\n }"
    return (f'{{\n "mesh": {json.dumps(layout["mesh"])},\n "params": {block(layout["params"])},'
            f'\n "cache": {block(layout["cache"])}\n}}\n')


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharding_snapshot(family):
    make, mesh = FAMILIES[family]
    got = _layout(make(), mesh)
    path = SNAPSHOTS / f"sharding_{family}.json"
    if os.environ.get("SPECJAX_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(_dump(got))
    want = json.loads(path.read_text())
    assert got == want, (f"{family} layout changed; if intended, regenerate with "
                         "SPECJAX_UPDATE_SNAPSHOTS=1 and review the diff")


# ---------------------------------------------------------------------------- planner
BF16 = 2
GIB = 1 << 30


def test_plan_llama3_8b_params_by_hand():
    cfg = llama3_8b()
    assert cfg.param_count() == 8_030_261_248
    # replicated on every device: 32 layers × 2 norms × 4096 + final norm 4096
    norms = 32 * 2 * 4096 + 4096  # 266,240
    kv = 32 * 2 * 4096 * 1024  # k_proj + v_proj: 268,435,456
    sharded = 8_030_261_248 - norms  # embed, lm_head, q/k/v/o, mlp all divide 8
    plan = lambda m: specjax.plan_memory(cfg, m, batch=0, max_len=0, page_size=16,
                                         dtype="bfloat16")
    assert plan({"data": 1, "model": 1}).params == 8_030_261_248 * BF16  # 16,060,522,496
    assert plan({"data": 1, "model": 8}).params == (sharded // 8 + norms) * BF16  # 2,008,031,232
    assert plan({"data": 2, "model": 4}).params == (sharded // 4 + norms) * BF16  # data copies
    # model 16: 8 KV heads do not divide 16, so k/v projections are replicated (the rule)
    assert plan({"data": 1, "model": 16}).params == (
        (sharded - kv) // 16 + kv + norms) * BF16  # 1,507,598,336


def test_plan_llama3_8b_kv_cache_by_hand():
    cfg = llama3_8b()
    # K and V, 32 layers × 8 KV heads × 128 dims × 2 bytes = 131,072 bytes per token
    per_token = 2 * 32 * 8 * 128 * BF16
    assert per_token == 131_072
    # batch 8 × 8192 tokens = 8 GiB of pages; the page table is 8 rows × 512 pages int32
    plan = specjax.plan_memory(cfg, {"data": 1, "model": 8}, batch=8, max_len=8192,
                               page_size=16, dtype="bfloat16")
    assert plan.kv_cache == 8 * 8192 * per_token // 8 + 8 * 512 * 4 + 8 * 4
    # data 2: each data shard owns the pages of its 4 rows, so the pool halves again
    plan = specjax.plan_memory(cfg, {"data": 2, "model": 4}, batch=8, max_len=8192,
                               page_size=16, dtype="bfloat16")
    assert plan.kv_cache == 8 * 8192 * per_token // (2 * 4) + (8 * 512 * 4 + 8 * 4) // 2
    assert plan.kv_cache == 1_073_750_032  # 1 GiB of pages + 8,208 bytes of table/lengths
    plan = specjax.plan_memory(cfg, {"data": 8, "model": 1}, batch=8, max_len=8192,
                               page_size=16, dtype="bfloat16")
    assert plan.kv_cache == 8192 * per_token + 512 * 4 + 4  # one row's 8192 tokens per device
    # 6 rows do not divide data 4: rows, and with them the one pool, are replicated
    plan = specjax.plan_memory(cfg, {"data": 4, "model": 2}, batch=6, max_len=8192,
                               page_size=16, dtype="bfloat16")
    assert plan.kv_cache == 6 * 8192 * per_token // 2 + 6 * 512 * 4 + 6 * 4
    # activations, the docstring's formula: b=8, C=128, S=8192, N'=4, K'=1, F'=1792, V'=16032
    plan = specjax.plan_memory(cfg, {"data": 1, "model": 8}, batch=8, max_len=8192,
                               page_size=16, dtype="bfloat16", prefill_chunk=128)
    assert plan.activations == (BF16 * 8 * 128 * (4 * 4096 + (4 + 2 * 1) * 128 + 2 * 1792)
                                + 4 * 8 * 128 * 16032 + 4 * 8 * 4 * 128 * 8192)  # 242,352,128


def test_plan_llama3_8b_int8_kv_cache_by_hand():
    cfg = llama3_8b()
    # int8: per layer and KV head, 128 one-byte dims + a float32 scale, for K and V
    per_token = 2 * 32 * 8 * (128 + 4)
    assert per_token == 67_584  # 0.52 of bf16's 131,072
    plan = specjax.plan_memory(cfg, {"data": 2, "model": 4}, batch=8, max_len=8192,
                               page_size=16, dtype="bfloat16", kv_cache_dtype="int8")
    assert plan.kv_cache == 8 * 8192 * per_token // (2 * 4) + (8 * 512 * 4 + 8 * 4) // 2
    assert plan.params == specjax.plan_memory(  # the params keep `dtype`
        cfg, {"data": 2, "model": 4}, batch=8, max_len=8192, page_size=16,
        dtype="bfloat16").params


def test_plan_llama3_70b_by_hand():
    cfg = llama3_70b()
    assert cfg.param_count() == 70_553_706_496
    norms = 80 * 2 * 8192 + 8192  # 1,318,912
    kv = 80 * 2 * 8192 * 1024  # 1,342,177,280
    sharded = 70_553_706_496 - norms
    plan = specjax.plan_memory(cfg, {"data": 1, "model": 8}, batch=4, max_len=4096,
                               page_size=16, dtype="bfloat16")
    assert plan.params == (sharded // 8 + norms) * BF16  # 17,640,734,720 (16.43 GiB)
    per_token = 2 * 80 * 8 * 128 * BF16  # 327,680 bytes
    assert plan.kv_cache == 4 * 4096 * per_token // 8 + 4 * 256 * 4 + 4 * 4  # 671,092,752
    plan = specjax.plan_memory(cfg, {"data": 2, "model": 16}, batch=4, max_len=4096,
                               page_size=16, dtype="bfloat16")
    assert plan.params == ((sharded - kv) // 16 + kv + norms) * BF16  # 11,338,268,672
    # K replicated over model 16; the pages of 4 rows split over data 2
    assert plan.kv_cache == 4 * 4096 * per_token // 2 + (4 * 256 * 4 + 4 * 4) // 2  # 2,684,356,616


def test_plan_with_a_draft_adds_its_params_and_cache():
    cfg, draft = llama3_8b(), llama3_8b().replace(num_layers=2)
    kw = dict(batch=2, max_len=1024, page_size=16, dtype="bfloat16")
    plan = specjax.plan_memory(cfg, {"data": 1, "model": 4}, draft_config=draft, **kw)
    alone = specjax.plan_memory(draft, {"data": 1, "model": 4}, **kw)
    assert (plan.draft_params, plan.draft_kv_cache) == (alone.params, alone.kv_cache)
    assert plan.total == (plan.params + plan.kv_cache + plan.draft_params
                          + plan.draft_kv_cache + plan.activations)


def test_check_fits_refuses_70b_on_one_80gb_device():
    kw = dict(batch=1, max_len=2048, page_size=16, dtype="bfloat16")
    with pytest.raises(sharding.DoesNotFitError, match=r"needs 1\d\d\.\d\d GiB per device .* "
                                                       r"has 80\.00 GiB"):
        specjax.check_fits(llama3_70b(), {"data": 1, "model": 1}, device_bytes=80 * GIB, **kw)
    plan = specjax.check_fits(llama3_70b(), {"data": 1, "model": 8}, device_bytes=80 * GIB, **kw)
    assert plan.total < 80 * GIB
