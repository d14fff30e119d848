"""Few-row float32 matmuls on XLA:CPU through a small C++ kernel (an XLA FFI handler).

A decode step multiplies each weight matrix by one row per sequence and a verify
forward by a few. XLA:CPU's GEMM of a few rows costs far more than its one-row GEMV
although both read the same weights, and that, more than anything, makes a verify dear
on CPU (`python -m specjax.bench.matmul_rows`; figures in docs/benchmarks.md).
`specjax/csrc/rows_matmul.cc` streams each weight row once for all rows (up to
`MAX_ROWS`); the CPU decode layout's dense layers and LM head call it through `matmul` /
`dot_general` (`specjax.models.transformer`), and so do a draft model's trimmed head and
an EAGLE head beside a target in that layout.

It is built on first use and falls back to XLA's matmul where it cannot be
(`specjax.cpu_kernels`; `SPECJAX_CPU_MATMUL=off` turns it off). Whether it beats XLA's
own product depends on the host and the weight's shape (on some 2-core Xeons the two
are near ties, 0.8-1.9x either way; docs/benchmarks.md), so before its first use on a weight
shape the kernel races XLA's matmul on this machine (`kernel_wins`) and takes only the
shapes it wins; `SPECJAX_CPU_MATMUL=on` skips the race. With jax's persistent
compilation cache on, the verdicts are kept beside the built kernel (`<library>.race.json`,
keyed like it on source, compiler, jaxlib and CPU), so later processes on this machine
take the same shapes without racing again; delete that file to race again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import bf16_gemm, cpu_kernels, timing
from specjax.cpu_kernels import layer_of, layer_operand

ENV = "SPECJAX_CPU_MATMUL"  # "off" (or 0, false, none): XLA's matmul everywhere; "on": the
ON = frozenset({"on", "1", "true", "yes"})  # kernel wherever it applies, without a race
TARGET = "specjax_rows_matmul"
# Rows per call the kernel takes; above this XLA's GEMM is about as fast (`python -m
# specjax.bench.matmul_rows --kernel-max-rows 64 --rows 1,17,25,33,49`, docs/benchmarks.md).
MAX_ROWS = 32
KERNEL = cpu_kernels.FfiKernel(TARGET, cpu_kernels.CSRC / "rows_matmul.cc", ENV,
                               "few-row CPU matmul kernel", "XLA's matmul")
# The same product on a weight stored transposed ([O, I]: each output's weights
# contiguous), for the CPU decode layout's own weights (`transposed_wins`, `matmul_t`)
TARGET_T = "specjax_rows_matmul_t"
KERNEL_T = cpu_kernels.FfiKernel(TARGET_T, cpu_kernels.CSRC / "rows_matmul_t.cc", ENV,
                                 "few-row CPU matmul kernel (transposed weights)",
                                 "XLA's matmul")
# The race: for each weight shape, the kernel against XLA's matmul at a decode step's,
# a short verify's and a tree verify's rows, over copies of the weight filling more than
# a server CPU's last-level cache (64 MB), so both read it from memory as a model's
# layers do. One verdict per shape for every row count: each row's result must not
# depend on how many rows share the call (a verify's token = a decode step's).
RACE_ROWS, RACE_BYTES, RACE_ROUNDS = (1, 5, 17), 64 << 20, 5
RACE_FORM = "unrolled"  # how `race_times` lays the copies out: part of a verdict's key
# weights the transposed-weight kernel takes: bfloat16 ones are widened as they stream
# (half the bytes; XLA:CPU's bfloat16 matmul converts the whole weight to float32 first)
WEIGHT_DTYPES_T = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_log = logging.getLogger(__name__)
_wins: dict[tuple[str, str], bool] = {}  # (kernel target, `_key`) -> whether it won
_race_lock = threading.Lock()
# Set while tracing a decode loop (`any_rows`): the kernels take every row count
_ANY_ROWS = contextvars.ContextVar("specjax_rows_matmul_any_rows", default=False)


@contextlib.contextmanager
def any_rows():
    """Products traced within take the kernels at any row count, `max_rows` lifted: a
    verify's row gets the sums a decode step gives it however many rows share the
    forward (past `MAX_ROWS` XLA's GEMM or the bfloat16 GEMM would sum in other orders,
    and greedy speculation at batch x tree > 32 could part from plain decoding). Set
    around generate's decode loop (plain steps and verifies), not around prefill."""
    token = _ANY_ROWS.set(True)
    try:
        yield
    finally:
        _ANY_ROWS.reset(token)


