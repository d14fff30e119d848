"""specjax.model / specjax.models: parity with transformers, hidden states, eval_shape, bad
input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax.checkpoint import hf_to_params
from specjax.config import ModelConfig, llama3_8b, llama3_70b
from tests.hf_models import (
    PARITY_ATOL,
    VOCAB,
    hf_logits,
    max_diff,
    random_params,
    state_dict_np,
    tiny_hf,
)

ATOL = PARITY_ATOL["float32"]
SEQ = 40  # > 32: past llama3/yarn original_max_position_embeddings and the sliding window
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}

# name -> (family, HF config overrides, ModelConfig field whose removal must break parity)
CASES = {
    "llama-gqa": ("llama", {}, None),
    "llama-mha": ("llama", {"num_key_value_heads": 4}, None),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}, None),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, None),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}, "rope_scaling"),
    "llama-linear-rope": ("llama", {"rope_parameters": {
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}, "rope_scaling"),
    "llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}}, "rope_scaling"),
    "llama-yarn-mscale": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0,
        "mscale_all_dim": 0.5}}, "rope_scaling"),
    # Dynamic NTK equals the default within max_position_embeddings (all specjax serves).
    "llama-dynamic": ("llama", {"rope_parameters": {
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}, None),
    "mistral-sliding": ("mistral", {"sliding_window": 8}, "sliding_window"),
    "qwen2-bias": ("qwen2", {}, None),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 0}, "sliding_window"),
    "qwen2-mqa-tied": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}, None),
    "qwen3-qknorm": ("qwen3", {"head_dim": 16}, None),  # head_dim 16 != 32 / 4
    "qwen3-mha-tied": ("qwen3", {"head_dim": 16, "num_key_value_heads": 4,
                                 "tie_word_embeddings": True}, None),
}


@functools.partial(jax.jit, static_argnames=("config", "hidden_layers"))
def _run(config, params, tokens, hidden_layers=()):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, hidden, _ = specjax.step(config, params, None, tokens, positions,
                                     hidden_layers=hidden_layers)
    return logits, hidden


@functools.lru_cache(maxsize=None)
def _case(name):
    """(HF model, HF outputs, ModelConfig, params from the state dict, tokens) for a case."""
    family, overrides, _ = CASES[name]
    hf = tiny_hf(family, seed=0, **overrides)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))
    ref = hf_logits(hf, tokens, output_hidden_states=True)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    params = hf_to_params(config, state_dict_np(hf))
    return hf, ref, config, params, tokens


@pytest.mark.parametrize("name", CASES)
def test_state_dict_parity_with_transformers(name):
    hf, ref, config, params, tokens = _case(name)
    assert config.model_type == CASES[name][0]
    layers = (0, config.num_layers - 1)
    logits, hidden = _run(config, params, jnp.asarray(tokens), hidden_layers=layers)
    assert max_diff(logits, ref.logits) <= ATOL
    # Hidden states: ours layer i == HF hidden_states[i + 1] (non-final); final post-norm
    # == HF's last hidden state, which HF also stores post-norm.
    assert max_diff(hidden.layers[0], ref.hidden_states[1]) <= ATOL
    assert max_diff(hidden.final, ref.hidden_states[-1]) <= ATOL
    with torch.no_grad():
        normed = hf.model.norm(torch.from_numpy(np.array(hidden.layers[1])))
    assert max_diff(normed, ref.hidden_states[-1]) <= ATOL

    broken_field = CASES[name][2]
    if broken_field is not None:  # the feature under test really changes these logits
        plain = config.replace(**{broken_field: None})
        assert max_diff(_run(plain, params, jnp.asarray(tokens))[0], ref.logits) > 1e3 * ATOL


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied", "llama3-rope", "mistral-sliding",
                                  "qwen2-bias", "qwen3-qknorm"])
def test_save_pretrained_then_load_parity(name, tmp_path):
    hf, ref, config, params, tokens = _case(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = specjax.load(tmp_path)
    assert model.config == config
    assert max_diff(specjax.forward(model, tokens), ref.logits) <= ATOL
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hidden_layers_any_order_and_repeated():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2)
    params = random_params(config, 0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 5)))
    _, ref = _run(config, params, tokens, hidden_layers=(0, 1, 2))
    _, got = _run(config, params, tokens, hidden_layers=(2, 1, 1, 0))
    for i, layer in enumerate((2, 1, 1, 0)):
        np.testing.assert_array_equal(np.asarray(got.layers[i]), np.asarray(ref.layers[layer]))
    with pytest.raises(ValueError, match="hidden_layers entry 3"):
        _run(config, params, tokens, hidden_layers=(3,))


@pytest.mark.parametrize("make, published", [(llama3_8b, 8_030_261_248),
                                             (llama3_70b, 70_553_706_496)])
def test_param_shapes_of_published_configs(make, published):
    config = make()
    shapes = specjax.param_shapes(config)
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    assert sum(int(np.prod(x.shape)) for x in leaves) == published
    assert config.param_count() == published


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_forward_rejects_out_of_vocab_tokens(bad):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2)
    model = specjax.Model(config, random_params(config, 0))
    with pytest.raises(ValueError, match=rf"token id {bad}\b.*\[0, {VOCAB}\)"):
        specjax.forward(model, [[1, 2, bad, 3]])


def _layer(dec, i: int):
    """Layer i's params in either CPU decode layout (unrolled, or stacked in place)."""
    if "layers_0" in dec:
        return dec[f"layers_{i}"]
    return jax.tree.map(lambda x: x[i], dec["layers"])


