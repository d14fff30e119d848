"""The bfloat16 GEMM kernel (specjax/csrc/bf16_gemm_t.cc): its sums against a float32
emulation of AVX512-BF16's dot-product instruction, bit for bit on both of its paths,
and a bfloat16 model's prefill through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import bf16_gemm, rows_matmul
from tests.conftest import bfloat16_model, self_drafting_emits_plain


def _operands(rows, inner, out, seed=0, layers=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, inner)), jnp.bfloat16)
    shape = (out, inner) if layers is None else (layers, out, inner)
    return x, jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def instruction_sums(x, wt) -> np.ndarray:
    """x [R, I] @ wt [O, I]^T summed as the kernel documents it, in float32: 16 lanes,
    lane l adding x[2l+1] w[2l+1] then x[2l] w[2l] for each 32 values of I (products of
    bfloat16 values are exact in float32; each addition rounds), lanes summed by
    halves, then I's tail in order."""
    x, wt = np.asarray(x, np.float32), np.asarray(wt, np.float32)
    whole = x.shape[1] // 32 * 32
    acc = np.zeros((x.shape[0], wt.shape[0], 16), np.float32)
    for i in range(0, whole, 32):
        for first in (1, 0):
            acc += x[:, None, i + first:i + 32:2] * wt[None, :, i + first:i + 32:2]
    half = 8
    while half:
        acc[..., :half] += acc[..., half:2 * half]
        half //= 2
    s = acc[..., 0]
    for i in range(whole, x.shape[1]):
        s += x[:, i, None] * wt[None, :, i]
    return s


# rows: 4-row tiles, 64-row chunks and their tails; inner: whole 32s, a tail, shorter
# than 32; out: 4-output tiles, a tail, fewer than 4 and more than a thread's share
@pytest.mark.parametrize("rows,inner,out", [(37, 576, 70), (64, 100, 9), (5, 33, 3),
                                            (130, 64, 260), (1, 20, 1)])
@pytest.mark.parametrize("portable", [False, True])
def test_sums_are_the_instructions_bit_for_bit(rows, inner, out, portable):
    """Both paths (the instruction's where the build has it, and the widened-value one)
    give the emulated instruction's float32 sums bit for bit: so they agree with each
    other, and a row's result does not depend on the tile it falls in."""
    x, wt = _operands(rows, inner, out)
    got = np.asarray(bf16_gemm.product(x, wt, portable=portable))
    assert got.dtype == np.float32 and got.shape == (rows, out)
    np.testing.assert_array_equal(got, instruction_sums(x, wt))


def test_the_sums_are_the_products_within_float32_rounding():
    """The emulation itself against float64: the same product, up to float32 rounding
    of a 576-term sum (so the bit-for-bit test above tests a matmul)."""
    x, wt = _operands(8, 576, 16, seed=1)
    exact = np.asarray(x, np.float64) @ np.asarray(wt, np.float64).T
    np.testing.assert_allclose(instruction_sums(x, wt), exact, rtol=0, atol=1e-3)
    assert np.abs(exact).max() > 10


def test_a_stacked_weight_is_read_at_its_layer():
    """Layer l of a stack [L, O, I], read in place, multiplies as the 2-D weight does;
    under jit with a traced layer too."""
    x, stack = _operands(40, 96, 24, layers=3)
    for layer in range(3):
        want = np.asarray(bf16_gemm.product(x, stack[layer]))
        np.testing.assert_array_equal(np.asarray(bf16_gemm.product(x, stack, layer)), want)
        traced = jax.jit(lambda x, s, l: bf16_gemm.product(x, s, l))(x, stack, layer)
        np.testing.assert_array_equal(np.asarray(traced), want)


def test_leading_axes_are_rows_and_the_jvp_is_xlas():
    x, wt = _operands(2 * 36, 64, 12, seed=2)
    x3 = x.reshape(2, 36, 64)
    np.testing.assert_array_equal(np.asarray(bf16_gemm.product(x3, wt)).reshape(72, 12),
                                  np.asarray(bf16_gemm.product(x, wt)))
    dx = jnp.ones_like(x)
    _, tangent = jax.jvp(lambda a: bf16_gemm.product(a, wt), (x,), (dx,))
    want = jnp.einsum("ri,oi->ro", dx, wt, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_bad_operands_are_errors_naming_them():
    x, wt = _operands(40, 64, 8)
    with pytest.raises(ValueError, match="float32"):
        bf16_gemm.product(x.astype(jnp.float32), wt)
    with pytest.raises(ValueError, match="differ in I"):
        bf16_gemm.product(x[:, :32], wt)
    with pytest.raises(ValueError, match="with a layer"):
        bf16_gemm.product(x, jnp.stack([wt, wt]))
    with pytest.raises(RuntimeError, match="layer out of range"):
        jax.block_until_ready(bf16_gemm.product(x, jnp.stack([wt, wt]), 2))


def test_matmul_t_sends_many_bfloat16_rows_to_it(monkeypatch):
    """Past the few-row kernel's rows, bfloat16 operands go to this kernel where it
    applies (the CPU has the instruction; here it is told so), rounded to bfloat16;
    float32 operands and few rows do not."""
    monkeypatch.setattr(bf16_gemm, "native", lambda: True)
    many = rows_matmul.MAX_ROWS + 1
    x, wt = _operands(many, 64, 16)

    def hlo(x, wt):  # traced anew each time (a new function)
        return jax.jit(lambda x, wt: rows_matmul.matmul_t(x, wt)).lower(x, wt).as_text()

    assert bf16_gemm.TARGET in hlo(x, wt)
    y = rows_matmul.matmul_t(x, wt)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(
        jnp.asarray(instruction_sums(x, wt)).astype(jnp.bfloat16)))
    assert bf16_gemm.TARGET not in hlo(x.astype(jnp.float32), wt.astype(jnp.float32))
    assert bf16_gemm.TARGET not in hlo(x[:many - 1], wt)
    monkeypatch.setattr(bf16_gemm, "native", lambda: False)
    assert bf16_gemm.TARGET not in hlo(x, wt)


