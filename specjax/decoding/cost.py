"""`VerifyCost`: the modelled cost of a target forward over T inputs, relative to a
one-token decode step, which the adaptive rule and the analytical speedup price verify
forwards with. Measured tables and how they were taken: docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def _interp(t, ts, vs):
    """`jnp.interp(t, ts, vs)` (ts strictly rising), its arithmetic as written there, but
    the segment found by comparing t with every point rather than by `searchsorted`,
    whose binary search XLA runs as a while loop: the tables hold a few points, and the
    adaptive rule interpolates on every loop step, in every compiled loop."""
    i = jnp.clip(jnp.sum(ts <= t[..., None], axis=-1), 1, ts.shape[-1] - 1)
    f = vs[i - 1] + ((t - ts[i - 1]) / (ts[i] - ts[i - 1])) * (vs[i] - vs[i - 1])
    return jnp.where(t < ts[0], vs[0], jnp.where(t > ts[-1], vs[-1], f))


def _interpolate(t, ts, vs):
    """vs at t, linear between the points (ts rising) and along the last segment past
    them (a forward past the table keeps its last per-token cost)."""
    t, ts, vs = (jnp.asarray(x, jnp.float32) for x in (t, ts, vs))
    last = (vs[-1] - vs[-2]) / (ts[-1] - ts[-2])
    return jnp.where(t > ts[-1], vs[-1] + (t - ts[-1]) * last, _interp(t, ts, vs))


# The canonical layout (`VerifyCost.canonical`): tables padded to at least this many T
# points and batch rows, so that every cost model up to that size prices the loop in one
# compiled program (the loop takes the cost model as traced numbers: another structure
# or width would compile another loop).
CANONICAL_POINTS = 16
CANONICAL_ROWS = 4
_NO_ROWS = float(2**30)  # padded batch anchors from here: above every batch, never picked


def _width(n: int, least: int) -> int:
    """least, or the power of two >= n past it."""
    return max(least, 1 << (n - 1).bit_length())


def _extend(ts: np.ndarray, vs: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """ts [P] and vs [..., P] to width points: T doubling past the last, each row of vs
    along its last segment, the line `_interpolate` already follows past the table."""
    extra = ts[-1] * 2.0 ** np.arange(1, width - ts.size + 1)
    slope = (vs[..., -1:] - vs[..., -2:-1]) / (ts[-1] - ts[-2])
    return (np.concatenate([ts, extra]),
            np.concatenate([vs, vs[..., -1:] + (extra - ts[-1]) * slope], axis=-1))


@struct.dataclass
class VerifyCost:
    """v(T) = max(1 + jump · [T > 1] + slope · log2(T), per_token · T), or measured ratios;
    a pytree, so the loop takes it as traced numbers. Leviathan et al.'s free verify is
    v = 1; on XLA:CPU two or more tokens run a GEMM, not a GEMV, so the cost jumps at T = 2.
    """

    jump: Any = 0.0
    slope: Any = 0.0
    per_token: Any = 0.0
    branch: Any = 0.0  # extra relative cost inside the verify switch (`speculative`)
    measured: Any = None  # [2, P] (T, cost(T) / cost(1)) replacing the formula
    rows: Any = None  # [A] batch sizes > 1, rising, measured too (`from_table(by_rows=)`)
    by_rows: Any = None  # [A, P] their cost(T) / cost(1) on measured's T
    # The tables above hold at `contexts[0]` cached tokens. Measured again at contexts[1]
    # (`far`: cost(T) there over cost(1) at contexts[0], batch 1's row then by_rows'),
    # each cost is affine in the context between and beyond: attention reads and
    # multiplies every cached token, so a verify's share of it grows with the context.
    contexts: Any = None  # [2] (near, far) cached tokens, rising
    far: Any = None  # [A+1, P]
    # Only in the canonical layout (`canonical`): 1 where the tables above price, 0 where
    # the formula does (the tables then hold a placeholder).
    tabled: Any = None

    @classmethod
    def from_table(cls, ratios: dict, branch: float = 0.0, by_rows: dict | None = None,
                   contexts: tuple[int, int] | None = None,
                   far: dict | None = None) -> "VerifyCost":
        """From measured {T: cost(T) / cost(1)} at batch 1 (`python -m
        specjax.bench.verify_cost`), optionally {batch: {T: ratio}} measured at larger
        batches (`--batches 1,4,16`) over the same T, and optionally, with `contexts` = (near,
        far) cached tokens the attention reads (the tables above at near; `--far N`
        prints both), `far` = {batch: {T: cost(T) at far / cost(1) at near}} for batch 1
        and every batch of by_rows."""
        ts = sorted(ratios)

        def grid(tables: dict, what: str, batches) -> np.ndarray:
            for b in batches:
                if b not in tables or sorted(tables[b]) != ts:
                    raise ValueError(f"{what}[{b}] measures T = "
                                     f"{sorted(tables.get(b, ()))}; the batch-1 table "
                                     f"measures T = {ts}")
            return np.asarray([[tables[b][t] for t in ts] for b in batches], np.float64)

        rows = table = far_table = None
        if by_rows:
            rows = sorted(by_rows)
            table = grid(by_rows, "by_rows", rows)
            rows = np.asarray(rows, np.float64)
        if (contexts is None) != (far is None):
            raise ValueError(f"contexts={contexts!r} and far={far!r}: give both or neither")
        if far is not None:
            far_table = grid(far, "far", [1] + sorted(by_rows or ()))
            contexts = np.asarray(contexts, np.float64)
        return cls(branch=branch, measured=np.asarray([ts, [ratios[t] for t in ts]],
                                                      np.float64), rows=rows, by_rows=table,
                   contexts=contexts, far=far_table)

    def _tables(self, context=None):
        """[A+1, P] cost(T) / cost(1) per measured batch (1, then `rows`) at `context`
        cached tokens (None, or no `far` table: as measured)."""
        near = jnp.asarray(self.measured[1], jnp.float32)[None]
        if self.by_rows is not None:
            near = jnp.concatenate([near, jnp.asarray(self.by_rows, jnp.float32)])
        if context is None or self.far is None:
            return near
        c0, c1 = jnp.asarray(self.contexts[0], jnp.float32), jnp.asarray(self.contexts[1],
                                                                          jnp.float32)
        x = (jnp.maximum(jnp.asarray(context, jnp.float32), 0.0) - c0) / (c1 - c0)
        far = jnp.asarray(self.far, jnp.float32)
        # both costs in units of cost(1) at the near context, then their ratio
        cost = jnp.maximum(near + x * (far - near), 1e-3)
        return cost / cost[:, :1]

    def __call__(self, tokens, context=None):
        """v at `tokens` inputs in one forward at batch 1 (numpy or jax arrays, or a
        float >= 1), after `context` cached tokens (None: the tables' own)."""
        t = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
        if self.measured is None:
            return self._formula(t)
        table = _interpolate(t, jnp.asarray(self.measured[0]), self._tables(context)[0])
        return table if self.tabled is None else jnp.where(self.tabled > 0, table,
                                                           self._formula(t))

    def _formula(self, t):
        """v at t >= 1 inputs by the formula (the class docstring)."""
        return jnp.maximum(1.0 + self.jump * (t > 1.0) + self.slope * jnp.log2(t),
                           self.per_token * t)

    def relative(self, tokens_per_row, rows, context=None):
        """Cost of verifying `tokens_per_row` for each of `rows` rows (a scalar) relative to
        their plain step after `context` cached tokens (None: the tables' own): v(rows · T)
        / v(rows), or from the tables measured at batches (`by_rows`), blended in
        log2(rows) between two and scaled past the largest."""
        rows = jnp.maximum(jnp.asarray(rows, jnp.float32), 1.0)
        t = jnp.asarray(tokens_per_row, jnp.float32)
        if self.by_rows is None:
            return self(rows * t, context) / self(rows, context)
        if rows.ndim:
            raise ValueError(f"rows has shape {rows.shape}; one batch size (a scalar) "
                             "is what picks the measured tables")
        anchors = jnp.concatenate([jnp.ones((1,), jnp.float32),
                                   jnp.asarray(self.rows, jnp.float32)])  # [A+1]
        tables = self._tables(context)  # [A+1, P]
        ts = jnp.asarray(self.measured[0], jnp.float32)
        t = jnp.maximum(t, 1.0)
        i = jnp.sum(anchors <= rows) - 1  # the largest measured batch <= rows
        j = jnp.minimum(i + 1, jnp.sum(anchors < _NO_ROWS) - 1)  # padded rows: never
        w = jnp.log2(rows / anchors[i]) / jnp.maximum(jnp.log2(anchors[j] / anchors[i]), 1e-9)
        between = ((1.0 - w) * _interpolate(t, ts, tables[i])
                   + w * _interpolate(t, ts, tables[j]))
        scale = rows / anchors[i]
        past = _interpolate(scale * t, ts, tables[i]) / _interpolate(scale, ts, tables[i])
        out = jnp.where(i == j, past, between)
        if self.tabled is None:
            return out
        return jnp.where(self.tabled > 0, out, self._formula(rows * t) / self._formula(rows))

    def speculative(self, tokens_per_row, rows, context=None):
        """`relative` for a forward the speculative step runs (inside its verify
        switch): times 1 + branch."""
        return self.relative(tokens_per_row, rows, context) * (1.0 + self.branch)

    def free(self) -> "VerifyCost":
        """A free verify (every forward costs one plain step) in this model's form: its
        tables, if any, with every cost 1 (the idle calibration pass,
        `calibrate.idle_kwargs`). In `canonical`'s layout, as every cost model, it runs
        the program compiled for this one."""
        ones = lambda x: None if x is None else np.ones_like(np.asarray(x, np.float32))  # noqa: E731
        measured = None
        if self.measured is not None:
            measured = np.stack([np.asarray(self.measured[0], np.float32),
                                 ones(self.measured[1])])
        return VerifyCost(measured=measured, rows=self.rows, by_rows=ones(self.by_rows),
                          contexts=self.contexts, far=ones(self.far), tabled=self.tabled)

    def canonical(self) -> "VerifyCost":
        """This (validated) cost model in one layout, float32: both forms (`tabled` picks
        one), the T points extended to `CANONICAL_POINTS` along the last segment,
        `CANONICAL_ROWS` batch rows (padded ones never picked), a far table (without
        one: the near tables at contexts 0 and 1, so no context changes a cost). Every
        cost model up to that size then prices the loop in one compiled program."""
        if self.tabled is not None:
            return self
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        tabled = self.measured is not None
        ts, near = ((np.asarray(self.measured, np.float64)) if tabled
                    else np.asarray([[1.0, 2.0], [1.0, 1.0]]))  # a placeholder table
        n_rows = 0 if self.rows is None else np.asarray(self.rows).size
        width, height = _width(ts.size, CANONICAL_POINTS), _width(n_rows, CANONICAL_ROWS)
        tables = np.ones((1 + height, ts.size))  # batch 1, then each row; pads: ones
        tables[0] = near
        rows = _NO_ROWS * 2.0 ** np.arange(height)  # pads rising, as `validated` checks
        if n_rows:
            tables[1:1 + n_rows] = np.asarray(self.by_rows, np.float64)
            rows[:n_rows] = np.asarray(self.rows, np.float64)
        if self.far is None:
            contexts, far = np.asarray([0.0, 1.0]), tables
        else:
            contexts, far = np.asarray(self.contexts, np.float64), np.ones_like(tables)
            far[:1 + n_rows] = np.asarray(self.far, np.float64)
        wide_ts, wide = _extend(ts, tables, width)
        far = _extend(ts, far, width)[1]
        return VerifyCost(np.float32(self.jump), np.float32(self.slope),
                          np.float32(self.per_token), np.float32(self.branch),
                          f32(np.stack([wide_ts, wide[0]])), f32(rows), f32(wide[1:]),
                          f32(contexts), f32(far), np.float32(tabled))

    def describe(self) -> str:
        log = f"1 + {float(self.jump):.3g}·[T > 1] + {float(self.slope):.3g}·log2 T"
        out = f"v(T) = {log}"
        if self.measured is not None:
            points = ", ".join(f"{int(t)}: {float(v):.2f}" for t, v in
                               zip(*np.asarray(self.measured)))
            out = f"v(T) interpolated from measured {{T: v}} = {{{points}}}"
            if self.by_rows is not None:
                for r, vs in zip(np.asarray(self.rows), np.asarray(self.by_rows)):
                    points = ", ".join(f"{int(t)}: {float(v):.2f}" for t, v in
                                       zip(np.asarray(self.measured)[0], vs))
                    out += f"; at batch {int(r)} {{{points}}}"
            if self.far is not None:
                near, far = (int(c) for c in np.asarray(self.contexts))
                out += (f"; after {near} cached tokens, each cost affine in the context "
                        f"through the same tables measured after {far}")
        elif float(self.per_token) > 0:
            out = f"v(T) = max({log}, {float(self.per_token):.3g}·T)"
        if float(self.branch) > 0:
            out += f", × {1 + float(self.branch):.3g} in the verify switch"
        return out

    def validated(self) -> "VerifyCost":
        """Host-side check, naming the bad value; returns float32 leaves."""
        for name in ("jump", "slope", "per_token", "branch"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float, np.floating, np.integer)) and np.isfinite(x)
                    and x >= 0):
                raise ValueError(f"VerifyCost {name}={x!r} must be a finite number >= 0")
        table = None
        if self.measured is not None:
            table = np.asarray(self.measured, np.float64)
            if (table.ndim != 2 or table.shape[0] != 2 or table.shape[1] < 2
                    or table[0, 0] != 1 or table[1, 0] != 1 or np.any(np.diff(table[0]) <= 0)
                    or not np.all(np.isfinite(table)) or np.any(table[1] <= 0)):
                raise ValueError(
                    f"VerifyCost measured={self.measured!r} must be [2, P >= 2] rows (T, "
                    "cost) with T rising from 1, cost(1) = 1 and every cost finite and > 0")
            table = table.astype(np.float32)
        rows, by_rows = self._validated_rows(table)
        contexts, far = self._validated_far(table, rows)
        tabled = self.tabled
        if tabled is not None:
            if np.ndim(tabled) or float(tabled) not in (0.0, 1.0) or table is None:
                raise ValueError(f"VerifyCost tabled={tabled!r} must be 0 or 1 beside a "
                                 "measured table (`canonical` sets it)")
            tabled = np.float32(tabled)
        return VerifyCost(np.float32(self.jump), np.float32(self.slope),
                          np.float32(self.per_token), np.float32(self.branch), table,
                          rows, by_rows, contexts, far, tabled)

    def _validated_far(self, table, rows):
        """(contexts, far) as float32, checked against the near tables."""
        if self.contexts is None and self.far is None:
            return None, None
        contexts = np.asarray(self.contexts, np.float64)
        if (table is None or contexts.shape != (2,) or not np.all(np.isfinite(contexts))
                or contexts[0] < 0 or contexts[1] <= contexts[0]):
            raise ValueError(f"VerifyCost contexts={self.contexts!r} must be two context "
                             "lengths (near, far), 0 <= near < far, beside a measured table")
        far = np.asarray(self.far, np.float64)
        shape = (1 + (0 if rows is None else rows.size), table.shape[1])
        if far.shape != shape or not np.all(np.isfinite(far)) or np.any(far <= 0):
            raise ValueError(
                f"VerifyCost far={self.far!r} must be {list(shape)} costs at the far context "
                "(batch 1, then one row per batch size of by_rows, on measured's T), each "
                "finite and > 0")
        return contexts.astype(np.float32), far.astype(np.float32)

    def _validated_rows(self, table):
        """(rows, by_rows) as float32, checked against the batch-1 `table`."""
        if self.rows is None and self.by_rows is None:
            return None, None
        rows = np.asarray(self.rows, np.float64)
        by_rows = np.asarray(self.by_rows, np.float64)
        if (table is None or rows.ndim != 1 or rows.size == 0 or np.any(rows <= 1)
                or np.any(rows != np.round(rows)) or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"VerifyCost rows={self.rows!r} must be batch sizes > 1, "
                             "rising, beside a measured batch-1 table")
        if (by_rows.shape != (rows.size, table.shape[1]) or not np.all(np.isfinite(by_rows))
                or np.any(by_rows <= 0) or np.any(by_rows[:, 0] != 1)):
            raise ValueError(
                f"VerifyCost by_rows={self.by_rows!r} must be [{rows.size}, {table.shape[1]}]"
                " costs (one row per batch size, on measured's T), each finite and > 0, 1 "
                "at T = 1")
        return rows.astype(np.float32), by_rows.astype(np.float32)