@pytest.mark.parametrize("layout", ["unrolled", "in_place"])
def test_decode_layouts_match_scanned(layout):
    """The CPU decode layouts (`unstack_layers`'s unrolled layers; the stacked layers
    scanned in place) compute what the stored scan computes, cached step with tree mask
    and hidden taps included, and `Model.decode_params` converts a params object once,
    to the in-place layout on CPU."""
    from specjax.cache import PagedKVCache
    from specjax.model import decode_params, unstack_layers
    from specjax.models.transformer import layout_of

    cfg = specjax.config.tiny_llama(num_layers=3)
    params = specjax.init_params(cfg, 1)
    flat = unstack_layers(params)
    assert "layers" not in flat and sorted(k for k in flat if k.startswith("layers_")) == [
        "layers_0", "layers_1", "layers_2"]
    if layout == "in_place":
        flat = decode_params(cfg, params, layout)
        assert layout_of(flat) == "in_place" and "layers_0" not in flat
    cache = PagedKVCache.create(cfg, jnp.array([[2, 0], [1, 3]]), num_pages=4, page_size=8,
                                lengths=jnp.array([3, 9]))
    tokens = jax.random.randint(jax.random.key(0), (2, 4), 0, cfg.vocab_size)
    positions = cache.lengths[:, None] + jnp.array([0, 1, 1, 2])[None]
    mask = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)[None]
    mask = jnp.broadcast_to(mask, (2, 4, 4))
    outs = [specjax.step(cfg, p, cache, tokens, positions, mask=mask, hidden_layers=(0, 2))
            for p in (params, flat)]
    (la, ha, ca), (lb, hb, cb) = outs
    np.testing.assert_allclose(la, lb, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ha.layers[1], hb.layers[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ca.k_pages, cb.k_pages, atol=1e-6)
    model = specjax.Model(cfg, params)
    assert model.decode_params() is model.decode_params()
    assert layout_of(model.decode_params()) == "in_place"  # this suite runs on CPU
    assert decode_params(cfg, flat, "auto") is flat  # laid out already


def test_bfloat16_models_decode_in_place_through_the_kernels():
    """A bfloat16 model's CPU decode layout is the in-place one, its dense weights stored
    transposed in bfloat16 (the transposed-weight kernel widens them as they stream) and
    its attention through the CPU kernel, computing what the stored scan computes up to
    bfloat16's rounding of the sums XLA orders otherwise."""
    from specjax import cpu_attention, rows_matmul
    from specjax.cache import PagedKVCache
    from specjax.model import decode_params
    from specjax.models.transformer import KERNEL_T, layout_of

    cfg = specjax.config.tiny_llama(num_layers=3, hidden_size=128, num_heads=2,
                                    num_kv_heads=1, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), specjax.init_params(cfg, 1))
    dec = decode_params(cfg, params)
    assert layout_of(dec) == "in_place"
    assert dec["layers"]["mlp"]["down_proj"][KERNEL_T].dtype == jnp.bfloat16
    cache = PagedKVCache.create(cfg, jnp.array([[2, 0], [1, 3]]), num_pages=4, page_size=8,
                                lengths=jnp.array([3, 9]))
    assert cache.k_pages.dtype == jnp.bfloat16
    tokens = jax.random.randint(jax.random.key(0), (2, 2), 0, cfg.vocab_size)
    positions = cache.lengths[:, None] + jnp.arange(2)[None]
    step = jax.jit(specjax.step, static_argnums=0)
    hlo = step.lower(cfg, dec, cache, tokens, positions).as_text()
    assert rows_matmul.TARGET_T in hlo and cpu_attention.TARGET in hlo
    (la, _, ca), (lb, _, cb) = (step(cfg, p, cache, tokens, positions) for p in (params, dec))
    # |logits| and |keys| are below 1 here: a bfloat16 rounding step is under 0.008
    np.testing.assert_allclose(np.asarray(la, np.float32), np.asarray(lb, np.float32),
                               atol=0.01, rtol=0.01)
    np.testing.assert_allclose(np.asarray(ca.k_pages, np.float32),
                               np.asarray(cb.k_pages, np.float32), atol=0.01, rtol=0.01)


