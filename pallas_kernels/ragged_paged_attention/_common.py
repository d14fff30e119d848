"""Math and layout shared by the Triton (GPU) and Mosaic (TPU) lowerings.

Both kernels see the same picture. The wrapper flattens the G query heads of one KV head
and the T new tokens into one "row" axis, row r = t * G + g, so one program attends a
block of R rows (several tokens x all their heads) against KV head k: a KV block is
read once for all G heads that share it (GQA/MQA). KV is walked in blocks of C slots
(`pages_per_block` pages of the row's page table); each block updates a float32 online
softmax state (m, l, acc), as in flash attention.

Which slot a row may see is computed from iotas and a few per-row scalars, never read
from a dense [T, S] mask, so ragged lengths, causality and the sliding window cost
nothing in memory. The tree mask among new tokens is packed by the wrapper into int32
bit words, one set of words per row ([rows, W], W = ceil(T / 32)); the kernel picks
bit `rel` (the slot's index among the new tokens) with a shift, which lowers to plain
vector ops on both backends (no gather).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax import kv_quant

WORD_BITS = 32
WORD_SHIFT = 5  # log2(WORD_BITS)


def div(a, b):
    """Floor division of NON-NEGATIVE ints or int32 arrays by a positive int.

    Truncating `lax.div` equals floor division there and, unlike `//` on arrays, needs
    no sign fix-up (Mosaic lowers `sign` only with a known TPU generation).
    """
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(a, jnp.asarray(b, jnp.int32))


def cdiv(a, b):
    """Ceil division of non-negative ints or int32 arrays."""
    return div(a + b - 1, b)


def next_pow2(x: int) -> int:
    """Smallest power of 2 >= x (1 for x <= 1)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def prev_pow2(x: int) -> int:
    """Largest power of 2 <= x (1 for x <= 1)."""
    return 1 << max(int(x).bit_length() - 1, 0)


def num_words(t_len: int) -> int:
    """int32 words needed to hold one query's tree-mask row of `t_len` bits."""
    return cdiv(t_len, WORD_BITS)


# --------------------------------------------------------------------------- layout

def rows_from_q(q: jax.Array, num_kv_heads: int, rows_padded: int) -> jax.Array:
    """[B, T, N, H] -> [B, K, R_pad, H], row r = t * G + g; padding rows are zeros."""
    b, t, n, h = q.shape
    g = n // num_kv_heads
    x = q.reshape(b, t, num_kv_heads, g, h).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H]
    x = x.reshape(b, num_kv_heads, t * g, h)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows_padded - t * g), (0, 0)))


def q_from_rows(o: jax.Array, t_len: int, num_heads: int) -> jax.Array:
    """Inverse of `rows_from_q`: [B, K, R_pad, H] -> [B, T, N, H]."""
    b, k, _, h = o.shape
    g = num_heads // k
    o = o[:, :, : t_len * g].reshape(b, k, t_len, g, h).transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t_len, num_heads, h)


def mask_words(mask: jax.Array, group: int, rows_padded: int) -> jax.Array:
    """Tree mask [B, T, T] bool -> bit words per row [B, R_pad, W] int32.

    Bit i of word w of row r = t * G + g is `mask[b, t, 32 * w + i]`. Padding rows and
    bits past T are 0 (see nothing among the new tokens).
    """
    b, t, _ = mask.shape
    w = num_words(t)
    bits = jnp.pad(mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, w * WORD_BITS - t)))
    bits = bits.reshape(b, t, w, WORD_BITS) << jnp.arange(WORD_BITS, dtype=jnp.uint32)
    words = lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)
    words = jnp.repeat(words, group, axis=1)  # [B, T * G, W]
    return jnp.pad(words, ((0, 0), (0, rows_padded - t * group), (0, 0)))


def pad_page_table(page_table: jax.Array, num_pages: int, multiple: int) -> jax.Array:
    """Clips ids into [0, P) (entries past a row's length are never read into the output
    but must be safe to address) and pads M to a multiple of `multiple`."""
    m = page_table.shape[1]
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    return jnp.pad(pt, ((0, 0), (0, cdiv(m, multiple) * multiple - m)))


