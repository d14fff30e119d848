"""The speculator that trained heads go into, from their directory (`specjax.heads.load_heads`)."""

from __future__ import annotations

from pathlib import Path

from specjax.heads.loading import load_heads
from specjax.model import Model
from specjax.speculators.eagle import Eagle, tree_label
from specjax.speculators.medusa import DEFAULT_TREE, Medusa


def head_speculator(heads_dir: str | Path, target: Model,
                    eagle_tree: tuple[int, int, int] = (4, 4, 16), kind: str | None = None):
    """The speculator that uses the heads saved in `heads_dir`: `Medusa` with the default
    tree cut to its number of heads, or `Eagle` with a dynamic tree of `eagle_tree`.
    kind: "medusa" or "eagle", checked (`load_heads`); None takes what is there."""
    ckpt = load_heads(heads_dir, target.config, kind)
    if ckpt.kind == "medusa":
        tree = [p for p in DEFAULT_TREE if len(p) <= ckpt.config.num_heads]
        return Medusa.create(ckpt.params, ckpt.config, target=target, tree=tree)
    top_k, depth, total = eagle_tree
    return Eagle.create(ckpt.params, ckpt.config, target=target, vocab_map=ckpt.vocab_map,
                        top_k=top_k, depth=depth, total_tokens=total)


def tree_alternatives(heads_dir: str | Path, target: Model, method: str,
                      shapes) -> dict[str, Eagle]:
    """{`method@top_k,depth,nodes`: the EAGLE head in `heads_dir` with that dynamic tree}
    for each of `shapes` (top_k, depth, total_tokens): other shapes of `method`, which
    calibration chooses between (`specjax.calibrate.choose_tree`)."""
    specs = (head_speculator(heads_dir, target, tuple(shape)) for shape in shapes)
    return {f"{method}@{tree_label(spec)}": spec for spec in specs}


def method_of(name: str) -> str:
    """The method a speculator's name belongs to: `eagle` for `eagle@1,4,4`
    (`tree_alternatives`), the name itself otherwise."""
    return name.partition("@")[0]