@pytest.mark.parametrize("table_dtype", ["bfloat16", "float16", "float32"])
def test_embedding_rows_are_nn_embeds_and_a_2_byte_table_is_not_widened(table_dtype):
    """`take_rows` gives `nn.Embed`'s rows bit for bit and a float gather's gradients (a
    2-byte table's gather of bits had none), and over a bfloat16 or float16 table its
    compiled gather converts no [V, D] table to float32 (XLA:CPU's gather of 2-byte
    floats would, at every call)."""
    import flax.linen as nn

    from specjax.models.transformer import take_rows

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((300, 64)), table_dtype)
    ids = jnp.asarray([[0, 7, 299], [5, 5, 1]], jnp.int32)
    for dtype in (jnp.bfloat16, jnp.float32):
        want = nn.Embed(300, 64, dtype=dtype).apply({"params": {"embedding": table}}, ids)
        got = take_rows(table, ids, dtype)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        weights = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
        grads = [jax.grad(lambda t, f=f: (f(t).astype(jnp.float32) * weights).sum())(table)
                 for f in (lambda t: take_rows(t, ids, dtype),
                           lambda t: jnp.take(t, ids, axis=0).astype(dtype))]
        assert grads[0].dtype == grads[1].dtype == table.dtype
        np.testing.assert_array_equal(np.asarray(grads[0], np.float32),
                                      np.asarray(grads[1], np.float32))
        assert np.count_nonzero(np.asarray(grads[0], np.float32)) > 0
    hlo = jax.jit(lambda t, i: take_rows(t, i, jnp.float32)).lower(table, ids).compile().as_text()
    assert ("f32[300,64]" in hlo) == (table_dtype == "float32")


def test_a_2_byte_tables_rows_taken_in_a_loop_copy_no_table():
    """In a loop over `take_rows` (a decode loop's steps) the bfloat16 table's bitcast
    stays inside the loop, fused into the gather: XLA hoisted it out as a u16 copy of
    the whole table per call. The rows are the table's, bit for bit."""
    from specjax.models.transformer import take_rows

    table = jnp.asarray(np.random.default_rng(0).standard_normal((300, 64)), jnp.bfloat16)
    ids = jnp.asarray([3, 299, 0], jnp.int32)

    def run(table, ids):
        def body(i, acc):
            return acc + take_rows(table, (ids + i) % 300, jnp.float32)
        return jax.lax.fori_loop(0, 5, body, jnp.zeros((3, 64), jnp.float32))

    compiled = jax.jit(run).lower(table, ids).compile()
    assert "u16[300,64]" not in compiled.as_text().split("ENTRY")[1]  # no copy before it
    want = sum(np.asarray(table, np.float32)[(np.asarray(ids) + i) % 300] for i in range(5))
    np.testing.assert_array_equal(np.asarray(compiled(table, ids)), want)


def test_a_bfloat16_models_decode_loop_copies_no_embedding_table():
    """generate's compiled decode loop over a bfloat16 model reads its embedding rows in
    the loop: its entry computation holds no u16 [V, D] copy of the table."""
    from specjax.decoding.generate import PROGRAMS
    from tests.conftest import bfloat16_model

    cfg = specjax.config.tiny_llama(vocab_size=96, hidden_size=128, dtype="bfloat16")
    PROGRAMS.clear()
    specjax.generate(bfloat16_model(cfg, seed=2), [[1, 2, 3]], max_new_tokens=3)
    loops = [program for sig, program in PROGRAMS.items() if sig[0] == "run"]
    assert len(loops) == 1
    assert "u16[96,128]" not in loops[0].as_text().split("ENTRY")[1]
    PROGRAMS.clear()