def available() -> bool:
    """Whether the kernel is registered with XLA:CPU (`cpu_kernels.FfiKernel.available`)."""
    return KERNEL.available()


def available_t() -> bool:
    """Whether the transposed-weight kernel is registered with XLA:CPU."""
    return KERNEL_T.available()


def applies(x: jax.Array, w: jax.Array, max_rows: int = MAX_ROWS, race: bool = True) -> bool:
    """x [..., I] @ w [I, O] goes to the kernel: float32 both, at most `max_rows` rows,
    on the CPU backend, with the kernel available and, with `race`, faster than XLA's
    matmul for this weight shape on this machine (`kernel_wins`)."""
    return (_few_rows(x, w, max_rows) and w.ndim == 2 and x.shape[-1] == w.shape[0]
            and available() and (not race or kernel_wins(tuple(w.shape))))


def _few_rows(x: jax.Array, w: jax.Array, max_rows: int, dtypes=(jnp.float32,)) -> bool:
    """What the kernels take: operands of `dtypes`, 1 to `max_rows` rows (any number
    within `any_rows`), the CPU backend. Both take float32; the transposed-weight kernel
    also bfloat16 (`WEIGHT_DTYPES_T`)."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (x.dtype in dtypes and w.dtype in dtypes
            and rows >= 1 and (rows <= max_rows or _ANY_ROWS.get())
            and jax.default_backend() == "cpu")


def kernel_wins(shape: tuple[int, int]) -> bool:
    """Whether the kernel beats XLA's matmul on weights of `shape` here: raced once per
    process and shape (`race`, a fraction of a second), or True with
    `SPECJAX_CPU_MATMUL=on`."""
    return _raced(shape, transposed=False)


def transposed_wins(shape: tuple[int, int], dtype="float32") -> bool:
    """Whether the transposed-weight kernel (`matmul_t` on the [O, I] copy of an [I, O]
    weight of `shape` and `dtype`) beats what the [I, O] weight would otherwise get here
    (`rival`; for bfloat16 weights XLA's matmul): the CPU decode layout stores such
    weights transposed (`specjax.model.decode_params`). Raced once per process, shape,
    dtype and rival (`race(transposed=True)`), False where that kernel is not available
    or does not take `dtype`, True with `SPECJAX_CPU_MATMUL=on`."""
    dtype = jnp.dtype(dtype)
    if not available_t() or dtype not in WEIGHT_DTYPES_T:
        return False
    return _raced(shape, transposed=True,
                  rival=rival(shape) if dtype == jnp.float32 else "xla", dtype=dtype)


def rival(shape: tuple[int, int]) -> str:
    """What multiplies an [I, O] weight of `shape` here: "kernel" where the [I, O] kernel
    won its race (`kernel_wins`), else "xla". Asked before `_raced` takes the race's lock
    (`kernel_wins` takes it too)."""
    return "kernel" if available() and kernel_wins(shape) else "xla"


def _raced(shape: tuple[int, int], transposed: bool, rival: str = "xla",
           dtype=jnp.float32) -> bool:
    """`kernel_wins` / `transposed_wins` (against `rival`, on weights of `dtype`): the
    verdict kept from an earlier race on this machine (`verdicts_file`), else a race
    now."""
    if os.environ.get(ENV, "").strip().lower() in ON:
        return True
    kernel = KERNEL_T if transposed else KERNEL
    name = _key(shape, rival if transposed else None, dtype)
    key = (kernel.target, name)
    with _race_lock:
        if key not in _wins:
            kept = verdicts_file(kernel)
            earlier = _read_verdicts(kept).get(name) if kept else None
            _wins[key] = (_race_in_thread(shape, transposed, rival, dtype)
                          if earlier is None else earlier)
            if kept and earlier is None:
                _write_verdict(kept, name, _wins[key])
            _log.info("few-row CPU matmul kernel%s on %s %s weights: %s%s",
                      f" (transposed weights, against {RIVALS[rival][0]})" if transposed
                      else "", shape, jnp.dtype(dtype).name,
                      "faster, used" if _wins[key] else "slower, not used",
                      "" if earlier is None else f" (raced earlier: {kept})")
        return _wins[key]


def verdicts_file(kernel: cpu_kernels.FfiKernel = KERNEL) -> Path | None:
    """Where the race's verdicts for `kernel` are kept: beside its built library when
    that lives in the persistent compilation cache (`cpu_kernels.persistent_dir`), else
    None."""
    lib, kept = kernel.library_path(), cpu_kernels.persistent_dir()
    if lib is None or kept is None or lib.parent != kept:
        return None
    return lib.with_suffix(".race.json")


def _key(shape: tuple[int, int], rival: str | None = None, dtype=jnp.float32) -> str:
    """A verdict's key: the shape and what the race timed, the rival included for the
    transposed kernel's and the weights' dtype where not float32 (a changed race races
    again)."""
    dtype = jnp.dtype(dtype)
    return (f"{shape[0]}x{shape[1]} rows {','.join(map(str, RACE_ROWS))} bytes {RACE_BYTES}"
            f" {RACE_FORM}" + ("" if rival is None else f" vs {rival}")
            + ("" if dtype == jnp.float32 else f" {dtype.name}"))


def _read_verdicts(path: Path) -> dict[str, bool]:
    """{key: verdict} (`_key`) from `path`; empty where it is missing or unreadable (the race
    then runs again and rewrites it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) else {}


def _write_verdict(path: Path, key: str, wins: bool) -> None:
    """Adds one verdict (`_key`) to `path`, replacing the file whole (processes racing
    other shapes at once may each drop the other's new verdict: it is raced again later)."""
    verdicts = {**_read_verdicts(path), key: wins}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: race again next time
        _log.warning("could not keep the matmul race's verdict in %s: %s", path, e)


def serving(config) -> str | None:
    """Which kernel a decode step of a model of `config` (a `ModelConfig`) multiplies
    through here, judged on its MLP's down projection ([intermediate, hidden], the most
    common shape of its weights): "transposed" (the decode layout stores the weights
    [O, I]; float32 or bfloat16), "kernel" (the [I, O] kernel; float32), or None (XLA's
    matmul: another dtype, not on CPU, or neither kernel won)."""
    shape = (config.intermediate_size, config.hidden_size)
    if jnp.dtype(config.dtype) not in WEIGHT_DTYPES_T or jax.default_backend() != "cpu":
        return None
    if transposed_wins(shape, config.dtype):
        return "transposed"
    return ("kernel" if config.dtype == "float32" and available() and kernel_wins(shape)
            else None)


def _race_in_thread(shape: tuple[int, int], transposed: bool = False,
                    rival: str = "xla", dtype=jnp.float32) -> bool:
    """`race` in a thread of its own: `applies` runs while a program is traced, and jax
    would stage the race's calls into that program rather than run them."""
    out: list = []

    def run():
        try:
            out.append(race(shape, transposed=transposed, rival=rival, dtype=dtype))
        except Exception as e:  # re-raised in the caller's thread, not lost with this one
            out.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if isinstance(out[0], Exception):
        raise out[0]
    return bool(out[0])


def race(shape: tuple[int, int], rows: tuple[int, ...] = RACE_ROWS,
         rounds: int = RACE_ROUNDS, nbytes: int = RACE_BYTES, transposed: bool = False,
         rival: str = "xla", dtype=jnp.float32) -> bool:
    """Whether the kernel's products of each of `rows` rows with copies of a `shape`
    weight (at least `nbytes` in all) take less time in sum than XLA's (`race_times`);
    `transposed`: the transposed-weight kernel's, on the copies stored [O, I], against
    `rival`'s on the [I, O] copies ("xla" or the [I, O] "kernel", `RIVALS`), the
    weights and rows of `dtype` (bfloat16: the transposed kernel's only). False where
    that kernel is not available."""
    if not (available_t() if transposed else available()):
        return False
    if not transposed:
        return verdict(race_times(shape, rows, rounds, nbytes))
    forms = {"transposed": transposed_product, rival: RIVALS[rival][1]}
    return verdict(race_times(shape, rows, rounds, nbytes, forms, dtype), "transposed",
                   rival)


def verdict(times: dict, ours: str = "kernel", theirs: str = "xla") -> bool:
    """Whether form `ours` won `race_times`' timings over `theirs`: less time summed over
    row counts."""
    return sum(t[ours] for t in times.values()) < sum(t[theirs] for t in times.values())


def race_times(shape: tuple[int, int], rows: tuple[int, ...] = RACE_ROWS,
               rounds: int = RACE_ROUNDS, nbytes: int = RACE_BYTES,
               forms: dict | None = None, dtype=jnp.float32) -> dict:
    """{rows: {"kernel" | "xla": median seconds}} of products of that many rows with
    copies of a `shape` weight, one after another in one program (`race_program`), each
    copy its own buffer as a model's layers are (at least `nbytes` of weights, so both
    read them from memory): medians over `rounds` interleaved calls
    (`timing.interleaved_medians`). Seeded inputs; needs the kernel (`available`).
    forms: {name: product (x, w) -> x @ w} to time instead of the kernel and XLA's; a
    `Transposed` form multiplies by the copies stored [O, I]. dtype: the weights' and
    the rows'."""
    forms = forms or {"kernel": _rows, "xla": jnp.matmul}
    rng = np.random.default_rng(0)
    # Separate buffers, one product each, unrolled: a loop over stacked copies
    # (`lax.map`) slices each weight into a new buffer first (XLA:CPU's dynamic slice is
    # a copy), so both forms read it from the last-level cache rather than from memory
    ws = tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
               for _ in range(race_copies(shape, nbytes, dtype)))
    wts = (tuple(jnp.asarray(np.asarray(w).T) for w in ws)  # each its own [O, I] buffer
           if any(isinstance(form, Transposed) for form in forms.values()) else ())
    out = {}
    for r in rows:
        x = jnp.asarray(rng.standard_normal((r, shape[0]), np.float32), dtype)
        calls = {name: (race_program(form), (x, wts if isinstance(form, Transposed) else ws))
                 for name, form in forms.items()}
        out[r] = timing.interleaved_medians(calls, rounds)
    return out


