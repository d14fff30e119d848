"""What paged attention over the KV cache costs a decode step or a verify forward on
XLA:CPU: the CPU kernel (`specjax.cpu_attention`, what generate runs) beside the jnp
reference forms it replaced, the new tokens in the pages or beside them (`new_kv`, the
verify forwards' form).

One program per (form, KV cache dtype, T) attends T queries per row (`--batch` rows,
each its own pages in order) over `--context` cached tokens in every one of `--layers`
layers, SmolLM2-135M's shapes by default (3 KV heads of 3 queries, head dim 64), the
pages stacked [L, K, P, Z, H] and the layer index opaque to XLA as in the CPU decode
layout; random seeded pages and queries, stored as each of `--kv-dtypes` (int8: with
per-token scales, `specjax.kv_quant`); causal mask among the T new tokens. Interleaved
rounds in a seeded order, medians (`specjax.timing.interleaved_medians`).

  python -m specjax.bench.paged_attention [--queries 1,5,17] [--contexts 200,1024]
      [--layers 30] [--kv-heads 3] [--group 3] [--head-dim 64] [--repeats 20]
      [--batch 1] [--kv-dtypes float32] [--kernel-only]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_attention, kv_quant
from specjax.attention import reference_attention_with_new, reference_paged_attention
from specjax.cli_args import at_least_one, comma_list
from specjax.timing import interleaved_medians
from specjax.xla_options import compile_decode

FORMS = ("jnp, in pages", "jnp, beside", "kernel, in pages", "kernel, beside")
KERNEL_FORMS = FORMS[2:]  # `--kernel-only`
KV_DTYPES = ("float32", "bfloat16", "int8")
PAGE = 16


def inputs(t: int, context: int, layers: int, kv_heads: int, group: int, head: int,
           seed: int = 0, batch: int = 1, kv_dtype: str = "float32") -> dict:
    """`batch` rows: stacked pages of `kv_dtype` holding each row's `context` + t tokens'
    slots (plus a page; a row's pages one after another, as a prompt's are allocated)
    and, for int8, their scales; the table, queries, the new tokens' keys/values (as
    the cache would hand them back) and lengths, seeded."""
    rng = np.random.default_rng(seed)
    pages = -(-(context + t) // PAGE) + 1  # per row

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    def stored(x):  # (pages, scales or None) as a cache of kv_dtype holds them
        if kv_dtype == "int8":
            return kv_quant.quantize(x)
        return x.astype(kv_dtype), None

    (kp, ks), (vp, vs) = (stored(normal(layers, kv_heads, batch * pages, PAGE, head))
                          for _ in range(2))
    return dict(q=normal(batch, t, kv_heads * group, head), k_pages=kp, v_pages=vp,
                k_scales=ks, v_scales=vs,
                table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages),
                k_new=kv_quant.as_cached(normal(batch, t, kv_heads, head), kp.dtype),
                v_new=kv_quant.as_cached(normal(batch, t, kv_heads, head), kp.dtype),
                kv_lens=jnp.full((batch,), context + t, jnp.int32),
                q_lens=jnp.full((batch,), t, jnp.int32))


def program(form: str, a: dict):
    """`form`'s attention over every layer, each layer's output fed to the next one's
    queries (so no layer is dead code), compiled as generate compiles."""
    b, t = a["q"].shape[:2]
    mask = None if t == 1 else jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    scale = a["q"].shape[-1] ** -0.5
    layers = a["k_pages"].shape[0]

    def run(q, kp, vp, kn, vn, ks, vs):
        for i in range(layers):
            layer = jax.lax.optimization_barrier(jnp.int32(i))
            scales = {} if ks is None else dict(k_scales=ks[layer], v_scales=vs[layer])
            if form.startswith("kernel"):
                new = (kn, vn) if form.endswith("beside") else None
                out = cpu_attention.paged_attention(q, kp, vp, layer, a["table"], a["kv_lens"],
                                                    a["q_lens"], mask, scale=scale, new_kv=new,
                                                    k_scales=ks, v_scales=vs)
            elif form.endswith("beside"):
                out = reference_attention_with_new(q, kn, vn, a["q_lens"], mask, kp[layer],
                                                   vp[layer], a["table"],
                                                   a["kv_lens"] - a["q_lens"], scale=scale,
                                                   **scales)
            else:
                out = reference_paged_attention(q, kp[layer], vp[layer], a["table"],
                                                a["kv_lens"], a["q_lens"], mask, scale=scale,
                                                **scales)
            q = q + 1e-3 * out
        return q

    args = tuple(a[k] for k in ("q", "k_pages", "v_pages", "k_new", "v_new", "k_scales",
                                "v_scales"))
    return compile_decode(jax.jit(run).lower(*args)), args


def measure(queries, contexts, repeats: int, forms=FORMS, kv_dtypes=("float32",),
            **shape) -> dict:
    """Median seconds of each (form, KV cache dtype, context, T), over `repeats`
    interleaved rounds."""
    programs = {}
    for c in contexts:
        for t in queries:
            for dt in kv_dtypes:
                a = inputs(t, c, kv_dtype=dt, **shape)
                for form in forms:
                    fn, args = program(form, a)
                    fn(*args).block_until_ready()
                    programs[form, dt, c, t] = (fn, args)
    return interleaved_medians(programs, repeats)


def markdown(seconds: dict, queries, contexts, forms=FORMS, kv_dtypes=("float32",)) -> str:
    """One row per (context, T, KV cache dtype): ms per form; when the jnp forms ran,
    their time over the kernel's, new tokens in the pages and beside them; and beside
    other dtypes than float32, the kernel's time over its time on float32 pages."""
    ratios = ((("in pages", FORMS[0], FORMS[2]), ("beside", FORMS[1], FORMS[3]))
              if set(FORMS) <= set(forms) else ())
    vs_f32 = ([f for f in KERNEL_FORMS if f in forms]
              if "float32" in kv_dtypes and len(kv_dtypes) > 1 else [])
    columns = [*(f"{f}, ms" for f in forms), *(f"jnp / kernel, {n}" for n, _, _ in ratios),
               *(f"{f} / float32 pages'" for f in vs_f32)]
    lines = ["| context | T | KV cache | " + " | ".join(columns) + " |",
             "|---:|---:|:---|" + "---:|" * len(columns)]
    for c in contexts:
        for t in queries:
            for dt in kv_dtypes:
                cells = [f"{seconds[f, dt, c, t] * 1e3:.2f}" for f in forms]
                cells += [f"{seconds[a, dt, c, t] / seconds[b, dt, c, t]:.2f}"
                          for _, a, b in ratios]
                cells += [f"{seconds[f, dt, c, t] / seconds[f, 'float32', c, t]:.2f}"
                          for f in vs_f32]
                lines.append(f"| {c} | {t} | {dt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.paged_attention",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", default="1,5,17", help="T values: new tokens per call")
    ap.add_argument("--contexts", default="200,1024", help="cached tokens before them")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20, help="interleaved timed rounds")
    ap.add_argument("--batch", type=int, default=1, help="rows, each over --context tokens")
    ap.add_argument("--kv-dtypes", default="float32",
                    help=f"KV cache dtypes the pages are stored as, of {KV_DTYPES}")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time the kernel's two forms alone: a quicker A/B of kernel "
                         "changes, runs alternating between checkouts")
    args = ap.parse_args(argv)
    queries = tuple(comma_list(ap, "--queries", args.queries, int, minimum=1))
    contexts = tuple(comma_list(ap, "--contexts", args.contexts, int, minimum=1))
    kv_dtypes = tuple(comma_list(ap, "--kv-dtypes", args.kv_dtypes, choices=KV_DTYPES))
    at_least_one(ap, args, ("layers", "kv_heads", "group", "head_dim", "repeats", "batch"))
    if args.head_dim % cpu_attention.HEAD_MULTIPLE:
        ap.error(f"--head-dim={args.head_dim} must be a multiple of "
                 f"{cpu_attention.HEAD_MULTIPLE} (the kernel's)")
    if not cpu_attention.available():
        ap.error("the CPU attention kernel is unavailable (it warned why)")
    shape = dict(layers=args.layers, kv_heads=args.kv_heads, group=args.group,
                 head=args.head_dim, batch=args.batch)
    forms = KERNEL_FORMS if args.kernel_only else FORMS
    seconds = measure(queries, contexts, args.repeats, forms=forms, kv_dtypes=kv_dtypes,
                      **shape)
    print(markdown(seconds, queries, contexts, forms, kv_dtypes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
