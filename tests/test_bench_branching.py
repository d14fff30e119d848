"""specjax.bench.branching: the four control-flow variants compute the same decode and
the script reports each against the bare step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax.bench import branching
from specjax.cache import PagedKVCache
from specjax.config import tiny_llama


def test_variants_decode_the_same_tokens():
    config = tiny_llama(vocab_size=64)
    params = specjax.init_model(config, seed=0).params
    cache = PagedKVCache.create(config, jnp.arange(4, dtype=jnp.int32)[None], num_pages=4,
                                page_size=8, lengths=jnp.full((1,), 5, jnp.int32))
    args = (cache, jnp.full((1, 1), 7, jnp.int32), jnp.full((1, 1), 5, jnp.int32))
    out = {name: int(jax.jit(fn)(*args)[0, 0])
           for name, fn in branching.programs(config, params, steps=6).items()}
    assert set(out) == {"bare", "cond", "cond, KV outside", "while"}
    assert len(set(out.values())) == 1, out


def test_measure_and_cli(capsys):
    res = branching.measure(steps=2, context=4, repeats=1, config=tiny_llama(vocab_size=64))
    assert res["bare"]["ratio"] == 1.0 and all(r["ms"] > 0 for r in res.values())
    with pytest.raises(SystemExit):
        branching.main(["--steps", "0"])
    assert "--steps=0 must be >= 1" in capsys.readouterr().err
