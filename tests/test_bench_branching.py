"""specjax.bench.branching: the five control-flow variants compute the same decode and
the script reports each against the bare step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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
    variants = branching.programs(config, params, steps=6, with_cache=True)
    out = {name: jax.jit(fn)(*args) for name, fn in variants.items()}
    assert set(out) == {"bare", "cond", "KV outside", "cond, KV outside", "while"}
    tok, want = out["bare"]
    assert int(want.lengths[0]) == 11 and float(jnp.abs(want.k_pages).max()) > 0
    for name, (t, got) in out.items():  # the same token and the same 6 steps of K/V
        assert int(t[0, 0]) == int(tok[0, 0]), name
        assert int(got.lengths[0]) == 11, name
        for a, b in ((got.k_pages, want.k_pages), (got.v_pages, want.v_pages)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def test_measure_and_cli(capsys):
    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    res = branching.measure(steps=2, context=4, repeats=1, model=model)
    assert res["bare"]["ratio"] == 1.0 and all(r["ms"] > 0 for r in res.values())
    assert set(res) == {"bare", "cond", "KV outside", "cond, KV outside", "while"}
    with pytest.raises(SystemExit):
        branching.main(["--steps", "0"])
    assert "--steps=0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # past the packaged SmolLM2's 8,192 positions
        branching.main(["--context", "9000"])
    assert "--context=9000 + --steps=128 exceed the model's 8192" in capsys.readouterr().err