class Transposed:
    """A race form that multiplies by the weight stored transposed ([O, I]): `race_times`
    lays its copies out transposed, outside the timed program, as the decode layout
    stores them."""

    def __init__(self, product):
        self.product = product  # (x [R, I], wt [O, I]) -> [R, O]

    def __call__(self, x, wt):
        return self.product(x, wt)


def race_program(form):
    """(x [R, I], ws: a tuple of [I, O] weights) -> [len(ws), R, O], each weight's product
    by `form` (`_rows` or `jnp.matmul`), unrolled, each weight read where it lies."""
    return jax.jit(lambda x, ws: jnp.stack([form(x, w) for w in ws]))


def race_copies(shape: tuple[int, int], nbytes: int = RACE_BYTES, dtype=jnp.float32) -> int:
    """Copies of a `shape` weight of `dtype` the race multiplies: at least `nbytes`, 1-64."""
    size = jnp.dtype(dtype).itemsize * shape[0] * shape[1]
    return max(1, min(64, -(-nbytes // size)))


# How the kernel multiplies 2..FEW_ROWS rows (its `form` attribute, FEW_ROWS its
# kFewRows): the form `sweeps` picks by the weight's width, or one forced, to time the
# two side by side (`python -m specjax.bench.matmul_race --kernel-forms`). Every form
# gives the same bits.
FORMS = {"register blocks": 1, "sweep": 2}
FEW_ROWS = 8
# Rows that sweep a weight of WIDE columns or more (the MLP's gate and up): WIDE_ROWS;
# of VERY_WIDE or more (an LM head): FEW_ROWS (docs/benchmarks.md, "Few-row matmuls").
WIDE_ROWS, WIDE, VERY_WIDE = 4, 1536, 4096


def sweeps(rows: int, out: int) -> bool:
    """Whether `rows` rows of a weight of `out` columns go through the kernel's sweep
    (else register blocks; one row has its own sweep either way)."""
    return 2 <= rows <= FEW_ROWS and (out >= VERY_WIDE or (out >= WIDE and rows <= WIDE_ROWS))


def _check_stacked(w: jax.Array, layer) -> None:
    """A stacked weight [L, A, B] needs the layer to multiply by."""
    if layer is None and w.ndim == 3:
        raise ValueError(f"a stacked weight {w.shape} needs the layer to multiply by")


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _kernel(x: jax.Array, w: jax.Array, layer: jax.Array, form: int) -> jax.Array:
    """[R, I] @ w [I, O], or @ layer `layer` of w [L, I, O], by the kernel."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, layer,
                                                                    form=np.int64(form))


@_kernel.defjvp
def _kernel_jvp(form, primals, tangents):  # differentiable: tangents through XLA's matmul
    (x, w, layer), (dx, dw, _) = primals, tangents
    return _kernel(x, w, layer, form), dx @ layer_of(w, layer) + x @ layer_of(dw, layer)


def in_form(name: str):
    """The kernel's product (x, w) -> x @ w with 2..FEW_ROWS rows in form `name` (a key
    of `FORMS`), whatever the weight's width (`sweeps` aside)."""
    if name not in FORMS:
        raise ValueError(f"kernel form {name!r} is not one of {sorted(FORMS)}")
    return functools.partial(_rows, form=FORMS[name])


def _rows(x: jax.Array, w: jax.Array, form: int | None = None, layer=None) -> jax.Array:
    """[..., I] @ [I, O] (or layer `layer` of [L, I, O]) -> [..., O] by the kernel, 2-8
    rows in `form` (a value of `FORMS`; None: the one `sweeps` picks)."""
    rows = x.reshape(-1, x.shape[-1])
    if form is None:
        form = FORMS["sweep" if sweeps(rows.shape[0], w.shape[-1]) else "register blocks"]
    return _kernel(rows, w, layer_operand(layer), form).reshape(*x.shape[:-1], w.shape[-1])


def matmul(x: jax.Array, w: jax.Array, preferred_element_type=None,
           max_rows: int = MAX_ROWS, race: bool = True, layer=None) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O]: the kernel where it `applies` (float32 in and
    out), else XLA's. `max_rows` above `MAX_ROWS` and race=False (the kernel wherever it
    can, won or not) are for measuring it (`specjax.bench.matmul_rows`).
    layer: w is a stack [L, I, O] and the product is by its layer `layer` (the decode
    layout's scanned layers): the kernel for few float32 rows, won or not (XLA's
    alternative would slice, i.e. copy, the layer first), else XLA's on the slice."""
    _check_stacked(w, layer)
    if layer is not None and w.ndim == 3:
        if _few_rows(x, w, max_rows) and available():
            return _rows(x, w, layer=layer)
        return jnp.matmul(x, layer_of(w, layer), preferred_element_type=preferred_element_type)
    if not applies(x, w, max_rows, race):
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
    return _rows(x, w)