def test_its_switch_turns_it_off(monkeypatch):
    """`SPECJAX_CPU_BF16_GEMM=off`: not native, not applied, and a direct call is an
    error naming the switch."""
    x, wt = _operands(rows_matmul.MAX_ROWS + 1, 64, 16)
    monkeypatch.setenv(bf16_gemm.ENV, "off")
    assert not bf16_gemm.native() and not bf16_gemm.applies(x, wt, 1)
    with pytest.raises(RuntimeError, match=bf16_gemm.ENV):
        bf16_gemm.product(x, wt)


def test_a_bfloat16_models_prefill_multiplies_its_weights_as_they_lie(monkeypatch):
    """A bfloat16 model's prefill (more rows than the few-row kernel takes) runs its dense
    layers through the kernel on the stacked bfloat16 weights: the compiled program holds
    no float32 copy of a weight stack (XLA's own product converts each stack once per
    call), and its logits and prompt keys are XLA's up to bfloat16 rounding."""
    from specjax.cache import PagedKVCache
    from specjax.models.transformer import KERNEL_T

    monkeypatch.setattr(bf16_gemm, "native", lambda: True)
    cfg = specjax.config.tiny_llama(num_layers=3, hidden_size=128, num_heads=2,
                                    num_kv_heads=1, dtype="bfloat16")
    model = specjax.Model(cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                            specjax.init_params(cfg, 1)))
    dec = model.decode_params()
    gate = dec["layers"]["mlp"]["gate_proj"][KERNEL_T]
    stack = "f32[" + ",".join(map(str, gate.shape)) + "]"
    cache = PagedKVCache.create(cfg, jnp.arange(8)[None], num_pages=8, page_size=8,
                                lengths=jnp.array([0]))
    tokens = jax.random.randint(jax.random.key(0), (1, 48), 0, cfg.vocab_size)
    positions = jnp.arange(48)[None]
    def run():  # traced anew each time (a new function)
        step = jax.jit(lambda *a: specjax.step(cfg, *a))
        compiled = step.lower(dec, cache, tokens, positions).compile()
        return compiled.as_text(), compiled(dec, cache, tokens, positions)

    hlo, (logits, _, kv) = run()
    assert bf16_gemm.TARGET in hlo and stack not in hlo
    monkeypatch.setattr(bf16_gemm, "native", lambda: False)  # XLA's product
    hlo_xla, (logits_xla, _, kv_xla) = run()
    assert bf16_gemm.TARGET not in hlo_xla and stack in hlo_xla
    # |logits| and |keys| are below 1 here: a bfloat16 rounding step is under 0.008
    np.testing.assert_allclose(np.asarray(logits, np.float32),
                               np.asarray(logits_xla, np.float32), atol=0.01, rtol=0.01)
    np.testing.assert_allclose(np.asarray(kv.k_pages, np.float32),
                               np.asarray(kv_xla.k_pages, np.float32), atol=0.01, rtol=0.01)


def test_the_build_uses_the_instruction_where_the_cpu_has_it():
    """-march=native builds the instruction's path exactly on CPUs that list it (the
    built library answers: a host without it has no such path)."""
    from specjax import cpu_kernels

    assert bf16_gemm.available()
    assert bf16_gemm._built_native() == ("avx512_bf16" in cpu_kernels.cpu_flags().split())


@pytest.mark.parametrize("kv_commit", ["write-kept", "compact"])
def test_speculation_over_a_bfloat16_model_through_it_emits_plain_decodings_tokens(
        monkeypatch, kv_commit):
    """A bfloat16 target drafting for itself at batch 8 runs its prompts' products
    through the kernel and its verifies (8 rows x 5 tokens, past the few-row kernel's
    `MAX_ROWS`) through the few-row kernel, whose sums a plain step's rows get
    (`rows_matmul.any_rows`), and emits plain decoding's tokens."""
    from specjax.decoding.generate import PROGRAMS

    monkeypatch.setattr(bf16_gemm, "native", lambda: True)
    PROGRAMS.clear()  # traced anew: the products counted below are this test's
    jax.clear_caches()
    rows, product = [], bf16_gemm.product

    def counted(x, wt, layer=None, portable=False):
        rows.append(int(np.prod(x.shape[:-1])))
        return product(x, wt, layer, portable)

    monkeypatch.setattr(bf16_gemm, "product", counted)
    few, rows_t = [], rows_matmul._rows_t

    def counted_few(x, wt, layer):
        few.append(int(np.prod(x.shape[:-1])))
        return rows_t(x, wt, layer)

    monkeypatch.setattr(rows_matmul, "_rows_t", counted_few)
    cfg = specjax.config.tiny_llama(vocab_size=96, hidden_size=128, num_heads=2,
                                    num_kv_heads=1, num_layers=3, dtype="bfloat16")
    model = bfloat16_model(cfg, seed=5)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 96, 40)] for _ in range(8)]
    self_drafting_emits_plain(model, prompts, 12, kv_commit=kv_commit)
    assert 8 * 5 in few and 8 * 5 not in rows  # a verify's rows: the few-row kernel's
    assert min(rows) >= 8 * 40  # the prompts' rows: the GEMM's
    PROGRAMS.clear()
