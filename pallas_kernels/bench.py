"""Benchmark of the ragged paged attention kernel against JAX's Pallas GPU paged attention
and the jnp reference under XLA.

    python -m specjax.pallas_kernels.bench                # on a GPU: the full table
    python -m specjax.pallas_kernels.bench --small        # anywhere (CPU: interpret mode), tiny
    python -m specjax.pallas_kernels.bench --tune         # sweep block sizes, print table entries
    python -m specjax.pallas_kernels.bench --int8         # int8 KV pages with per-slot scales

First it measures the device's memory bandwidth with a large elementwise copy
(read + write). Then, for a Llama-3-8B attention layer (32 query heads, 8 KV heads,
head_dim 128, bf16, 16-slot pages): decode T=1 at batch 1/8/32 x context 1k/4k/16k,
and verify T=5/16/64 (causal chain and random tree) at the same batches, context 4k.
Each row: median time, the bytes a kernel must move (every visible KV slot once, plus
q, the output and the page table), that as % of the measured bandwidth, and the max
abs difference from the reference (so a fast wrong kernel shows). All
implementations are scored against the same byte count, so % compares them directly.
JAX's `paged_attention` has no T axis: verify runs it with the T queries folded into
the batch (query t of a row = a row of length kv_len - T + t + 1), i.e. a causal
chain; it has no tree mask, so tree rows compare only ours with the reference.

On CPU every Pallas kernel runs in interpret mode: the times measure the interpreter,
not a kernel; `--small` exists so this script is run (and stays unbroken) in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.pallas_kernels.ragged_paged_attention import (
    TUNED_BLOCK_SIZES,
    BlockSizes,
    dequantize_pages,
    native_lowering,
    quantize_pages,
    ragged_paged_attention,
    reference_ragged_paged_attention,
    resolve_block_sizes,
    tuned_block_sizes as tuned,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark case: a batch of rows at one context length."""

    batch: int
    context: int  # KV length of every row, new tokens included
    t_len: int
    tree: bool = False
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16

    @property
    def name(self) -> str:
        kind = ("decode" if self.t_len == 1 else "tree" if self.tree else
                "chain" if self.t_len <= tuned.VERIFY_MAX_T else "prefill")
        return f"{kind} T={self.t_len} B={self.batch} ctx={self.context}"


def cases(small: bool) -> list[Shape]:
    if small:
        heads = dict(num_heads=4, num_kv_heads=2, head_dim=64)
        out = [Shape(b, c, 1, **heads) for b in (1, 2) for c in (64, 128)]
        return out + [Shape(2, 128, t, tree, **heads) for t in (5, 16) for tree in (False, True)]
    out = [Shape(b, c, 1) for b in (1, 8, 32) for c in (1024, 4096, 16384)]
    return out + [Shape(b, 4096, t, tree) for t in (5, 16, 64) for b in (1, 8, 32)
                  for tree in (False, True)]


def make_inputs(s: Shape, dtype, seed: int = 0, int8: bool = False) -> dict:
    """Random q and pages (int8 + per-slot scales if asked); each row owns its own
    shuffled pages; trees are random."""
    rng = np.random.default_rng(seed)
    m = -(-s.context // s.page_size)
    num_pages = s.batch * m
    kv_shape = (s.num_kv_heads, num_pages, s.page_size, s.head_dim)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    mask = None
    if s.tree:
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, s.t_len)]
        tree = np.zeros((s.t_len, s.t_len), bool)
        for i in range(s.t_len):
            j = i
            while j >= 0:
                tree[i, j], j = True, parents[j]
        mask = jnp.asarray(np.broadcast_to(tree, (s.batch, s.t_len, s.t_len)))
    inputs = dict(
        q=jax.random.normal(k1, (s.batch, s.t_len, s.num_heads, s.head_dim), dtype),
        k_pages=jax.random.normal(k2, kv_shape, dtype),
        v_pages=jax.random.normal(k3, kv_shape, dtype),
        page_table=jnp.asarray(rng.permutation(num_pages).reshape(s.batch, m), jnp.int32),
        kv_lens=jnp.full((s.batch,), s.context, jnp.int32),
        q_lens=jnp.full((s.batch,), s.t_len, jnp.int32),
        mask=mask)
    if int8:
        inputs["k_pages"], inputs["k_scales"] = quantize_pages(inputs["k_pages"])
        inputs["v_pages"], inputs["v_scales"] = quantize_pages(inputs["v_pages"])
    return inputs


def dequantized(a: dict) -> dict:
    """The inputs with int8 pages turned back into q's dtype (for the reference)."""
    if "k_scales" not in a:
        return a
    a = dict(a)
    for name in ("k", "v"):
        a[f"{name}_pages"] = dequantize_pages(a[f"{name}_pages"], a.pop(f"{name}_scales"),
                                              a["q"].dtype)
    return a


