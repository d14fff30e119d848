"""What wrapping a decode step in XLA control flow costs, per step, on this backend.

The speculative loop picks its verify width per step, so its target forward sits inside
a branch (`lax.switch`), while a plain decode loop runs the forward at the loop's top
level. Whether a forward costs more inside the branch than outside it, for the control
flow alone, is what this script measures: the same greedy
one-token step (`specjax.step` on `--target`, by default the packaged SmolLM2-135M-Instruct
in float32, in its decode layout, compiled as `generate` compiles) run `--steps` times in a
`lax.fori_loop`, as

* `bare`: the step at the loop's top level (what plain decoding does);
* `cond`: the step inside `lax.cond` (both branches the step; the predicate is a traced
  value, so XLA keeps the conditional);
* `KV outside`: the forward without writing the cache, keys/values written after it
  (the deferred write the speculative loop uses), at the loop's top level;
* `cond, KV outside`: the same inside `lax.cond`, as the verify switch runs it; its
  ratio to `KV outside` is what the switch adds (`VerifyCost.branch`);
* `while`: the step inside a nested `lax.while_loop` of one trip.

Timed interleaved, median of `--repeats`; ratios to `bare` in the same run.

  python -m specjax.bench.branching [--target CKPT] [--steps 128] [--context 128]
      [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from specjax.cli_args import at_least_one


def programs(config, params, steps: int, with_cache: bool = False):
    """name -> fn(cache, token [B, 1], position [B, 1]) -> last token, per variant
    (with_cache: (last token, final cache), for tests; timed runs return the token)."""
    from specjax.cache import commit_step, write_slots
    from specjax.model import step_kv

    def forward(cache, tok, pos, write=True):
        logits, _, out = step_kv(config, params, cache, tok, pos, write_in_layers=write)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return nxt, (commit_step(out) if write else (out.k, out.v))

    def bare(carry):
        cache, tok, pos = carry
        nxt, cache = forward(cache, tok, pos)  # the written step's cache: lengths + 1
        return cache, nxt, pos + 1

    def in_cond(carry):
        return jax.lax.cond(carry[2][0, 0] >= 0, bare, bare, carry)

    def kv_outside(carry, branch=True):
        cache, tok, pos = carry
        if branch:
            nxt, (k, v) = jax.lax.cond(pos[0, 0] >= 0,
                                       lambda: forward(cache, tok, pos, False),
                                       lambda: forward(cache, tok, pos, False))
        else:
            nxt, (k, v) = forward(cache, tok, pos, False)
        ones = jnp.ones_like(cache.lengths)
        cache = write_slots(cache, k, v, cache.lengths, ones)
        return cache.replace(lengths=cache.lengths + 1), nxt, pos + 1

    def in_while(carry):
        once = jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), bare(c[1])),
                                  (jnp.bool_(True), carry))
        return once[1]

    def loop(body):
        def run(cache, tok, pos):
            cache, tok, _ = jax.lax.fori_loop(0, steps, lambda i, c: body(c), (cache, tok, pos))
            return (tok, cache) if with_cache else tok
        return run

    return {"bare": loop(bare), "cond": loop(in_cond),
            "KV outside": loop(lambda c: kv_outside(c, branch=False)),
            "cond, KV outside": loop(kv_outside), "while": loop(in_while)}


def measure(steps: int, context: int, repeats: int, model) -> dict:
    """Median seconds per step of each variant on `model`, and its ratio to `bare`."""
    from specjax.cache import PagedKVCache
    from specjax.xla_options import compile_decode

    config = model.config
    params = model.decode_params()  # the layout `generate` decodes with
    page = 16
    pages = -(-(context + steps + 1) // page)
    table = jnp.arange(pages, dtype=jnp.int32)[None]
    cache = PagedKVCache.create(config, table, num_pages=pages, page_size=page,
                                lengths=jnp.full((1,), context, jnp.int32))
    args = (cache, jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), context, jnp.int32))
    fns = {}
    for name, fn in programs(config, params, steps).items():
        fns[name] = compile_decode(jax.jit(fn).lower(*args))
        jax.block_until_ready(fns[name](*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved: every variant sees the same machine load
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - t0) / steps)
    base = statistics.median(times["bare"])
    return {name: dict(ms=statistics.median(t) * 1e3, ratio=statistics.median(t) / base)
            for name, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.branching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="anything specjax.load reads (default: "
                    "the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    at_least_one(ap, a, ("steps", "context", "repeats"))
    from specjax.bench.target import load_target

    model = load_target(a.target)
    if a.context + a.steps + 1 > model.config.max_position_embeddings:
        ap.error(f"--context={a.context} + --steps={a.steps} exceed the model's "
                 f"{model.config.max_position_embeddings} positions")
    res = measure(a.steps, a.context, a.repeats, model)
    print(f"{a.target or 'the packaged SmolLM2-135M-Instruct'}, float32; "
          f"jax {jax.__version__}, backend {jax.default_backend()}, {a.steps} steps from a "
          f"{a.context}-token context, median of {a.repeats} interleaved rounds")
    print("| variant | ms per step | vs bare |\n|---|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['ms']:.2f} | {r['ratio']:.2f}x |")
    switch = res["cond, KV outside"]["ms"] / res["KV outside"]["ms"] - 1
    print(f"\nthe verify switch adds {switch:+.3f} of a step (cond, KV outside / KV outside "
          "- 1: VerifyCost.branch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
