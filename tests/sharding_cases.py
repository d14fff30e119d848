"""Multi-device sharding cases, run on 8 forced CPU devices in a subprocess.

XLA fixes the CPU device count when jax is first imported, so these cases cannot share
the main pytest process. `tests/test_sharding.py::test_multidevice` runs this file as
`XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/sharding_cases.py`
(and `test_multidevice_slow` its `slow` cases, with `-m slow`). The name does not start
with `test_` so the main run does not collect it with one device. To run it by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python -m pytest tests/sharding_cases.py -m 'slow or not slow'
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import specjax
from specjax import attention, sharding
from specjax.config import tiny_llama
from specjax.decoding.generate import PROGRAMS

if jax.device_count() != 8:  # pragma: no cover - misuse guard
    pytest.exit("tests/sharding_cases.py needs XLA_FLAGS=--xla_force_host_platform_device_count=8",
                returncode=2)

# float32 tolerances for sharded vs unsharded math (reductions split across devices)
RTOL, ATOL = 1e-5, 1e-6

# heads 8 / kv_heads 4: model axis 4 shards KV heads; model axis 8 replicates them (rule).
TARGET = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=8, num_kv_heads=4)
MESHES = {"1x1": (1, 1), "1x8": (1, 8), "2x4": (2, 4), "8x1": (8, 1)}
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5, 5, 5, 5, 5], [3, 1, 4, 1, 5], [9, 2, 6],
           [10, 11, 12, 13, 14, 15, 16, 17, 18], [5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8]]  # ragged
NEW = 8


def mesh_of(name: str):
    d, m = MESHES[name]
    return specjax.make_mesh({"data": d, "model": m}, devices=jax.devices()[:d * m])


@functools.lru_cache(maxsize=None)
def target() -> specjax.Model:
    return specjax.init_model(TARGET, seed=0)


@functools.lru_cache(maxsize=None)
def draft() -> specjax.Model:
    """The target's first layer alone: a distinct, cheaper config that agrees often."""
    params = dict(target().params)
    params["layers"] = jax.tree.map(lambda x: x[:1], params["layers"])
    return specjax.Model(TARGET.replace(num_layers=1), params)


def speculator(kind: str):
    if kind == "plain":
        return None
    if kind == "ngram":
        # a random model's one-token matches; a corpus index replicated beside them
        return specjax.speculators.NGram(k=3, n_min=1).with_corpus(
            [p[::-1] + p for p in PROMPTS])
    if kind == "medusa":  # heads params through the rules' Medusa rows
        return specjax.speculators.Medusa.random(target(), num_heads=2,
                                                 tree=[[0], [1], [0, 0]])
    if kind == "eagle3":  # three target layers handed over, head cache, draft vocabulary
        return specjax.speculators.Eagle.random(target(), version=3, draft_vocab_size=128,
                                                top_k=2, depth=2, total_tokens=4)
    # its LM head trimmed to 192 of the 256 ids: the trimmed head's rows through the rules
    return specjax.speculators.DraftModel.create(draft(), k=3, vocab=np.arange(0, 256)[
        np.arange(256) % 4 != 3])


@functools.lru_cache(maxsize=None)
def run(kind: str, mesh_name: str, temperature: float):
    model = specjax.shard_model(target(), mesh_of(mesh_name))
    res = specjax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                           temperature=temperature, seed=3, speculator=speculator(kind),
                           adaptive=False)
    return res.tokens, int(res.stats.accepted)


# ---------------------------------------------------------------------------- meshes
def test_make_mesh_fills_and_is_auto():
    mesh = specjax.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="not divisible"):
        specjax.make_mesh({"data": -1, "model": 3})