def bytes_moved(s: Shape, dtype, int8: bool = False) -> int:
    """What any implementation must move: visible KV once (int8: + a float32 scale per
    slot), q, out, page table, lengths."""
    item = jnp.dtype(dtype).itemsize
    slot_bytes = s.head_dim + 4 if int8 else s.head_dim * item
    kv = 2 * s.batch * s.context * s.num_kv_heads * slot_bytes
    qo = 2 * s.batch * s.t_len * s.num_heads * s.head_dim * item
    table = 4 * s.batch * (-(-s.context // s.page_size) + 2)
    return kv + qo + table


def time_it(fn, *args, iters: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn(*args)` (compiled once, results awaited)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int, iters: int) -> float:
    """Bytes/s of a large elementwise copy (x * 2: one read, one write)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    fn = jax.jit(lambda x: x * 2)
    return 2 * x.nbytes / time_it(fn, x, iters=iters)


def implementations(s: Shape, interpret: bool, scale: float, sizes: dict | None = None):
    """name -> function of the `make_inputs` dict; None where an implementation can't run."""
    ours = lambda a: ragged_paged_attention(**a, scale=scale, **(sizes or {}))  # noqa: E731
    ref = jax.jit(lambda a: reference_ragged_paged_attention(**dequantized(a), scale=scale))
    impls = {"pallas ragged (ours)": ours, "jax pallas gpu paged_attention": None,
             "jnp reference (XLA)": ref}
    if not s.tree and (interpret or jax.default_backend() == "gpu"):
        impls["jax pallas gpu paged_attention"] = jax_paged_attention(s, interpret, scale)
    return impls


def jax_paged_attention(s: Shape, interpret: bool, scale: float):
    """JAX's Pallas GPU decode kernel; T > 1 as a causal chain folded into the batch."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    m = -(-s.context // s.page_size)
    k_splits = min(16, m)
    while m % k_splits:
        k_splits //= 2

    @jax.jit
    def fn(a):
        b, t, n, h = a["q"].shape
        q = (a["q"] * scale).reshape(b * t, n, h)  # the kernel applies no scale
        table = jnp.repeat(a["page_table"], t, axis=0)
        lengths = (a["kv_lens"][:, None] - t + 1 + jnp.arange(t)[None, :]).reshape(-1)
        out = jax_pa.paged_attention(q, a["k_pages"], a["v_pages"], table, lengths,
                                     a.get("k_scales"), a.get("v_scales"),
                                     k_splits=k_splits, interpret=interpret)
        return out.reshape(b, t, n, h)

    return fn


def run_table(args, interpret: bool) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    bw = measure_bandwidth(args.copy_mib << 20, args.iters)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"interpret={interpret}, copy bandwidth: {bw / 1e9:.1f} GB/s")
    print(f"{'case':<30} {'implementation':<32} {'time us':>10} {'MB moved':>9} "
          f"{'% bw':>7} {'max err':>8}")
    results = []
    for s in cases(args.small):
        if not re.search(args.only, s.name):
            continue
        a = make_inputs(s, dtype, int8=args.int8)
        moved = bytes_moved(s, dtype, int8=args.int8)
        scale = s.head_dim ** -0.5
        impls = implementations(s, interpret, scale)
        want = np.asarray(impls["jnp reference (XLA)"](a), np.float32)
        for name, fn in impls.items():
            if fn is None:
                print(f"{s.name:<30} {name:<32} {'n/a':>10}")
                continue
            err = float(np.max(np.abs(np.asarray(fn(a), np.float32) - want)))
            sec = time_it(fn, a, iters=args.iters)
            pct = 100 * moved / sec / bw
            print(f"{s.name:<30} {name:<32} {sec * 1e6:>10.1f} {moved / 1e6:>9.2f} "
                  f"{pct:>6.1f}% {err:>8.1e}")
            results.append(dict(case=s.name, impl=name, seconds=sec, bytes=moved,
                                pct_bandwidth=pct, max_abs_err=err))
    return [dict(device=jax.devices()[0].device_kind, interpret=interpret,
                 bandwidth_bytes_per_s=bw, date=datetime.date.today().isoformat(),
                 command=" ".join(sys.argv), dtype=str(dtype), int8=args.int8)] + results


def tune_shapes(small: bool) -> dict[str, Shape]:
    """One representative shape per regime, for `--tune` (and `compile_check --sweep`)."""
    reps = {tuned.DECODE: Shape(8, 4096, 1), tuned.VERIFY: Shape(8, 4096, 16, tree=True),
            tuned.PREFILL: Shape(1, 4096, 512)}
    if small:
        reps = {k: dataclasses.replace(v, batch=2, context=128, num_heads=4, num_kv_heads=2,
                                       head_dim=64, t_len=min(v.t_len, 80))
                for k, v in reps.items()}
    return reps


def tune_grid(small: bool) -> list[tuple[int, int, int, int]]:
    """`--tune`'s candidates: (block_rows, block_kv slots, kv_splits, num_warps). 8 warps
    only for blocks of >= 64 rows: with 4, those need 250+ registers a thread on sm_90
    (docs/kernels.md, compile_check)."""
    if small:
        return list(itertools.product((16, 32), (16, 32), (1, 2), (4,)))
    return [(rows, kv, splits, warps)
            for rows, kv, splits in itertools.product((16, 32, 64, 128), (32, 64, 128, 256),
                                                      (1, 2, 4, 8, 16))
            for warps in ((4, 8) if rows >= 64 else (4,))]


def resolve_for(s: Shape, dtype, **options) -> dict:
    """`resolve_block_sizes` for shape `s`: the static options `ragged_paged_attention`
    would pick for it (`options`: lowering, interpret, device_kind, requested sizes)."""
    return resolve_block_sizes(
        (s.batch, s.t_len, s.num_heads, s.head_dim), (s.num_kv_heads, 1, s.page_size, s.head_dim),
        -(-s.context // s.page_size), dtype, **options)


def tune_candidates(s: Shape, small: bool, dtype, *, lowering: str, interpret: bool,
                    device_kind: str | None = None) -> list[dict]:
    """The distinct kernels of `tune_grid` for shape `s`: each candidate fitted as
    `ragged_paged_attention` would fit it (block_rows shrinks to T x G, ...), repeats
    dropped; Mosaic takes no splits or warps. Options a lowering rejects are left out."""
    out, seen = [], set()
    for block_rows, block_kv, splits, warps in tune_grid(small):
        requested = dict(block_rows=block_rows, pages_per_block=max(1, block_kv // s.page_size))
        if lowering == "triton":
            requested |= dict(kv_splits=splits, num_warps=warps)
        elif splits > 1 or warps != 4:
            continue
        try:
            opts = resolve_for(s, dtype, lowering=lowering, interpret=interpret,
                               device_kind=device_kind, **requested)
        except ValueError as e:
            print(f"  skip {requested}: {e}")
            continue
        if lowering != "triton":
            del opts["num_warps"], opts["num_stages"]
        key = tuple(sorted(opts.items()))
        if key not in seen:
            seen.add(key)
            out.append(opts)
    return out


def table_entry(s: Shape, sizes: dict) -> BlockSizes:
    """The `TUNED_BLOCK_SIZES` entry from which `resolve_block_sizes` picks `sizes` for
    shape `s` again: `min_programs` is the grid that yields `sizes`' KV splits."""
    row_blocks = -(-s.t_len * (s.num_heads // s.num_kv_heads) // sizes["block_rows"])
    splits = sizes.get("kv_splits", 1)
    return BlockSizes(block_rows=sizes["block_rows"],
                      block_kv=sizes["pages_per_block"] * s.page_size,
                      min_programs=s.batch * s.num_kv_heads * row_blocks * splits,
                      num_warps=sizes.get("num_warps", 4),
                      num_stages=sizes.get("num_stages", 2))


def run_tune(args, interpret: bool) -> None:
    """Sweeps block sizes on one representative shape per regime; prints table entries."""
    dtype = jnp.dtype(args.dtype)
    lowering = native_lowering() or "triton"
    print(f"# measured {datetime.date.today()} on {jax.devices()[0].device_kind}: "
          f"{' '.join(sys.argv)}")
    for regime, s in tune_shapes(args.small).items():
        if not re.search(args.only, s.name):
            continue
        a = make_inputs(s, dtype)
        best = None
        for sizes in tune_candidates(s, args.small, dtype, lowering=lowering,
                                     interpret=interpret):
            fn = implementations(s, interpret, 0.1, sizes)["pallas ragged (ours)"]
            try:
                sec = time_it(fn, a, iters=args.iters, warmup=1)
            except Exception as e:  # a size the compiler rejects (shared memory...): skip
                print(f"  skip {sizes}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if best is None or sec < best[0]:
                best = (sec, sizes)
        sec, sizes = best
        print(f"    {regime.upper()}: {table_entry(s, sizes)},  # {s.name}: {sec * 1e6:.1f} us")
    print(f"# current table: {TUNED_BLOCK_SIZES}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU, CI)")
    parser.add_argument("--tune", action="store_true", help="sweep block sizes")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default) or float32")
    parser.add_argument("--int8", action="store_true", help="int8 KV pages + scales")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--copy-mib", type=int, default=None, help="bandwidth copy size")
    parser.add_argument("--only", default="",
                        help="regex: run only matching case names (--tune: regimes' shapes)")
    parser.add_argument("--json", default=None, help="write results as JSON lines here")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() == "cpu"
    if interpret and not args.small:
        parser.error("no GPU/TPU: the full sizes would take hours in interpret mode; "
                     "use --small (interpret-mode timings are not kernel performance)")
    args.dtype = args.dtype or ("float32" if interpret else "bfloat16")
    args.iters = args.iters or (3 if args.small else 50)
    args.copy_mib = args.copy_mib or (64 if args.small else 4096)
    if args.tune:
        run_tune(args, interpret)
        return
    results = run_table(args, interpret)
    if args.json:
        with open(args.json, "w") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