def test_in_place_layout_compiles_one_layer():
    """The in-place layout scans its layers: a decode step's program holds one layer's
    kernel calls whatever the depth, and each takes the whole stack [L, O, I] and the
    layer index (read in place; no slice of the stack), where the unrolled layout's
    program grows by a layer's calls per layer."""
    from specjax import rows_matmul
    from specjax.cache import PagedKVCache
    from specjax.model import decode_params

    def kernel_calls(num_layers, layout):
        cfg = specjax.config.tiny_llama(num_layers=num_layers)
        dec = decode_params(cfg, specjax.init_params(cfg, 0), layout)
        cache = PagedKVCache.create(cfg, jnp.array([[0, 1]]), num_pages=2, page_size=8,
                                    lengths=jnp.array([3]))
        tok = jnp.zeros((1, 1), jnp.int32)
        hlo = jax.jit(lambda p, c, t: specjax.step(cfg, p, c, t, c.lengths[:, None])[0]
                      ).lower(dec, cache, tok).as_text()
        return [ln for ln in hlo.splitlines()
                if rows_matmul.TARGET in ln and "custom_call" in ln]  # both kernels' names

    if not (rows_matmul.available() and rows_matmul.available_t()):
        pytest.fail("the few-row matmul kernels could not be built here")
    two, four = kernel_calls(2, "in_place"), kernel_calls(4, "in_place")
    assert len(two) == len(four) >= 5  # q/k/v, o, gate, up, down (the head outside)
    assert any("tensor<4x" in ln for ln in four)  # a stacked weight, read in place
    assert len(kernel_calls(4, "unrolled")) > len(kernel_calls(2, "unrolled"))


@pytest.mark.parametrize("transposed, layout", [(True, "in_place"), (False, "in_place"),
                                                (True, "unrolled")])
