"""Per-row random keys: a row's draws depend on its own seed and position, not its batch.

Every row has a key of its own: from its own seed (`generate(seed=[s_0, s_1, ...])`),
or, for one `seed=int`, the call's seed folded with the row's index (so identical
prompts in one call still draw independently). Each draw folds in what it is for
(`SAMPLE`, `PROPOSE`, `VERIFY`) and the row's current length, never its batch index
or the batch's step count: a row sampled alone or in any batch, padded or not, draws
the same numbers at the same point of its own generation.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SAMPLE, PROPOSE, VERIFY = 0, 1, 2  # what a draw is for
SEED_LIMIT = 2 ** 32


def row_key_data(seed: int | Sequence[int], batch: int) -> np.ndarray:
    """[B, K] uint32 key data of the rows' keys (`jax.random.key_data`), checked: `seed`
    an integer in [0, 2**32), or a list of them, one per row."""
    if is_seed(seed):
        base = jax.random.key(int(seed))
        keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(batch))
    elif isinstance(seed, (Sequence, np.ndarray)) and not isinstance(seed, str):
        if len(seed) != batch:
            raise ValueError(f"seed has {len(seed)} entries for {batch} prompts; pass one "
                             "seed per prompt (or one int)")
        bad = [s for s in seed if not is_seed(s)]
        if bad:
            raise ValueError(f"seed entry {bad[0]!r} must be an integer in [0, 2**32)")
        keys = jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seed, np.uint32)))
    else:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32) or a list of them, "
                         "one per prompt")
    return np.asarray(jax.random.key_data(keys))


def is_seed(s) -> bool:
    """Whether `s` is one seed: an integer (not a bool) in [0, 2**32)."""
    return (isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_))
            and 0 <= s < SEED_LIMIT)


def step_keys(key_data: jax.Array, lengths: jax.Array, purpose: int) -> jax.Array:
    """[B] keys for a draw of kind `purpose` by rows of length lengths [B] (a row's
    length grows every step it takes, so each (purpose, length) is drawn once)."""
    keys = jax.random.wrap_key_data(key_data)
    return fold(fold(keys, jnp.full(lengths.shape, purpose, jnp.int32)), lengths)


def fold(keys: jax.Array, data) -> jax.Array:
    """[B] keys, row b's folded with data[b] (or one int for all rows)."""
    data = jnp.broadcast_to(jnp.asarray(data, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, data)