# ---------------------------------------------------------------------------- generate
# the default run decodes plainly on every mesh, and test_int8_cache_identical_across_meshes
# speculates there with a tree of heads (Medusa) on the 2x4 mesh; the chains (n-gram, a
# sharded draft model) and EAGLE-3's head run with -m slow
SLOW = {("ngram", "1x8"), ("ngram", "8x1"), ("ngram", "2x4"), ("draft", "1x8"), ("draft", "8x1"),
        ("draft", "2x4"), ("medusa", "1x8"), ("medusa", "2x4"), ("medusa", "8x1"),
        ("eagle3", "1x8"), ("eagle3", "2x4"), ("eagle3", "8x1")}
CASES = [pytest.param(k, m, marks=[pytest.mark.slow] if (k, m) in SLOW else [], id=f"{k}-{m}")
         for k in ("plain", "ngram", "draft", "medusa", "eagle3") for m in MESHES if m != "1x1"]


@pytest.mark.parametrize("kind,mesh_name", CASES)
def test_generate_identical_across_meshes(kind, mesh_name):
    """Greedy and seeded sampling give the 1×1 mesh's tokens on every mesh."""
    for temperature in (0.0, 1.0):  # sampling is traced: both share one compiled program
        want, _ = run(kind, "1x1", temperature)
        got, accepted = run(kind, mesh_name, temperature)
        assert got == want, (kind, mesh_name, temperature)
    if kind != "plain":  # lossless: speculative greedy is the target's greedy
        assert run(kind, mesh_name, 0.0)[0] == run("plain", "1x1", 0.0)[0]
        if kind != "eagle3":  # a random EAGLE head is never right; Medusa's copies the LM head
            assert run(kind, mesh_name, 0.0)[1] + run(kind, mesh_name, 1.0)[1] > 0  # accepted


def test_int8_cache_identical_across_meshes():
    """An int8 KV cache on a 2×4 mesh (scales split over KV heads and page shards with
    their pages): the 1×1 mesh's tokens, plain and with Medusa's tree (whose commit moves
    scales per shard), and speculation lossless against the int8 plain run."""
    def gen(mesh_name, kind):
        model = specjax.shard_model(target(), mesh_of(mesh_name))
        return specjax.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                                speculator=speculator(kind), adaptive=False,
                                kv_cache_dtype="int8").tokens

    want = gen("1x1", "plain")
    assert gen("2x4", "plain") == want
    assert gen("2x4", "medusa") == want
    cache, mesh = row_cache("2x4", dtype=jnp.int8), mesh_of("2x4")
    assert cache.k_pages.dtype == jnp.int8 and cache.k_scales.dtype == jnp.float32
    for scales in (cache.k_scales, cache.v_scales):  # with their pages: KV heads, page shards
        assert laid_out(scales, mesh, P(None, "model", "data"))


def laid_out(x: jax.Array, mesh, spec: P) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def test_single_device_params_equal_the_mesh_of_one():
    """No mesh at all (params on one device) is the same program as the 1×1 mesh."""
    res = specjax.generate(target(), PROMPTS, max_new_tokens=NEW, ignore_eos=True, seed=3,
                           adaptive=False)
    assert res.tokens == run("plain", "1x1", 0.0)[0]


def row_cache(mesh_name: str, rows: int = 8, pages_per_row: int = 3, page_size: int = 4,
              dtype=None):
    """A cache of `rows` rows with their own pages, one pool per data shard (as generate)."""
    mesh = mesh_of(mesh_name)
    pool = specjax.PagePool(rows * pages_per_row, page_size,
                            num_shards=sharding.page_shards(rows, mesh))
    table = pool.allocate_rows([pages_per_row * page_size] * rows, pages_per_row)
    return sharding.create_cache(TARGET, table, num_pages=pool.num_pages, page_size=page_size,
                                 mesh=mesh, dtype=dtype)