def test_tied_decode_layout_carries_the_head_each_kernel_reads(transposed, layout,
                                                               monkeypatch):
    """Tied embeddings: where the transposed-weight kernel wins, the CPU decode layout
    multiplies by the embedding itself ([V, D]: the kernel's layout; no copy)
    and its dense weights are stored [O, I]; else it adds the embedding as [D, V] for
    the [I, O] kernel (XLA:CPU's [V, D]-contracting GEMM is ~15x slower at verify
    widths). The logits are the stored layout's either way, and the compiled verify step
    runs its LM head through the kernel up to its rows, XLA's matmul past them."""
    from specjax import rows_matmul
    from specjax.model import decode_params
    from specjax.models.transformer import KERNEL_T, TIED_HEAD_T

    monkeypatch.setattr(rows_matmul, "transposed_wins", lambda shape, dtype=None: transposed)
    cfg = specjax.config.tiny_llama(num_layers=2, tie_word_embeddings=True)
    params = specjax.init_params(cfg, 2)
    dec = decode_params(cfg, params, layout)
    emb = params["embed_tokens"]["embedding"]
    down = _layer(dec, 0)["mlp"]["down_proj"]
    if transposed:
        assert TIED_HEAD_T not in dec
        np.testing.assert_array_equal(down[KERNEL_T], params["layers"]["mlp"]["down_proj"][
            "kernel"][0].T)
    else:
        assert "kernel" in down
        np.testing.assert_array_equal(dec[TIED_HEAD_T], emb.T)
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    a = specjax.step(cfg, params, None, tokens, positions)[0]
    b = specjax.step(cfg, dec, None, tokens, positions)[0]
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    v, d = cfg.vocab_size, cfg.hidden_size
    target = rows_matmul.TARGET_T if transposed else rows_matmul.TARGET
    head = f"tensor<{v}x{d}xf32>" if transposed else f"tensor<{d}x{v}xf32>"

    def head_ops(t):  # the compiled step's ops producing [..., V] logits
        tok = jnp.zeros((2, t), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        hlo = jax.jit(lambda p, a, b: specjax.step(cfg, p, None, a, b)[0]).lower(
            dec, tok, pos).as_text()
        return [ln for ln in hlo.splitlines()
                if ("dot_general" in ln or target in ln) and f"x{v}xf32>" in ln]

    # 10 rows: the few-row kernel, on the head in its layout
    heads = head_ops(5)
    assert heads and all(target in ln and head in ln for ln in heads)
    # 2 x 17 rows, past the kernel's: XLA's matmul on the same head
    assert 2 * 17 > rows_matmul.MAX_ROWS
    heads = head_ops(17)
    assert heads and all("dot_general" in ln and head in ln for ln in heads)
    untied = specjax.config.tiny_llama(num_layers=2, tie_word_embeddings=False)
    dec_untied = decode_params(untied, specjax.init_params(untied, 0), layout)
    assert TIED_HEAD_T not in dec_untied
    assert (KERNEL_T if transposed else "kernel") in dec_untied["lm_head"]


@pytest.mark.parametrize("extra, layout", [
    ({}, "in_place"), ({"qkv_bias": True}, "in_place"), ({"qk_norm": True}, "in_place"),
    ({"qkv_bias": True, "qk_norm": True}, "unrolled")])
def test_decode_layout_fuses_q_k_and_v(extra, layout):
    """The CPU decode layout holds each layer's q/k/v as one dense (`fuse_qkv`: kernels
    and biases concatenated), and a cached step over it computes what the stored layout
    does (Qwen2's q/k/v biases and Qwen3's q/k norms included)."""
    from specjax.cache import PagedKVCache
    from specjax.model import decode_params
    from specjax.models.transformer import FUSED_QKV, KERNEL_T

    cfg = specjax.config.tiny_llama(num_layers=2, **extra)
    params = specjax.init_params(cfg, 3)
    leaves, tree = jax.tree.flatten(params)  # random biases and norms, not zeros and ones
    keys = jax.random.split(jax.random.key(4), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
    dec = decode_params(cfg, params, layout)
    attn = _layer(dec, 1)["self_attn"]
    assert not {"q_proj", "k_proj", "v_proj"} & set(attn)
    stored = {n: params["layers"]["self_attn"][n] for n in ("q_proj", "k_proj", "v_proj")}
    for name in ("kernel", "bias"):
        got = attn[FUSED_QKV].get(name)
        if name == "kernel":  # stored [O, I] where the transposed-weight kernel wins
            got = attn[FUSED_QKV][KERNEL_T].T if KERNEL_T in attn[FUSED_QKV] else got
        if got is not None:
            np.testing.assert_array_equal(got, jnp.concatenate(
                [stored[n][name][1] for n in ("q_proj", "k_proj", "v_proj")], axis=-1))
    assert ("bias" in attn[FUSED_QKV]) == bool(extra.get("qkv_bias"))
    cache = PagedKVCache.create(cfg, jnp.array([[1, 0]]), num_pages=3, page_size=8,
                                lengths=jnp.array([5]))
    tokens = jax.random.randint(jax.random.key(5), (1, 3), 0, cfg.vocab_size)
    positions = cache.lengths[:, None] + jnp.arange(3)[None]
    (la, _, ca), (lb, _, cb) = (specjax.step(cfg, p, cache, tokens, positions)
                                for p in (params, dec))
    np.testing.assert_allclose(la, lb, atol=1e-5, rtol=1e-5)
    # The decode layout's products sum each dot product in the kernel's lane order, not
    # XLA's: keys normed by q/k norm (|k| up to ~3) then differ by up to ~10 float32 ulps
    np.testing.assert_allclose(ca.k_pages, cb.k_pages, atol=4e-6)
    np.testing.assert_allclose(ca.v_pages, cb.v_pages, atol=4e-6)


def test_layer_layout_choice_is_checked():
    from specjax.model import decode_params

    cfg = specjax.config.tiny_llama(num_layers=2)
    params = specjax.init_params(cfg, 0)
    assert decode_params(cfg, params, "scan") is params
    assert "layers_1" in decode_params(cfg, params, "unrolled")
    with pytest.raises(ValueError, match="layer_layout='stacked'"):
        decode_params(cfg, params, "stacked")
    model = specjax.Model(cfg, params)
    runs = [specjax.generate(model, [[1, 2, 3]], max_new_tokens=6, layer_layout=layout)
            for layout in ("scan", "in_place", "unrolled")]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
