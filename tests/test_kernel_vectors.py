"""specjax/csrc/vectors.h: the CPU kernels' vectors take each target's native width, so
their arithmetic runs in full-width registers on every x86 kind, AVX2-only ones included
(a fixed 64-byte type was lowered piecewise through the stack there)."""

from __future__ import annotations

import platform
import re
import subprocess

import jax
import pytest

from specjax import cpu_attention, cpu_kernels, rows_matmul

X86 = platform.machine() in ("x86_64", "AMD64")
needs_x86_compiler = pytest.mark.skipif(
    not X86 or cpu_kernels.cxx() is None, reason="the targets below are x86 ones")


def _compile(source: str, march: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [cpu_kernels.cxx(), "-x", "c++", "-std=c++17", f"-march={march}", "-w",
         f"-I{cpu_kernels.CSRC}", f"-I{jax.ffi.include_dir()}", *flags, source],
        capture_output=True, text=True)


@needs_x86_compiler
@pytest.mark.parametrize("march, lanes, registers", [
    ("x86-64", 4, 16),           # SSE2 only
    ("znver3", 8, 16),           # AMD EPYC: AVX2, tuned for 128-bit vectors
    ("x86-64-v3", 8, 16),        # AVX2
    ("skylake-avx512", 16, 32),  # AVX-512
])
def test_vectors_are_the_targets_width(tmp_path, march, lanes, registers):
    probe = tmp_path / "probe.cc"
    probe.write_text(f'#include "vectors.h"\n'
                     f"static_assert(specjax::kLanes == {lanes});\n"
                     f"static_assert(specjax::kRegisters == {registers});\n"
                     f"static_assert(sizeof(specjax::vf) == {lanes} * sizeof(float));\n")
    done = _compile(str(probe), march, "-fsyntax-only")
    assert done.returncode == 0, done.stderr


@needs_x86_compiler
@pytest.mark.parametrize("kernel", [rows_matmul.KERNEL, rows_matmul.KERNEL_T,
                                    cpu_attention.KERNEL],
                         ids=["rows_matmul", "rows_matmul_t", "paged_attention"])
def test_kernels_multiply_add_in_full_width_registers_on_avx2(kernel):
    # znver3's tuning prefers 128-bit vectors: with a vector type wider than its
    # registers, GCC emitted no 256-bit multiply-add at all in the matmul kernel
    done = _compile(str(kernel.source), "znver3", "-O3", "-fPIC", "-S", "-o", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    # the destination, the last operand (the first may be a memory operand, a folded load)
    fmas = re.findall(r"vfmadd\w*ps\s+.*%(\w)mm\d+$", done.stdout, re.MULTILINE)
    assert fmas.count("y") >= 20, f"256-bit FMAs: {fmas.count('y')} of {len(fmas)}"


@needs_x86_compiler
@pytest.mark.parametrize("march, register", [("x86-64-v3", "y"), ("skylake-avx512", "z")])
def test_fma_is_the_fused_instruction_on_fma_targets(tmp_path, march, register):
    # `specjax::fma` must be the instruction itself, not a product and a sum the
    # compiler may or may not contract: the transposed kernel's bits rest on it
    probe = tmp_path / "fma.cc"
    probe.write_text('#include "vectors.h"\n'
                     "specjax::vf f(specjax::vf a, specjax::vf b, specjax::vf c) {\n"
                     "  return specjax::fma(a, b, c);\n}\n")
    done = _compile(str(probe), march, "-O2", "-ffp-contract=off", "-S", "-o", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(rf"vfmadd\w*ps\s+.*%{register}mm\d+$", done.stdout, re.MULTILINE), (
        done.stdout[-2000:])