def test_cache_follows_the_rules():
    mesh = mesh_of("2x4")
    cache = row_cache("2x4")
    assert laid_out(cache.k_pages, mesh, P(None, "model", "data"))  # KV heads; pages per shard
    assert laid_out(cache.page_table, mesh, P("data"))
    assert laid_out(cache.lengths, mesh, P("data"))
    # shard-local page ids: each data shard's 4 rows use its own 12 pages, 0..11
    np.testing.assert_array_equal(np.asarray(cache.page_table),
                                  np.tile(np.arange(12).reshape(4, 3), (2, 1)))
    # model axis 8 > kv_heads 4: the cache is replicated over `model` (documented rule)
    mesh = mesh_of("1x8")
    assert laid_out(row_cache("1x8").k_pages, mesh, P())
    mesh = mesh_of("8x1")
    assert laid_out(row_cache("8x1").k_pages, mesh, P(None, None, "data"))
    # rows replicated (3 rows on data=2): one pool, replicated with them
    mesh = mesh_of("2x4")
    assert laid_out(row_cache("2x4", rows=3).k_pages, mesh, P(None, "model"))
    with pytest.raises(sharding.ShardingError,
                       match=r"cache.k_pages: pages=9 of shape \(2, 4, 9, 4, 8\) is not "
                             r"divisible by mesh axis data=2"):
        sharding.create_cache(TARGET, np.zeros((8, 1), np.int32), num_pages=9, page_size=4,
                              mesh=mesh)


def _device_bytes(cache) -> int:
    """Bytes of `cache` on its most-loaded device (all four fields)."""
    per_device: dict = {}
    for x in jax.tree.leaves(cache):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.parametrize("mesh_name,data,model", [("2x4", 2, 4), ("8x1", 8, 1), ("1x8", 1, 1)])
def test_cache_bytes_per_device_divide_by_the_data_axis(mesh_name, data, model):
    """Each device holds 1/data of the page pool (and 1/model of the KV heads when they
    divide), exactly what the memory planner counts."""
    full = _device_bytes(row_cache("1x1"))
    pages = 2 * 2 * 4 * 24 * 4 * 8 * 4  # K and V, [L, K, P, Z, H] float32
    assert full == pages + 8 * 3 * 4 + 8 * 4  # + page table [8, 3] and lengths [8], int32
    got = _device_bytes(row_cache(mesh_name))
    assert got == pages // (data * model) + (8 * 3 * 4 + 8 * 4) // data
    assert got == sharding.cache_bytes(TARGET, {"data": data, "model": model}, batch=8,
                                       max_len=12, page_size=4, dtype="float32")


def test_generate_keeps_a_page_pool_per_data_shard():
    """The compiled prefill and decode carry every cache (the target's and the draft's)
    with its page axis split over `data`: no device holds another shard's pages."""
    mesh = mesh_of("2x4")
    run("draft", "2x4", 0.0)
    pools = 0
    for sig, program in PROGRAMS.items():
        on_mesh = any(getattr(leaf[2], "mesh", None) == mesh for leaf in sig[-1])
        if sig[0] not in ("prefill", "run") or not on_mesh:
            continue
        for path, sh in jax.tree_util.tree_flatten_with_path(program.output_shardings)[0]:
            if jax.tree_util.keystr(path).endswith(("k_pages", "v_pages")):
                pools += 1
                assert sh.is_equivalent_to(NamedSharding(mesh, P(None, "model", "data")), 5), (
                    sig[0], jax.tree_util.keystr(path), sh)
    assert pools >= 8  # prefill and decode × (target, draft) × (K, V)