# int8 pages are specjax's int8 KV cache format (`specjax.kv_quant`): one float32 scale
# per token and KV head. Pages [K, P, Z, H] are its [..., H] with scales [K, P, Z].
quantize_pages = kv_quant.quantize
dequantize_pages = kv_quant.dequantize


def to_compute(x: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """In-kernel: a KV block [C, H] in q's dtype; int8 times its per-slot scales [C, 1]."""
    if scales is None:
        return x if x.dtype == dtype else x.astype(dtype)
    return (x.astype(jnp.float32) * scales).astype(dtype)


# --------------------------------------------------------------------------- ranges

def kv_block_range(kv_len, q_len, row0, *, block_rows: int, block_kv: int, group: int,
                   causal: bool, sliding_window: int | None):
    """[lo, hi) of the KV blocks a row block can see; blocks outside are skipped.

    Causal rows (no tree mask) never see past the slot of their last token; a sliding
    window hides everything before the first token's window.
    """
    start = kv_len - q_len
    end = kv_len
    if causal:
        t_last = div(row0 + block_rows - 1, group)
        end = jnp.minimum(end, start + t_last + 1)
    hi = cdiv(jnp.maximum(end, 0), block_kv)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        first = start + div(row0, group) - sliding_window + 1
        lo = jnp.minimum(div(jnp.maximum(first, 0), block_kv), hi)
    return lo, hi


# --------------------------------------------------------------------------- math

def load_words(words_ref):
    """Tree-mask word columns [R, 1] from a [R, W] ref (None stays None)."""
    if words_ref is None:
        return None
    return [words_ref[:, w:w + 1] for w in range(words_ref.shape[1])]


def allowed(shape, row0, col0, kv_len, q_len, words, *, group: int,
            sliding_window: int | None):
    """Which (row, slot) pairs of a [R, C] block are attended: the contract's mask.

    row0/col0: first row / KV slot of the block; words: the W tree-mask word columns,
    each [R, 1] int32 (loaded one by one from the ref: Triton cannot slice a value),
    or None for causal.
    """
    rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    t = div(rows, group)  # query token of each row
    j = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)  # KV slot of each column
    start = kv_len - q_len
    rel = j - start  # slot index among the new tokens (< 0: prefix)
    if words is None:
        new_ok = rel <= t
    else:
        bit_idx = rel & (WORD_BITS - 1)
        new_ok = None
        for w, word in enumerate(words):
            bit = ((word >> bit_idx) & 1) != 0
            if len(words) > 1:
                bit &= (rel >> WORD_SHIFT) == w
            new_ok = bit if new_ok is None else new_ok | bit
    ok = (rel < 0) | ((rel < q_len) & new_ok)
    if sliding_window is not None:
        ok &= (start + t - j) < sliding_window
    return ok


def init_state(rows: int, head_dim: int):
    """Empty online-softmax state: running max m, denominator l [R, 1], numerator acc [R, H]."""
    m = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows, 1), jnp.float32)
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    return m, l, acc


def attend_block(q, k, v, state, ok, kv_len, col0, *, scale: float,
                 soft_cap: float | None):
    """One flash step: fold KV block (k, v) [C, H] into the state of rows q [R, H].

    Masked scores are -inf and their probabilities exactly 0; the running max is
    replaced by 0 while a row has seen nothing, so no -inf - -inf NaN appears and a row
    that sees nothing ends with l = 0 (output 0, as the reference). V slots at or past
    kv_len are zeroed, so NaN there cannot leak through 0 * NaN.
    """
    m_prev, l_prev, acc_prev = state
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # [R, C]
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(ok, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)  # [R, 1] rescales the old state
    p = jnp.exp(s - m_safe)  # [R, C], 0 where masked
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    slot = col0 + lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where(slot < kv_len, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def finalize(l, acc):
    """acc / l, with rows that saw nothing (l = 0) giving 0."""
    return acc / jnp.where(l > 0, l, 1.0)


def combine_splits(m, l, acc):
    """Merge per-split states [S, ..., R, 1|H] (flash-decoding) into the output [..., R, H]."""
    m_all = jnp.max(m, axis=0)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp(m - m_safe)  # [S, ..., R, 1]
    return finalize(jnp.sum(w * l, axis=0), jnp.sum(w * acc, axis=0))
