"""Compile the Triton kernel for NVIDIA GPUs on a machine that has none.

    python -m specjax.pallas_kernels.compile_check                # sm_90 and sm_80, bench shapes
    python -m specjax.pallas_kernels.compile_check --arch 90 --sweep  # every `bench --tune` shape

GPU time is scarce here (docs/kernels.md), and most of "does it build for a GPU" needs
none: Pallas lowers the kernel to Triton IR on CPU (`lowering_platforms=("cuda",)`), and
OpenAI Triton's compiler (the `triton` wheel: MLIR, LLVM and ptxas, no driver) takes
that IR down to a cubin for a named architecture. For each case this reports the
hardware budget: registers per thread, spilled bytes, shared memory per program, the
MMA instruction chosen, and how many programs fit on one SM. A case fails if it does
not compile, spills to local memory, or needs more shared memory than the
architecture gives one program.

What it does not prove: that XLA's own Triton build (what jax runs on a GPU) accepts the
same IR — the same dialect, another build — or anything about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from specjax.pallas_kernels import bench
from specjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class Arch:
    """What one NVIDIA architecture gives a program (CUDA programming guide, table 21)."""

    capability: int  # 90 = sm_90 (H100/H200), 80 = sm_80 (A100)
    device_kind: str  # as `jax.devices()[0].device_kind` reports it: picks the tuned entry
    shared_per_program: int  # bytes, the opt-in maximum for one thread block
    shared_per_sm: int  # bytes
    regs_per_sm: int = 65536
    warps_per_sm: int = 64
    programs_per_sm: int = 32


ARCHS = {
    90: Arch(90, "NVIDIA H100 80GB HBM3", 227 * 1024, 228 * 1024),
    80: Arch(80, "NVIDIA A100-SXM4-80GB", 163 * 1024, 164 * 1024),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel instance: a benchmark shape plus the options that change the code."""

    shape: bench.Shape
    dtype: str = "bfloat16"
    int8: bool = False
    soft_cap: float | None = None
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        extra = [self.dtype] + ["int8 KV"] * self.int8 + ["cap+window"] * (
            self.soft_cap is not None)
        return f"{self.shape.name} {' '.join(extra)}"


def cases() -> list[Case]:
    """Every regime and every option that changes the kernel's code, at bench shapes."""
    shape = bench.Shape
    out = [Case(shape(8, 4096, 1)), Case(shape(1, 16384, 1)),
           Case(shape(8, 4096, 5)), Case(shape(8, 4096, 5, tree=True)),
           Case(shape(8, 4096, 16, tree=True)), Case(shape(8, 4096, 64, tree=True)),
           Case(shape(1, 4096, 512))]
    return out + [Case(shape(8, 4096, 1), int8=True),
                  Case(shape(8, 4096, 16, tree=True), int8=True),
                  Case(shape(8, 4096, 1), dtype="float32"),
                  Case(shape(8, 4096, 16, tree=True), soft_cap=30.0, sliding_window=1024)]


def kernel_options(case: Case, arch: Arch, **requested) -> dict:
    """The static options `ragged_paged_attention` would pick on `arch` (or `requested`)."""
    return bench.resolve_for(case.shape, jnp.dtype(case.dtype), lowering="triton",
                             interpret=False, device_kind=arch.device_kind, **requested)


@contextlib.contextmanager
def _captured_triton_modules():
    """Collects the text of every Triton module Pallas lowers while the block runs.

    JAX has no public way to get a kernel's Triton IR as parseable text: `debug=True`
    prints it with pretty-printed locations (not parseable), and the lowered module
    holds it as MLIR bytecode of jaxlib's own dialect build. So this wraps the private
    lowering function and prints each module without locations.
    """
    from jax._src.pallas.triton import lowering

    modules, original = [], lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        yield modules
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def triton_ir(case: Case, options: dict) -> str:
    """The kernel's Triton IR (text) for `case` with block sizes `options`, on any host."""
    s = case.shape
    inputs = jax.eval_shape(lambda: bench.make_inputs(s, jnp.dtype(case.dtype),
                                                      int8=case.int8))
    sizes = {k: options[k] for k in ("block_rows", "pages_per_block", "kv_splits")}

    def attend(a):
        return ragged_paged_attention(
            **a, scale=s.head_dim ** -0.5, soft_cap=case.soft_cap,
            sliding_window=case.sliding_window, lowering="triton", interpret=False, **sizes)

    jax.clear_caches()  # a cached lowering would not pass through the spy
    with _captured_triton_modules() as modules:
        jax.jit(attend).trace(inputs).lower(lowering_platforms=("cuda",))
    if len(modules) != 1:
        raise RuntimeError(f"expected one Triton module for {case.name}, got {len(modules)}")
    return modules[0]


@dataclasses.dataclass(frozen=True)
class Report:
    """What the compiler made of one case on one architecture."""

    case: str
    arch: int
    options: dict
    registers: int  # per thread
    spill_bytes: int  # local memory per thread (register spills)
    shared_bytes: int  # per program: Triton's dynamic allocation + static
    mma: str  # "wgmma" (Hopper), "mma.sync" (tensor cores), or "none" (FMA)
    loads: str  # "TMA", "cp.async" or "ld.global" for the KV pages
    programs_per_sm: int  # occupancy limit from registers, shared memory and warps
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _triton_bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool} is not in the triton wheel at {path}")
    return path


