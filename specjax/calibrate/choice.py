"""Of several calibrated speculators (one head's tree shapes), the one the adaptive rule
expects to gain most."""

from __future__ import annotations

from specjax.decoding.cost import VerifyCost
from specjax.model import Model


def best_calibrated(target: Model, candidates: dict, calibrations: dict, *,
                    cost_ratios: dict | None = None, batch: int = 1, context: int = 0,
                    verify_cost: VerifyCost | None = None) -> tuple[str, dict[str, float]]:
    """(the name, {name: expected gain}) of the candidate speculator that the adaptive
    rule, from each one's calibration on the same prompts, expects to gain most: e.g.
    one head's tree shapes, where a wide tree's verify costs more than its deeper
    acceptance returns on one machine and pays on another. Ties go to the first;
    candidates without a calibration are left out. verify_cost: as `generate` takes it
    (None: this backend's table). Each is priced by `generate.expected_gain`."""
    from specjax.decoding.generate import expected_gain

    gains = {name: expected_gain(target, spec, batch=batch, context=context,
                                 cost_ratio=(cost_ratios or {}).get(name),
                                 verify_cost=verify_cost,
                                 **calibrations[name].generate_kwargs())
             for name, spec in candidates.items() if calibrations.get(name) is not None}
    if not gains:
        raise ValueError(f"no calibration for any of {list(candidates)}")
    return max(gains, key=lambda n: gains[n]), gains


def choose_tree(target: Model, method: str, candidates: dict, calibrations: dict,
                cost_ratios: dict, *, batch: int = 1, context: int = 0) -> tuple[str, dict]:
    """Of `method`'s EAGLE tree shapes among `candidates` (`method` itself and
    `method@top_k,depth,nodes`), with their calibrations and c by name, the one the
    rule prices best (`best_calibrated`): (its name, a record of the chosen tree and
    every shape's expected gain, by "top_k,depth,nodes")."""
    from specjax.speculators import method_of
    from specjax.speculators.eagle import tree_label

    shapes = {n: spec for n, spec in candidates.items() if method_of(n) == method}
    best, gains = best_calibrated(target, shapes, calibrations, cost_ratios=cost_ratios,
                                  batch=batch, context=context)
    return best, dict(method=method, chosen=tree_label(shapes[best]),
                      gains={tree_label(shapes[n]): g for n, g in gains.items()})


def chosen_shapes(speculators: dict, alternatives: dict | None, choices: dict | None,
                  key) -> tuple[dict, dict]:
    """For one cell of a comparison, each method's chosen tree shape (`choose_tree`):
    ({method: the name it is calibrated and priced under}, {method: the speculator it
    runs}). choices: {key(method): name}; alternatives: {name: speculator}; a method
    with no choice runs as itself."""
    pick = {name: (choices or {}).get(key(name), name) for name in speculators}
    return pick, {name: (alternatives or {}).get(pick[name], spec)
                  for name, spec in speculators.items()}