# ---------------------------------------------------------------------------- attention hook
def shard_tables(rng, rows: int, pages_per_row: int, shards: int):
    """(global, shard-local) page tables: shard s's rows use a shuffled block of its own pages."""
    per = rows // shards * pages_per_row  # pages per data shard
    local = np.concatenate([rng.permutation(per).reshape(-1, pages_per_row)
                            for _ in range(shards)]).astype(np.int32)
    offset = np.repeat(np.arange(shards) * per, rows // shards)[:, None]
    return (local + offset).astype(np.int32), local


def _paged_inputs(rng, shards, b=4, t=3, n=8, k=4, h=8, pages=16, z=4, m=4):
    q = rng.standard_normal((b, t, n, h), dtype=np.float32)
    kp = rng.standard_normal((k, pages, z, h), dtype=np.float32)
    vp = rng.standard_normal((k, pages, z, h), dtype=np.float32)
    table, local = shard_tables(rng, b, m, shards)  # shuffled pages
    q_lens = np.array([3, 1, 2, 3], np.int32)
    kv_lens = np.array([z - 1, z, z + 1, 13], np.int32) + q_lens  # ragged around a page
    mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    mask[0, 2, 1] = False  # a tree: node 2 is a sibling of node 1
    return (q, kp, vp, table, kv_lens, q_lens, mask), local


@pytest.mark.parametrize("mesh_name,backend", [
    ("2x4", "reference"), ("1x8", "reference"), ("8x1", "reference"), ("2x4", "pallas")])
def test_paged_attention_per_shard_matches(mesh_name, backend):
    """Per shard, with shard-local page ids, == the reference on one device with global
    ids (4 rows split over data=2; on 8x1 they do not divide, so rows and pool are
    replicated). Pallas: the GPU/TPU kernel, interpreted on CPU, per shard."""
    mesh = mesh_of(mesh_name)
    args, local = _paged_inputs(np.random.default_rng(0), sharding.page_shards(4, mesh))
    want = attention.paged_attention(*args, scale=8 ** -0.5, backend="reference")
    got = jax.jit(functools.partial(sharding.paged_attention, mesh=mesh, scale=8 ** -0.5,
                                    backend=backend))(*args[:3], local, *args[4:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mesh_name", ["2x4", "8x1"])
def test_cache_writes_and_moves_stay_in_their_shard(mesh_name):
    """`write_kv` and `move_slots` per shard with shard-local ids == one device with global
    ids, bit for bit: every row writes and moves only within its data shard's pages."""
    from specjax.cache import PagedKVCache, slot_pages
    from specjax.sharding import move_slots, write_kv

    rng = np.random.default_rng(1)
    mesh = mesh_of(mesh_name)
    b, m, z, t = 8, 3, 4, 5
    shape = (TARGET.num_layers, TARGET.num_kv_heads, b * m, z, TARGET.head_dim)
    table, local = shard_tables(rng, b, m, sharding.page_shards(b, mesh))
    lengths = rng.integers(0, m * z - t, b).astype(np.int32)
    cache = PagedKVCache(*(rng.standard_normal(shape, dtype=np.float32) for _ in range(2)),
                         table, lengths)
    on_mesh = jax.device_put(cache.replace(page_table=local), jax.tree.map(
        lambda s: NamedSharding(mesh, s), sharding.cache_specs(cache, mesh)))
    new = rng.standard_normal((b, t, TARGET.num_kv_heads, TARGET.head_dim), dtype=np.float32)
    slots = lengths[:, None] + np.arange(t)[None, :]
    valid = rng.random((b, t)) < 0.7

    def write_then_move(c):
        page, offset = slot_pages(c.page_table, slots, valid, z, c.num_pages)
        c = c.replace(k_pages=write_kv(c.k_pages, jnp.int32(1), new, page, offset))
        return move_slots(c, slots, slots - lengths[:, None], valid)  # to the row's start

    want = jax.jit(write_then_move)(cache)
    with jax.set_mesh(mesh):
        got = jax.jit(write_then_move)(on_mesh)
    np.testing.assert_array_equal(np.asarray(got.k_pages), np.asarray(want.k_pages))
    np.testing.assert_array_equal(np.asarray(got.v_pages), np.asarray(want.v_pages))
    assert laid_out(got.k_pages, mesh, sharding.cache_specs(cache, mesh).k_pages)
    assert not np.array_equal(np.asarray(want.k_pages), cache.k_pages)  # it did write


def test_model_step_under_a_mesh_runs_attention_per_shard():
    model = specjax.shard_model(target(), mesh_of("2x4"))
    cache = sharding.create_cache(TARGET, np.arange(8).reshape(2, 4) % 4, num_pages=8,
                                  page_size=4, mesh=mesh_of("2x4"))
    tok = jnp.zeros((2, 3), jnp.int32)
    with jax.set_mesh(mesh_of("2x4")):
        jaxpr = jax.make_jaxpr(functools.partial(specjax.step, TARGET))(
            model.params, cache, tok, tok)
    assert "shard_map" in str(jaxpr)


# ---------------------------------------------------------------------------- loading
@pytest.mark.parametrize("layout", ["safetensors", "orbax", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_places_params_on_the_mesh(tmp_path, layout, dtype):
    path = tmp_path
    if layout == "safetensors":
        specjax.save_hf(target(), tmp_path, max_shard_bytes=200_000)  # several files
    elif layout == "orbax":
        specjax.save_orbax(target(), tmp_path)
    else:
        path = specjax.save_gguf(target(), tmp_path / "target.gguf")
    mesh = mesh_of("2x4")
    got = specjax.load(path, dtype=dtype, mesh=mesh)
    want = specjax.load(path, dtype=dtype)
    specs = sharding.param_specs(got.config, mesh)
    for (path, x), spec, y in zip(jax.tree.leaves_with_path(got.params), jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, P)), jax.tree.leaves(want.params)):
        assert laid_out(x, mesh, spec), (path, x.sharding)
        assert x.dtype == jnp.dtype(dtype), path
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.float32)), err_msg=str(path))


