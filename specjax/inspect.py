"""Look inside one speculative step: the draft tree a speculator proposes after the
prompt, and what the target's verification keeps of it. For notebooks and debugging;
the decode loop runs the very same functions (`DecodeLoop.speculate`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rng
from specjax.cache import PagedKVCache, PagePool
from specjax.decoding.cost import VerifyCost
from specjax.decoding.generate import as_token_lists, round_up
from specjax.decoding.loop import DecodeLoop
from specjax.decoding.policy import Rule
from specjax.decoding.state import LoopState, Params, Prompt
from specjax.model import Model
from specjax.sampling import Sampling
from specjax.speculators.base import Speculator


def params_for(params, spec: Speculator | None, sampling: Sampling, rule: Rule | None = None,
               max_new: int = 2) -> Params:
    """The loop's `Params` with no stop tokens."""
    return Params(target=params, speculator=spec, sampling=sampling, max_new=jnp.int32(max_new),
                  eos_ids=jnp.full((8,), -1, jnp.int32), rule=rule)


@functools.partial(jax.jit, static_argnames=("config",))
def _one(config, params, spec, state, sampling):
    rule = Rule(jnp.float32(0.0), jnp.bool_(False), VerifyCost(),  # full depth, free
                jnp.full((spec.shape.max_depth,), jnp.nan, jnp.float32))  # verify
    return DecodeLoop.create(config, spec).speculate(params_for(params, spec, sampling, rule),
                                                     state)


def prefilled_state(model: Model, prompt: list[int], speculator: Speculator, *,
                    temperature: float = 0.0, seed: int = 0, page_size: int = 16,
                    params=None, batch: int = 1) -> tuple[LoopState, Sampling]:
    """The loop state after prefilling `prompt` and sampling its first token, as
    `generate` leaves it before the first speculative step, and the sampling settings.
    params: the target's params in the layout to run (default `model.params`); batch:
    rows, each holding the same prompt (what timing a batch needs)."""
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an integer >= 1")
    cfg = model.config
    params = model.params if params is None else params
    ids = as_token_lists(model, [prompt])[0]
    chunk = 1 << (len(ids) - 1).bit_length()  # one prefill chunk: the buffer must hold it
    width = round_up(max(len(ids) + speculator.shape.num_nodes + 2, chunk), 64)
    per_row = -(-width // page_size)
    pool = PagePool(batch * per_row, page_size)
    for r in range(batch):
        pool.allocate(r, width)
    cache = PagedKVCache.create(cfg, pool.page_table(range(batch), per_row),
                                num_pages=pool.num_pages, page_size=page_size)
    buf = np.zeros((batch, width), np.int32)
    buf[:, :len(ids)] = ids
    sampling = Sampling.create(temperature)
    prompt = Prompt(cache=cache, tokens=jnp.asarray(buf),
                    prompt_lens=jnp.full((batch,), len(ids), jnp.int32),
                    keys=jnp.asarray(rng.row_key_data(seed, batch)))
    state = DecodeLoop(cfg).prefill(params_for(params, speculator, sampling), prompt,
                                    chunk=chunk, num_chunks=1)
    return state.replace(done=jnp.zeros_like(state.done)), sampling


def first_draft(model: Model, prompt: list[int], speculator: Speculator, *,
                temperature: float = 0.0, seed: int = 0, page_size: int = 16) -> dict:
    """Prefill `prompt`, sample its first token, then one propose + verify.

    Returns numpy values: `root` (the first generated token), per node `tokens`,
    `parents` (-1 = root), `depth`, `valid`, the nodes the verify forward ran
    (`width`), and the verifier's `accepted` node indices, `num_accepted` and `bonus`.
    """
    n = len(as_token_lists(model, [prompt])[0])
    state, sampling = prefilled_state(model, prompt, speculator, temperature=temperature,
                                      seed=seed, page_size=page_size)
    sp = _one(model.config, model.params, speculator, state, sampling)
    t, r = sp.tree, sp.result
    first = lambda x: np.asarray(x)[0]
    return dict(root=int(first(state.tokens)[n]), tokens=first(t.tokens),
                parents=first(t.parents), depth=first(t.depth), valid=first(t.valid),
                width=int(sp.width),
                accepted=first(r.accepted), num_accepted=int(first(r.num_accepted)),
                bonus=int(first(r.bonus)))
