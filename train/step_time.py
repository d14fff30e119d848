"""Seconds per optimizer step of the quickstart's draft distillation, its draft's LM head
over the whole vocabulary against the corpus's N most frequent ids (`Distill(vocab=)`,
the ids the trimmed draft proposes from).

The draft is the quickstart's: a slice of the target's decoder layers
(`quickstart.draft_from_target`), distilled under TVD on batches of random token ids (a
step's cost does not depend on them). Every size runs the trainer's own jitted step,
compiled first, then timed in interleaved rounds (`specjax.timing.interleaved_medians`);
the target's forward alone is timed beside them, the part no trimming removes.

  python -m specjax.train.step_time [--target CKPT] [--layers 0,-1] [--kept 8192]
      [--batch 8] [--seq-len 128] [--repeats 5] [--files 24]

(A training measurement, so it lives in `specjax.train`: the benchmarks never import
training.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cli_args import ALL, at_least_one, comma_list


def programs(target, layers: tuple[int, ...], vocabs: dict, batch: int, seq_len: int,
             seed: int = 0) -> dict:
    """{size: (fn, ())} one distillation step each (its state carried between calls,
    as the trainer carries it), and {"target forward": ...} the target's logits alone."""
    from specjax.train.forward import causal_logits
    from specjax.train.methods import Distill
    from specjax.train.optim import OptimConfig
    from specjax.train.quickstart import draft_from_target
    from specjax.train.trainer import _init_state, _train_step

    draft = draft_from_target(target, layers)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(
        0, target.config.vocab_size, (1, batch, seq_len)), jnp.int32)
    data = {"tokens": tokens, "mask": jnp.ones(tokens.shape, jnp.float32)}
    optim, key = OptimConfig(), jax.random.key(seed)

    def stepper(method):
        state = {"now": _init_state(method, optim, key, draft.params)}

        def run():
            state["now"], metrics = _train_step(method, optim, state["now"], target.params,
                                                data, key, jnp.int32(0), jnp.float32(1e-4))
            return metrics["loss"]
        return run, ()

    out = {size: stepper(Distill(draft.config, target.config, vocab=ids))
           for size, ids in vocabs.items()}
    forward = jax.jit(lambda p, t: causal_logits(target.config, p, t))
    out["target forward"] = (forward, (target.params, tokens[0]))
    return out


def vocabularies(target, sizes, files: int) -> dict:
    """{size: sorted kept ids as a tuple, or None for `all`}: the training corpus's
    most frequent ids, as the quickstart picks them (`jobs.corpus_vocab`)."""
    from specjax.corpus import CorpusConfig
    from specjax.train.jobs import corpus_vocab

    out = {}
    for size in sizes:
        if size == ALL:
            out[ALL] = None
            continue
        ids = corpus_vocab(CorpusConfig(max_files=files), target.tokenizer,
                           target.config.vocab_size, size)
        out[size] = tuple(np.sort(ids).tolist())
    return out


def report(seconds: dict) -> str:
    """A markdown table: seconds per step and the ratio to the whole vocabulary's."""
    base = seconds.get(ALL)
    lines = ["| draft head | s / step | vs whole vocabulary |", "|---|---:|---:|"]
    for key, s in seconds.items():
        ratio = f"{s / base:.2f}×" if base and key != "target forward" else "–"
        name = key if isinstance(key, str) else f"{key:,} ids"
        lines.append(f"| {name} | {s:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specjax.train.step_time",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None,
                    help="checkpoint (anything specjax.load reads; default: packaged SmolLM2)")
    ap.add_argument("--layers", default="0,-1",
                    help="the target's decoder layers the draft is sliced from")
    ap.add_argument("--kept", type=int, default=8192,
                    help="the kept ids timed against the whole vocabulary")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--files", type=int, default=24, help="stdlib files counted for the ids")
    args = ap.parse_args(argv)
    at_least_one(ap, args, ("kept", "batch", "seq_len", "repeats", "files"))
    layers = tuple(comma_list(ap, "--layers", args.layers, int))

    import specjax
    from specjax.checkpoint.packaged import smollm2
    from specjax.timing import interleaved_medians

    target = specjax.load(str(args.target or smollm2()), dtype="float32")
    layers = tuple(i % target.config.num_layers for i in layers)
    if args.kept >= target.config.vocab_size:
        ap.error(f"--kept={args.kept} must be below the target's {target.config.vocab_size} ids")
    progs = programs(target, layers, vocabularies(target, (ALL, args.kept), args.files),
                     args.batch, args.seq_len)
    for fn, fargs in progs.values():  # compile
        jax.block_until_ready(fn(*fargs))
    print(f"{args.batch} x {args.seq_len} tokens a step, draft layers {list(layers)}, "
          f"median of {args.repeats} interleaved rounds")
    print(report(interleaved_medians(progs, args.repeats)))


if __name__ == "__main__":
    main()
