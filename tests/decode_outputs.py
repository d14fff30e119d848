"""Recorded decode outputs: every speculator's tokens and step counts on tiny seeded
models, greedy and sampled, so a change to the loop that is meant to preserve behaviour
can prove it did (`tests/test_decode_outputs.py` compares against the snapshot).

Re-record only when a change is MEANT to alter what the loop emits or how it steps:
    python -m tests.decode_outputs --record
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

# as tests/conftest.py sets it: the few-row kernel wherever it applies, no timed race, so
# the default verify-cost table (and the rule's decisions) are the tests' own
os.environ.setdefault("SPECJAX_CPU_MATMUL", "on")

import specjax  # noqa: E402
from specjax.config import tiny_llama
from specjax.decoding.cost import VERIFY_COST
from specjax.speculators import DraftModel, Eagle, Medusa, NGram

SNAPSHOT = Path(__file__).parent / "snapshots" / "decode_outputs.json"
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10] * 20, [3, 4, 5, 3, 4, 5, 3, 4]]
NEW_TOKENS = 12
NAMES = ("plain", "ngram", "draft", "self", "medusa", "eagle2", "eagle1_static", "eagle3")
# (name, generate kwargs): greedy; sampled with one seed for the batch and with a seed
# per row; nucleus sampling; block verification of chains
SETTINGS = [
    ("greedy", dict(temperature=0.0)),
    ("t1_seed", dict(temperature=1.0, seed=5)),
    ("t1_rows", dict(temperature=1.0, seed=[11, 12, 13, 14])),
    ("top_p", dict(temperature=0.8, top_p=0.9, top_k=20, seed=2)),
]
CHAIN_SETTINGS = [("block", dict(temperature=1.0, seed=9, verification="block"))]


def models():
    """A two-layer target (EAGLE-3 fuses distinct layers) and a draft of its shape."""
    cfg = tiny_llama(vocab_size=128, num_layers=2, hidden_size=32, intermediate_size=64,
                     num_heads=2, num_kv_heads=1)
    return specjax.init_model(cfg, seed=0), specjax.init_model(cfg, seed=1)


def speculators(target, draft) -> dict:
    """name -> (speculator, proposes chains)."""
    return {
        "plain": (None, False),
        "ngram": (NGram(k=3, n_min=1), True),  # as recorded: one-token matches too
        "draft": (DraftModel.create(draft, k=3), True),
        "self": (DraftModel.create(target, k=4), True),
        "medusa": (Medusa.random(target, num_heads=2, tree=[[0], [1], [0, 0], [0, 1]]), False),
        "eagle2": (Eagle.random(target, top_k=2, depth=3, total_tokens=6), False),
        "eagle1_static": (Eagle.random(target, tree=[[0], [1], [0, 0]]), False),
        "eagle3": (Eagle.random(target, version=3, hidden_layers=(0, 1, 1),
                                draft_vocab_size=64, top_k=2, depth=2, total_tokens=4), False),
    }


def cases(target, draft):
    """Yields (key, generate kwargs) for every recorded run."""
    for name, (spec, chains) in speculators(target, draft).items():
        for adaptive in ((True,) if spec is None else (True, False)):
            settings = SETTINGS + (CHAIN_SETTINGS if chains else [])
            for label, kwargs in settings:
                key = f"{name}/{'adaptive' if adaptive else 'fixed'}/{label}"
                yield key, dict(kwargs, speculator=spec, adaptive=adaptive)
        if spec is not None:  # the rule with drafting priced cheap enough to try it, its
            # verifies by one fixed table (the [I, O] kernel's) so that re-measuring the
            # default tables leaves these decisions as recorded
            for label, kwargs in SETTINGS[:2]:
                yield f"{name}/cheap/{label}", dict(kwargs, speculator=spec, cost_ratio=0.02,
                                                    verify_cost=VERIFY_COST["cpu-rows"])


def run(target, kwargs) -> dict:
    out = specjax.generate(target, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                           **kwargs)
    s = out.stats
    return {"tokens": out.tokens, "target_calls": s.target_calls,
            "draft_calls": s.draft_calls, "drafted": s.drafted, "accepted": s.accepted,
            "accepted_hist": [int(x) for x in np.asarray(s.accepted_hist).tolist()]}


def record() -> dict:
    target, draft = models()
    return {key: run(target, kwargs) for key, kwargs in cases(target, draft)}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--record", action="store_true", help="rewrite the snapshot")
    args = p.parse_args()
    got = record()
    if args.record:
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} runs to {SNAPSHOT}")
    else:
        want = json.loads(SNAPSHOT.read_text())
        bad = [k for k in want if want[k] != got.get(k)]
        print(f"{len(want) - len(bad)}/{len(want)} runs match" + (f"; differ: {bad}" if bad
                                                                  else ""))


if __name__ == "__main__":
    main()
