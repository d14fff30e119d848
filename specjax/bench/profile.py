"""Where a decode step's time goes: per-op times of `generate`'s compiled decode loop.

jax.profiler records every XLA:CPU op (thunk) the loop runs; XLA's own HLO dump
(`--xla_dump_to`) gives each op the model code it came from (its `op_name` metadata).
This script joins the two and sums each part of the model per decode step: the attention
projections, the attention over the KV cache, the MLP, the LM head, norms and the rest
(sampling, stopping, loop bookkeeping). Weights are read once per step, so the matmul
rows also show the bandwidth they reach.

  python -m specjax.bench.profile [--target CKPT] [--batch 1] [--new 64] [--temperature 0]
      [--speculator ngram|draft|eagle] [--workdir RUN] [--llamacpp GGUF]

Plain decoding by default; `--speculator` profiles that method's loop at full depth (the
draft and the EAGLE head a quickstart run in `--workdir` trained), or with `--shallow`
drafting one level a step. A speculative step's
phases (the adaptive rule, the draft calls and tree, the verification, the commit) are
parts of their own: the decode loop runs each in a `jax.named_scope`.
`--llamacpp` times llama.cpp's decode step beside specjax's, untraced, one row at a time
on 4 HumanEval prompts. `--temperature` samples (both sides): what sampling adds to a step.
It compiles afresh (no persistent cache: a cache hit would skip XLA's dump).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from specjax.bench.target import GGUF_TYPES
from specjax.decoding.speculate import SCOPE_ACCEPT, SCOPE_COMMIT, SCOPE_DECIDE, SCOPE_PROPOSE

LOOP_MODULE = "jit_run"  # the decode loop's program (`DecodeLoop.run`)
MODEL_PARTS = ("attention projections (q, k, v, o)", "attention over the KV cache", "MLP",
               "LM head", "norms and residuals", "sampling and loop bookkeeping")
# a speculative step's phases, by the `jax.named_scope` the decode loop runs them in
SCOPES = {SCOPE_DECIDE: "adaptive rule", SCOPE_PROPOSE: "speculator: draft calls and tree",
          SCOPE_ACCEPT: "verification", SCOPE_COMMIT: "commit (tokens, KV, speculator state)"}
PARTS = MODEL_PARTS + tuple(SCOPES.values())  # every loop has the model's; a speculative
# loop adds its phases
_CONTAINERS = ("while", "conditional", "call")
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\((.*?)\)(.*)$")


def part_of(op_name: str) -> str:
    """The part an op's `op_name` metadata (the jax call path) belongs to: a speculative
    step's phase (its named scope, whatever model code runs in it: a draft model's
    layers are the draft's), else the target's model part."""
    for scope in op_name.split("/"):
        if scope in SCOPES:
            return SCOPES[scope]
    if "_proj/" in op_name and "/self_attn/" in op_name:
        return PARTS[0]
    if "/self_attn/" in op_name:
        return PARTS[1]
    if "/mlp/" in op_name:
        return PARTS[2]
    if "D,DV->" in op_name or "lm_head" in op_name:
        return PARTS[3]
    if "layernorm" in op_name or re.search(r"/layers(_\d+)?/add", op_name) or "/norm/" in op_name:
        return PARTS[4]
    return PARTS[5]


def _dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot_part(out: list[int], lhs: list[int], config) -> str:
    """The part a matmul without metadata (XLA:CPU's plain dots) belongs to, by shapes:
    only the LM head outputs the vocabulary, the MLP's dots output or contract the
    intermediate size, the projections map hidden <-> heads; batched dots attend."""
    heads = {config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim}
    if len(out) <= 2 and out and out[-1] == config.vocab_size:
        return PARTS[3]
    if len(out) <= 2 and config.intermediate_size in (out[-1:] + lhs[-1:] + lhs[:1]):
        return PARTS[2]
    if len(out) <= 2 and out and out[-1] in heads | {config.hidden_size}:
        return PARTS[0]
    return PARTS[1]


def hlo_ops(hlo_text: str, config) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (opcode, part, computation)} of an optimized HLO module's text
    (the computation: the one the instruction is in). An op without metadata takes its
    computation's phase when every op there that has metadata is in that one phase (a
    draft's matmuls inside its own branch), else its part by shapes: a plain dot's, or
    that of the dot a fusion computes (XLA:CPU's YNNPACK fusions carry no metadata)."""
    shapes, found, untagged, comp = {}, {}, [], None
    dots = {}  # computation -> (out dims, lhs dims) of its root, where that is a dot
    phases = collections.defaultdict(set)  # computation -> the parts its tagged ops are in
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            head = re.match(r"\s*(?:ENTRY )?%([\w.\-]+) .*\{\s*$", line)
            comp = head.group(1) if head else comp
            continue
        name, shape, opcode, operands, rest = m.groups()
        shapes[name] = shape
        lhs = operands.split(",")[0].strip().lstrip("%")
        if opcode == "dot" and line.lstrip().startswith("ROOT "):
            dots[comp] = (_dims(shape), _dims(shapes.get(lhs, "")))
        op_name = re.search(r'op_name="([^"]*)"', rest)
        if op_name:
            found[name] = (opcode, part_of(op_name.group(1)), comp)
            phases[comp].add(found[name][1])
        else:
            untagged.append((name, opcode, comp, (_dims(shape), _dims(shapes.get(lhs, ""))),
                             re.search(r"calls=%([\w.\-]+)", rest)))
    for name, opcode, comp, dims, calls in untagged:
        (only,) = phases[comp] if len(phases[comp]) == 1 else (None,)
        if only in SCOPES.values():
            part = only
        elif opcode == "dot":
            part = _dot_part(*dims, config)
        elif opcode == "fusion" and calls and calls.group(1) in dots:
            part = _dot_part(*dots[calls.group(1)], config)
        else:
            part = PARTS[5]
        found[name] = (opcode, part, comp)
    return found


def breakdown(events: list[dict], ops: dict[str, tuple[str, str, str]]) -> dict:
    """Per-step milliseconds by part from the loop's trace events ({'name', 'ts', 'dur'}
    in microseconds): steps are counted by the target's LM head matmuls (in each
    computation its costliest LM-head op: a speculative loop has one target forward per
    verify width, each in its own branch), wall per step is the median gap between their
    starts, and ops that contain others (loops, conds) are left out of the sums."""
    by_part, head_ops = collections.Counter(), collections.Counter()
    by_kind, runs = collections.Counter(), collections.Counter()
    for e in events:
        opcode, part, _ = ops.get(e["name"], ("", PARTS[5], ""))
        if opcode in _CONTAINERS:
            continue
        by_part[part] += e["dur"]
        kind = (part, e["name"].rstrip("0123456789."))  # fusion.12, fusion.40 -> fusion
        by_kind[kind] += e["dur"]
        runs[kind] += 1
        if part == PARTS[3]:
            head_ops[e["name"]] += e["dur"]
    heads = {}  # computation -> its costliest LM-head op: the matmul itself
    for name, dur in head_ops.items():
        comp = ops[name][2]
        if comp not in heads or dur > head_ops[heads[comp]]:
            heads[comp] = name
    head_starts = sorted(e["ts"] for e in events if e["name"] in set(heads.values()))
    if len(head_starts) < 2:
        raise ValueError(f"found {len(head_starts)} LM head matmuls in the trace: cannot "
                         "count decode steps (is the loop module named "
                         f"{LOOP_MODULE!r}?)")
    steps = len(head_starts)
    wall = statistics.median(b - a for a, b in zip(head_starts, head_starts[1:]))
    return {"steps": steps, "wall_ms": wall / 1e3,
            "ms": {p: by_part[p] / steps / 1e3 for p in PARTS},
            # [(part, op kind, ms per step, runs per step)], costliest first
            "kinds": [(*k, d / steps / 1e3, runs[k] / steps) for k, d in by_kind.most_common()]}


def markdown_kinds(result: dict, top: int) -> str:
    """The `top` costliest kinds of op (XLA's op name without its number: one fusion
    kind run by every layer is one row), per step, with the part they belong to."""
    lines = ["| op | part | ms / step | runs / step |", "|---|---|---:|---:|"]
    lines += [f"| {kind} | {part} | {ms:.3f} | {n:.0f} |"
              for part, kind, ms, n in result["kinds"][:top]]
    return "\n".join(lines)


def weight_bytes(config, itemsize: int = 4) -> dict[str, int]:
    """Bytes of the weights each matmul part reads once per step."""
    d, h = config.hidden_size, config.head_dim
    attn = d * h * (2 * config.num_heads + 2 * config.num_kv_heads)
    return {PARTS[0]: config.num_layers * attn * itemsize,
            PARTS[2]: config.num_layers * 3 * d * config.intermediate_size * itemsize,
            PARTS[3]: config.vocab_size * d * itemsize}


def profile(model, prompts: list[list[int]], new_tokens: int, dump_dir: str,
            trace_dir: str, speculator=None, shallow: bool = False,
            temperature: float = 0.0) -> dict:
    """Runs `generate` once to compile (XLA dumps the loop's HLO to dump_dir), once under
    jax.profiler, and returns `breakdown` of the traced loop. `speculator` drafts at full
    depth every step, or with `shallow` one level, as calibration's depth-1 pass runs it
    (`specjax.calibrate.shallow_kwargs`)."""
    import jax

    import specjax
    from specjax.calibrate import shallow_kwargs

    kw = dict(max_new_tokens=new_tokens, temperature=temperature, seed=0, ignore_eos=True)
    if speculator is not None:
        kw.update(shallow_kwargs(speculator, new_tokens, None) if shallow
                  else dict(speculator=speculator, adaptive=False))
    specjax.generate(model, prompts, **kw)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        specjax.generate(model, prompts, **kw)
    dumps = sorted(glob.glob(f"{dump_dir}/*{LOOP_MODULE}*after_optimizations.txt"))
    traces = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    if not dumps or not traces:
        raise RuntimeError(f"no HLO dump in {dump_dir} or no trace in {trace_dir}: XLA_FLAGS "
                           "must be set before jax starts (run this as its own process)")
    ops = hlo_ops(Path(dumps[-1]).read_text(), model.config)
    with gzip.open(traces[0]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
                  and e.get("args", {}).get("hlo_module") == LOOP_MODULE]
    return breakdown(events, ops)


def step_ms(model, prompts: list[list[int]], new_tokens: int,
            temperature: float = 0.0) -> float:
    """specjax's untraced decode step: the median over prompts (one row each, prompt i
    sampled with seed i) of a `generate` call's time after its first token, per further
    token."""
    import specjax

    per = []
    for i, p in enumerate(prompts):
        s = specjax.generate(model, [p], max_new_tokens=new_tokens, temperature=temperature,
                             seed=i, ignore_eos=True).stats
        per.append((s.wall_s - s.ttft_s) / (new_tokens - 1) * 1e3)
    return statistics.median(per)


def markdown(result: dict, config, batch: int) -> str:
    """The per-part table: ms per step, share of the op time and, for matmuls, GB/s (a
    speculative step's phases only where the loop has them)."""
    total = sum(result["ms"].values())
    import jax.numpy as jnp

    wb = weight_bytes(config, jnp.dtype(config.dtype).itemsize)  # the weights as stored
    lines = ["| part | ms / step | share | weights read, GB/s |", "|---|---:|---:|---:|"]
    for p in PARTS:
        ms = result["ms"][p]
        if p not in MODEL_PARTS and ms == 0:
            continue
        gbs = f"{wb[p] / (ms / 1e3) / 1e9:.1f}" if p in wb and ms > 0 else "–"
        lines.append(f"| {p} | {ms:.2f} | {ms / total:.0%} | {gbs} |")
    lines += [f"| **sum of op times** | **{total:.2f}** | | |",
              f"| wall per step (median) | {result['wall_ms']:.2f} | | |",
              "", f"batch {batch}, {result['steps']} steps traced"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None,
                    help="checkpoint (anything specjax.load reads; default: packaged SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES),
                    help="the target's weights and compute (with --llamacpp, a GGUF of the "
                    "same precision: `specjax.save_gguf(..., dtype=\"BF16\")`)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy)")
    ap.add_argument("--prompt-tokens", type=int, default=256,
                    help="HumanEval prompts of at most this many tokens")
    ap.add_argument("--speculator", choices=("none", "ngram", "draft", "eagle"),
                    default="none", help="profile this method's loop at full depth (draft, "
                    "eagle: the trained ones of --workdir)")
    ap.add_argument("--shallow", action="store_true",
                    help="the speculator drafts one level a step (calibration's depth-1 "
                    "pass) instead of its full depth")
    ap.add_argument("--workdir", default=None,
                    help="a quickstart run directory: its target (unless --target) and its "
                    "draft or EAGLE head")
    ap.add_argument("--llamacpp", default=None, metavar="GGUF",
                    help="also time llama.cpp's decode step on this GGUF (same weights; "
                    "batch 1 only)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved rounds of the untraced specjax / llama.cpp steps")
    ap.add_argument("--top", type=int, default=0,
                    help="also list this many costliest kinds of op (which fusion a part's "
                    "time goes to)")
    args = ap.parse_args(argv)
    if (args.batch < 1 or args.new < 2 or args.prompt_tokens < 8 or args.repeats < 1
            or args.top < 0 or not args.temperature >= 0):
        ap.error(f"--batch={args.batch} and --repeats={args.repeats} must be >= 1, "
                 f"--new={args.new} >= 2, --prompt-tokens={args.prompt_tokens} >= 8, "
                 f"--top={args.top} and --temperature={args.temperature} >= 0")
    if args.llamacpp and args.batch != 1:
        ap.error(f"--llamacpp times one sequence: it needs --batch 1 (got {args.batch})")
    if args.shallow and args.speculator == "none":
        ap.error("--shallow needs a --speculator")
    if args.speculator in ("draft", "eagle") and args.workdir is None:
        ap.error(f"--speculator {args.speculator} needs --workdir (a quickstart run that "
                 "trained it)")
    from specjax.bench.speculative import build_speculators, workdir_paths

    paths = workdir_paths(args.workdir) if args.workdir else {}
    need = {"draft": "config.json", "eagle": "heads.json"}.get(args.speculator)
    if need and not (paths[args.speculator] / need).is_file():
        ap.error(f"--workdir {args.workdir!r} has no trained {args.speculator} (no "
                 f"{paths[args.speculator] / need})")
    dump_dir = tempfile.mkdtemp(prefix="specjax_hlo_")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_dump_to={dump_dir}",
                                        f"--xla_dump_hlo_module_re={LOOP_MODULE}"])
    import jax

    import specjax
    from specjax.bench.prompts import build_prompts

    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit dumps nothing
    from specjax.bench.target import load_target

    model = load_target(args.target or paths.get("target"), args.dtype)
    prompts = [p.ids for p in build_prompts("humaneval", [], model.tokenizer,
                                            max(args.batch, 4), args.prompt_tokens, 0)]
    spec = None
    if args.speculator != "none":
        draft = (specjax.load(str(paths["draft"]), dtype="float32")
                 if args.speculator == "draft" else None)
        eagle = str(paths["eagle"]) if args.speculator == "eagle" else None
        spec = build_speculators(model, draft=draft, eagle=eagle,
                                 draft_vocab=paths.get("draft_vocab"))[args.speculator]
    result = profile(model, prompts[:args.batch], args.new, dump_dir,
                     tempfile.mkdtemp(prefix="specjax_trace_"), spec, args.shallow,
                     args.temperature)
    print(markdown(result, model.config, args.batch))
    if args.top:
        print("\n" + markdown_kinds(result, args.top))
    if args.llamacpp:
        from specjax.bench import llamacpp

        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved: this machine's speed drifts
            ours.append(step_ms(model, prompts, args.new, args.temperature))
            theirs.append(llamacpp.decode_step_ms(args.llamacpp, prompts, new=args.new,
                                                  temperature=args.temperature)[0])
        ours, theirs = statistics.median(ours), statistics.median(theirs)
        print(f"\nuntraced decode step at T = {args.temperature:g}, median of {args.repeats} "
              "interleaved rounds: specjax "
              f"{ours:.2f} ms, llama.cpp {theirs:.2f} ms; specjax at {theirs / ours:.2f}x "
              "llama.cpp's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
