"""Input checks in two places: static (shapes, dtypes, options: at trace time, always on)
and dynamic (values: `check_inputs`, opt-in, on concrete arrays). Errors name the value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def static_check(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask, *, scale,
                 soft_cap, sliding_window, k_scales=None, v_scales=None) -> None:
    """Shapes, dtypes and options; raises ValueError naming the offending value."""
    if q.ndim != 4:
        raise ValueError(f"{q.shape=} must be [B, T, N, H]")
    if k_pages.ndim != 4:
        raise ValueError(f"{k_pages.shape=} must be [K, P, Z, H]")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} and {v_pages.shape=} must match")
    b, t, n, h = q.shape
    kh, p, z, hk = k_pages.shape
    if hk != h:
        raise ValueError(f"head_dim of q ({h}) and pages ({hk}) must match; {q.shape=}, "
                         f"{k_pages.shape=}")
    if n % kh:
        raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={kh}")
    if min(b, t, p, z, h) < 1:
        raise ValueError(f"empty axis: {q.shape=}, {k_pages.shape=}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{q.dtype=} must be one of float32, bfloat16, float16")
    quantized = k_pages.dtype == jnp.int8
    if quantized:
        if v_pages.dtype != jnp.int8:
            raise ValueError(f"{v_pages.dtype=} must be int8 like {k_pages.dtype=}")
        for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
            if x is None:
                raise ValueError(f"{name}=None: int8 pages need per-slot scales [K, P, Z]")
            if x.shape != (kh, p, z) or x.dtype != jnp.float32:
                raise ValueError(f"{name}.shape={x.shape}, {name}.dtype={x.dtype} must be "
                                 f"({kh}, {p}, {z}) float32")
    elif k_pages.dtype not in SUPPORTED_DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"{k_pages.dtype=} and {v_pages.dtype=} must be one float dtype "
                         "(float32, bfloat16, float16) or int8 with scales")
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"k_scales/v_scales are for int8 pages, not {k_pages.dtype=}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"{page_table.shape=} must be [B={b}, M]")
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    for name, x in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x.shape != (b,):
            raise ValueError(f"{name}.shape={x.shape} must be (B,)=({b},)")
    if mask is not None:
        if mask.shape != (b, t, t):
            raise ValueError(f"{mask.shape=} must be [B, T, T]=({b}, {t}, {t})")
        if mask.dtype != jnp.bool_:
            raise ValueError(f"{mask.dtype=} must be bool")
    if not (isinstance(scale, (int, float)) and np.isfinite(scale)):
        raise ValueError(f"{scale=} must be a finite Python number (a static value)")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be None or > 0")
    if sliding_window is not None and not (isinstance(sliding_window, int)
                                           and sliding_window >= 1):
        raise ValueError(f"{sliding_window=} must be None or an int >= 1")


def check_block_sizes(*, lowering: str, interpret: bool, block_rows: int,
                      pages_per_block: int, kv_splits: int, page_size: int,
                      head_dim: int, num_warps: int | None = None,
                      num_stages: int | None = None) -> None:
    """Block sizes the chosen lowering can compile (interpret mode checks the same rules,
    so CPU tests catch a configuration a GPU/TPU would reject). `num_warps` and
    `num_stages` are the caller's Triton options (None: the tuned table's)."""
    if lowering == "mosaic" and (num_warps, num_stages) != (None, None):
        raise ValueError(f"{num_warps=} and {num_stages=} are Triton options; leave them "
                         "None on the mosaic lowering")
    if num_warps is not None and (not _is_pow2(num_warps) or num_warps > 32):
        raise ValueError(f"{num_warps=} must be a power of 2 <= 32")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"{num_stages=} must be >= 1")
    if not _is_pow2(block_rows) or block_rows < 8:
        raise ValueError(f"{block_rows=} must be a power of 2 >= 8")
    if not _is_pow2(pages_per_block):
        raise ValueError(f"{pages_per_block=} must be a power of 2")
    if kv_splits < 1:
        raise ValueError(f"{kv_splits=} must be >= 1")
    if lowering == "mosaic" and kv_splits != 1:
        raise ValueError(f"{kv_splits=} must be 1 on the mosaic lowering (its grid is "
                         "sequential; splits would only add a merge pass)")
    if lowering == "triton" and not interpret:
        # Triton loads/dots: power-of-2 tensors, every dot dim >= 16.
        if block_rows < 16:
            raise ValueError(f"{block_rows=} must be >= 16 for Triton dots")
        if not _is_pow2(page_size):
            raise ValueError(f"{page_size=} must be a power of 2 for the Triton lowering")
        if not _is_pow2(head_dim) or head_dim < 16:
            raise ValueError(f"{head_dim=} must be a power of 2 >= 16 for the Triton "
                             "lowering")
        if pages_per_block * page_size < 16:
            raise ValueError(f"{pages_per_block=} x {page_size=} must be >= 16 KV slots "
                             "for Triton dots")


def check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_lens, mask=None, k_scales=None,
                 v_scales=None) -> None:
    """Dynamic checks on concrete values (outside jit): raises ValueError naming the row.

    * 0 <= q_lens[b] <= T and q_lens[b] <= kv_lens[b] <= M * Z (the table's capacity);
    * every page a row reads (its first ceil(kv_lens[b] / Z) table entries) is in [0, P).
    Entries past a row's pages and the contents of unused pages (and their scales) are
    free (never read into the output), as the mask's rows and columns past q_lens[b] are.
    """
    del mask, k_scales, v_scales  # any values are valid
    if any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lens, q_lens)):
        raise ValueError("check_inputs needs concrete arrays; call it outside jit (or "
                         "pass validate=False under a trace)")
    t = q.shape[1]
    _, p, z, _ = k_pages.shape
    table = np.asarray(page_table)
    kv = np.asarray(kv_lens)
    ql = np.asarray(q_lens)
    capacity = table.shape[1] * z
    for b in range(table.shape[0]):
        if not 0 <= ql[b] <= t:
            raise ValueError(f"q_lens[{b}]={ql[b]} must be in [0, T={t}]")
        if not ql[b] <= kv[b] <= capacity:
            raise ValueError(f"kv_lens[{b}]={kv[b]} must be in [q_lens[{b}]={ql[b]}, "
                             f"M*Z={capacity}] (M={table.shape[1]}, page_size={z})")
        used = table[b, : -(-int(kv[b]) // z)]
        bad = np.flatnonzero((used < 0) | (used >= p))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"page_table[{b}, {i}]={used[i]} must be in [0, "
                             f"num_pages={p}) (row {b} reads its first {used.size} pages)")