def test_load_refuses_an_indivisible_mesh_before_reading(tmp_path):
    specjax.save_hf(target(), tmp_path)
    mesh = specjax.make_mesh({"data": 1, "model": 3}, devices=jax.devices()[:3])
    with pytest.raises(sharding.ShardingError,
                       match=r"embed_tokens/embedding: vocab=256 .*model=3"):
        specjax.load(tmp_path, mesh=mesh)


# ---------------------------------------------------------------------------- training
def _train_step(params, tokens, lr=0.5):
    """One SGD step of next-token cross-entropy over `specjax.step` (uncached forward)."""

    def loss_fn(p):
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        pos = jnp.broadcast_to(jnp.arange(inp.shape[1], dtype=jnp.int32), inp.shape)
        logits, _, _ = specjax.step(TARGET, p, None, inp, pos)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda w, g: w - lr * g, params, grads)


def test_sharded_train_step_equals_unsharded():
    tokens = np.random.default_rng(0).integers(0, TARGET.vocab_size, (8, 12), dtype=np.int32)
    step = jax.jit(_train_step)
    loss0, new0 = step(target().params, jnp.asarray(tokens))
    mesh = mesh_of("2x4")
    params = sharding.shard_params(target().params, mesh, config=TARGET)
    with jax.set_mesh(mesh):
        loss1, new1 = step(params, sharding.shard_batch(tokens, mesh))
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=RTOL)
    for a, b, p in zip(jax.tree.leaves(new1), jax.tree.leaves(new0), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
        assert a.sharding.is_equivalent_to(p.sharding, a.ndim)  # updates keep the layout


def test_shard_batch_splits_rows_over_data():
    mesh = mesh_of("2x4")
    batch = sharding.shard_batch({"tokens": np.zeros((8, 5), np.int32)}, mesh)
    assert laid_out(batch["tokens"], mesh, P("data"))
    with jax.set_mesh(mesh):  # logical constraints inside a step, as train/ would use them
        x = jax.jit(lambda t: sharding.constrain(t * 2, ("batch", "embed")))(batch["tokens"])
    assert laid_out(x, mesh, P("data"))
    with pytest.raises(sharding.ShardingError, match="batch=3"):
        sharding.shard_batch(np.zeros((3, 5), np.int32), mesh)