def _kernel_t(x: jax.Array, wt: jax.Array, layer=None) -> jax.Array:
    """[R, I] @ wt [O, I]^T (or layer `layer` of wt [L, O, I], float32 or bfloat16) by
    the transposed-weight kernel, in float32 (bfloat16 rows widened)."""
    out = jax.ShapeDtypeStruct((x.shape[0], wt.shape[-2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_T, out, vmap_method="sequential")(
        x.astype(jnp.float32), wt, layer_operand(layer))


@jax.custom_jvp
def _rows_t(x: jax.Array, wt: jax.Array, layer: jax.Array) -> jax.Array:
    """[..., I] @ [O, I]^T (or layer `layer` of [L, O, I]) -> [..., O] by the
    transposed-weight kernel."""
    rows = x.reshape(-1, x.shape[-1])
    return _kernel_t(rows, wt, layer).reshape(*x.shape[:-1], wt.shape[-2])


@_rows_t.defjvp
def _rows_t_jvp(primals, tangents):  # differentiable: tangents through XLA's matmul
    (x, wt, layer), (dx, dwt, _) = primals, tangents
    return (_rows_t(x, wt, layer),
            _xla_t(dx, layer_of(wt, layer)) + _xla_t(x, layer_of(dwt, layer)))


def _xla_t(x: jax.Array, wt: jax.Array, preferred_element_type=None) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, wt, preferred_element_type=preferred_element_type)


def matmul_t(x: jax.Array, wt: jax.Array, preferred_element_type=None,
             max_rows: int = MAX_ROWS, layer=None) -> jax.Array:
    """x [..., I] @ wt [O, I]^T -> [..., O] for a weight the decode layout stores
    transposed (`transposed_wins`): the transposed-weight kernel for products of at most
    `max_rows` rows (any number within `any_rows`) of float32 or bfloat16 operands
    (summed in float32, as XLA:CPU's bfloat16 matmul does, and rounded to their dtype);
    more bfloat16 rows (a prefill's) by the bfloat16 GEMM kernel where it `applies`
    (`specjax.bf16_gemm`); else XLA's (float32 prefill's many rows, where its GEMM on
    either layout is as fast).
    layer: wt is a stack [L, O, I] and the product is by its layer `layer`, read in
    place by the kernels (XLA's product takes a slice: a copy)."""
    _check_stacked(wt, layer)
    out = jnp.dtype(preferred_element_type or jnp.result_type(x, wt))
    if _few_rows(x, wt, max_rows, WEIGHT_DTYPES_T) and available_t():
        return _rows_t(x, wt, layer_operand(layer)).astype(out)
    if bf16_gemm.applies(x, wt, max_rows + 1):
        return bf16_gemm.product(x, wt, layer).astype(out)
    return _xla_t(x, layer_of(wt, layer), preferred_element_type)



transposed_product = Transposed(_kernel_t)  # the race's form; needs `available_t`
# What the transposed kernel races (`transposed_wins`): the form the [I, O] weight would
# otherwise get, {name: (what the log calls it, its race form)}
RIVALS = {"kernel": ("the [I, O] kernel", _rows), "xla": ("XLA's matmul", jnp.matmul)}


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
    """`jax.lax.dot_general` for `flax.linen.Dense(dot_general=)`: its product (the last
    axis of lhs with the first of a 2-D rhs, no batch axes) goes to `matmul`."""
    (lc, rc), (lb, rb) = dimension_numbers
    dense = (tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb
             and preferred_element_type in (None, jnp.float32))
    if dense and applies(lhs, rhs):
        return _rows(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)