def compile_ir(ir: str, arch: Arch, *, num_warps: int, num_stages: int) -> dict:
    """Triton IR text -> cubin for `arch`; its resource use (cuobjdump) and instructions."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; no warning
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir)
        kernel = triton.compile(path, target=GPUTarget("cuda", arch.capability, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_triton_bin("cuobjdump"), "-res-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage!r}")
    regs, _, static_shared, local = map(int, found.groups())
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    loads = ("TMA" if "cp.async.bulk.tensor" in ptx else
             "cp.async" if "cp.async" in ptx else "ld.global")
    return dict(registers=regs, spill_bytes=local,
                shared_bytes=kernel.metadata.shared + static_shared, mma=mma, loads=loads)


def check(case: Case, arch: Arch, **requested) -> Report:
    """Lower and compile `case` for `arch` with the tuned (or `requested`) block sizes."""
    options = kernel_options(case, arch, **requested)
    got = compile_ir(triton_ir(case, options), arch, num_warps=options["num_warps"],
                     num_stages=options["num_stages"])
    return assess(case.name, arch, options, got)


def assess(case: str, arch: Arch, options: dict, got: dict) -> Report:
    """`compile_ir`'s findings judged against what `arch` gives a program."""
    warps = options["num_warps"]
    per_sm = min(arch.programs_per_sm, arch.warps_per_sm // warps,
                 arch.regs_per_sm // max(1, got["registers"] * 32 * warps),
                 arch.shared_per_sm // max(1, got["shared_bytes"]))
    problems = []
    if got["spill_bytes"]:
        problems.append(f"spills {got['spill_bytes']} bytes per thread to local memory")
    if got["shared_bytes"] > arch.shared_per_program:
        problems.append(f"needs {got['shared_bytes']} bytes of shared memory, sm_"
                        f"{arch.capability} gives a program {arch.shared_per_program}")
    return Report(case=case, arch=arch.capability, options=options,
                  programs_per_sm=per_sm, problems=tuple(problems), **got)


def sweep_cases(arch: Arch) -> list[tuple[Case, dict]]:
    """`bench --tune`'s distinct kernels for its representative shapes, on `arch`; every
    `kv_splits > 1` is one kernel here (the split count is a grid size, not code)."""
    out, seen = [], set()
    for shape in bench.tune_shapes(small=False).values():
        for opts in bench.tune_candidates(shape, False, jnp.bfloat16, lowering="triton",
                                          interpret=False, device_kind=arch.device_kind):
            opts = opts | dict(kv_splits=min(opts["kv_splits"], 2))
            if (shape, tuple(sorted(opts.items()))) not in seen:
                seen.add((shape, tuple(sorted(opts.items()))))
                out.append((Case(shape), opts))
    return out


def _row(r: Report) -> str:
    o = r.options
    sizes = f"{o['block_rows']}x{o['pages_per_block']}p/{o['kv_splits']}s/{o['num_warps']}w"
    verdict = "ok" if r.ok else "FAIL: " + "; ".join(r.problems)
    return (f"sm_{r.arch} {r.case:<44} {sizes:<16} {r.registers:>4} {r.spill_bytes:>5} "
            f"{r.shared_bytes / 1024:>7.1f} {r.mma:<9} {r.loads:<9} {r.programs_per_sm:>3}  "
            f"{verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90,80",
                        help=f"compute capabilities, comma-separated, of {sorted(ARCHS)}")
    parser.add_argument("--sweep", action="store_true",
                        help="compile every `bench --tune` candidate instead of the cases")
    parser.add_argument("--only", default="", help="regex: only matching case names")
    parser.add_argument("--json", default=None, help="write the reports as JSON lines here")
    args = parser.parse_args(argv)
    try:
        archs = [ARCHS[int(a)] for a in args.arch.split(",")]
    except (KeyError, ValueError):
        parser.error(f"--arch={args.arch!r}: each must be one of {sorted(ARCHS)}")
    try:
        import triton
    except ImportError:
        parser.error("needs the `triton` wheel (pip install triton; Linux x86_64)")
    print(f"# {datetime.date.today()}, jax {jax.__version__}, triton {triton.__version__}: "
          f"{' '.join(sys.argv)}")
    print(f"{'arch':<6} {'case':<44} {'rows x pages':<16} {'regs':>4} {'spill':>5} "
          f"{'smem KiB':>7} {'mma':<9} {'loads':<9} {'/SM':>3}  verdict")
    reports = []
    for arch in archs:
        todo = sweep_cases(arch) if args.sweep else [(c, {}) for c in cases()]
        for case, requested in [(c, r) for c, r in todo if re.search(args.only, c.name)]:
            try:
                report = check(case, arch, **requested)
            except Exception as e:  # a candidate the lowering or compiler rejects
                if not args.sweep:
                    raise
                print(f"sm_{arch.capability} {case.name:<44} {requested}: "
                      f"{type(e).__name__}: {str(e)[:100]}")
                continue
            print(_row(report), flush=True)
            reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            for r in reports:
                f.write(json.dumps(dataclasses.asdict(r) | {"ok": r.ok}) + "\n")
    return 0 if args.sweep or all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