# Per backend. CPU: the ratios `python -m specjax.bench.verify_cost --far 1024` measured on
# SmolLM2-135M-Instruct's shapes at batch 1, 4 and 16 (`--batches 1,4,16`), compiled as
# generate compiles (attention by `specjax.cpu_attention`), each forward as the loop's
# verify runs it (new keys/values beside the pages), after 128 and 1,024 cached tokens
# (what that attention reads), one table per matmul the decode step runs
# (`specjax.rows_matmul.serving`): "cpu", the transposed-weight kernel (measured on the
# AVX-512 Zen 4 EPYC host, every row count on the kernel as generate's loop runs it,
# `rows_matmul.any_rows`); "cpu-rows", the [I, O] kernel (the AVX-512 Xeon host, before
# `any_rows`: past 32 rows it priced XLA's GEMM); "cpu-xla", XLA's matmuls
# (`SPECJAX_CPU_MATMUL=off`, the Xeon host). Branch 0: on SmolLM2 the verify
# switch around a forward that defers its KV write costs nothing measurable with any of
# the three matmul paths (`python -m specjax.bench.branching`, docs/benchmarks.md,
# "Control flow around a decode step"). GPU/TPU: not measured yet; set to the
# memory-bound regime the Pallas kernels aim for.
VERIFY_COST = {"cpu": VerifyCost.from_table(
                   {1: 1.0, 2: 0.98, 3: 1.09, 5: 1.26, 9: 1.65, 17: 2.50, 33: 4.52, 65: 9.40,
                    129: 16.74},
                   branch=0.0,
                   by_rows={4: {1: 1.0, 2: 1.47, 3: 1.84, 5: 2.76, 9: 3.93, 17: 7.22,
                                33: 13.58, 65: 32.34, 129: 70.19},
                            16: {1: 1.0, 2: 1.48, 3: 2.22, 5: 3.94, 9: 6.18, 17: 14.49,
                                 33: 25.73, 65: 64.63, 129: 142.17}},
                   contexts=(128, 1024),
                   far={1: {1: 1.10, 2: 1.24, 3: 1.23, 5: 1.48, 9: 1.99, 17: 3.15, 33: 5.48,
                            65: 11.92, 129: 22.21},
                        4: {1: 1.50, 2: 1.96, 3: 2.36, 5: 3.28, 9: 5.56, 17: 9.66, 33: 17.36,
                            65: 45.11, 129: 92.70},
                        16: {1: 1.61, 2: 2.24, 3: 3.33, 5: 4.85, 9: 8.02, 17: 16.75,
                             33: 31.95, 65: 82.83, 129: 174.26}}),
               "cpu-rows": VerifyCost.from_table(
                   {1: 1.0, 2: 1.20, 3: 1.33, 5: 1.32, 9: 1.47, 17: 2.03, 33: 4.13, 65: 6.32,
                    129: 10.45},
                   branch=0.0,
                   by_rows={4: {1: 1.0, 2: 1.16, 3: 1.26, 5: 1.73, 9: 3.28, 17: 4.03,
                                33: 6.20, 65: 14.71, 129: 27.45},
                            16: {1: 1.0, 2: 1.51, 3: 2.39, 5: 2.87, 9: 4.28, 17: 7.34,
                                 33: 13.90, 65: 35.86, 129: 70.13}},
                   contexts=(128, 1024),
                   far={1: {1: 1.20, 2: 1.40, 3: 1.55, 5: 1.60, 9: 1.88, 17: 2.53, 33: 4.85,
                            65: 9.84, 129: 16.22},
                        4: {1: 1.36, 2: 1.78, 3: 1.85, 5: 2.31, 9: 4.03, 17: 5.23, 33: 8.30,
                            65: 23.70, 129: 43.90},
                        16: {1: 2.03, 2: 2.66, 3: 3.65, 5: 4.32, 9: 6.20, 17: 10.10,
                             33: 18.18, 65: 59.96, 129: 122.69}}),
               "cpu-xla": VerifyCost.from_table(
                   {1: 1.0, 2: 1.44, 3: 1.53, 5: 1.72, 9: 2.07, 17: 2.71, 33: 4.62, 65: 5.29,
                    129: 8.54},
                   branch=0.0,
                   by_rows={4: {1: 1.0, 2: 1.23, 3: 1.35, 5: 1.67, 9: 2.66, 17: 3.24,
                                33: 5.20, 65: 10.36, 129: 19.51},
                            16: {1: 1.0, 2: 1.52, 3: 2.08, 5: 2.03, 9: 2.89, 17: 6.06,
                                 33: 10.16, 65: 23.99, 129: 52.99}},
                   contexts=(128, 1024),
                   far={1: {1: 1.24, 2: 1.78, 3: 2.07, 5: 2.39, 9: 3.17, 17: 4.31, 33: 7.14,
                            65: 7.69, 129: 12.98},
                        4: {1: 1.57, 2: 1.88, 3: 2.26, 5: 2.78, 9: 4.52, 17: 6.24, 33: 10.73,
                            65: 16.03, 129: 31.21},
                        16: {1: 1.83, 2: 2.61, 3: 3.80, 5: 4.00, 9: 6.78, 17: 11.40,
                             33: 21.84, 65: 39.24, 129: 76.68}}),
               "gpu": VerifyCost(slope=0.05),
               "tpu": VerifyCost(slope=0.05)}


def default_verify_cost(config=None) -> VerifyCost:
    """This backend's `VERIFY_COST` (GPU's where the backend has none); on CPU, for a
    model of `config`, the table measured with the matmul its decode step runs
    (`specjax.rows_matmul.serving`): the transposed-weight kernel's ("cpu", also without
    a config), the [I, O] kernel's ("cpu-rows") or XLA's ("cpu-xla": bf16, or neither
    kernel faster on this host)."""
    backend = jax.default_backend()
    if backend == "cpu" and config is not None:
        from specjax import rows_matmul  # a model-level module: imported where needed

        return VERIFY_COST[CPU_TABLES[rows_matmul.serving(config)]]
    return VERIFY_COST.get(backend, VERIFY_COST["gpu"])


CPU_TABLES = {"transposed": "cpu", "kernel": "cpu-rows", None: "cpu-xla"}  # by `serving`
