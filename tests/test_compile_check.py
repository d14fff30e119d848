"""The Triton kernel compiles for Hopper (sm_90) and Ampere (sm_80) on this CPU, without
spills and within shared memory (`specjax.pallas_kernels.compile_check`; needs the `triton`
wheel, which the test extras install on Linux x86_64)."""

import dataclasses
import json

import pytest

pytest.importorskip("triton", reason="the triton wheel exists for Linux x86_64 only")

from specjax.pallas_kernels import (
    bench,  # noqa: E402
    compile_check as cc,  # noqa: E402
)

H100, A100 = cc.ARCHS[90], cc.ARCHS[80]


@pytest.fixture(scope="module")
def decode_h100():
    case = cc.Case(bench.Shape(8, 4096, 1))
    options = cc.kernel_options(case, H100)
    got = cc.compile_ir(cc.triton_ir(case, options), H100, num_warps=options["num_warps"],
                        num_stages=options["num_stages"])
    return case, options, got


def test_decode_compiles_for_hopper_on_tensor_cores(decode_h100):
    case, options, got = decode_h100
    report = cc.assess(case.name, H100, options, got)
    assert report.ok, report.problems
    assert got["spill_bytes"] == 0 and 0 < got["registers"] <= 255
    assert 0 < got["shared_bytes"] <= H100.shared_per_program
    assert got["mma"] in ("mma.sync", "wgmma"), got  # bf16 dots on tensor cores
    assert report.programs_per_sm >= 1


@pytest.mark.parametrize("case,arch,mma", [
    # 64 query rows per program: Hopper's warpgroup MMA; tree + int8 pages
    (cc.Case(bench.Shape(8, 4096, 16, tree=True), int8=True), H100, "wgmma"),
    # two mask words, soft-cap and sliding window, on Ampere
    (cc.Case(bench.Shape(2, 4096, 64, tree=True), soft_cap=30.0, sliding_window=1024), A100,
     "mma.sync"),
    # float32 asks for IEEE dots (docs/kernels.md): no TF32 tensor-core MMA
    (cc.Case(bench.Shape(8, 4096, 1), dtype="float32"), H100, "none"),
])
def test_kernel_variants_compile(case, arch, mma):
    report = cc.check(case, arch)
    assert report.ok, report.problems
    assert report.mma == mma, report


def test_a_program_that_overflows_shared_memory_fails(decode_h100):
    case, options, got = decode_h100
    small = dataclasses.replace(H100, shared_per_program=got["shared_bytes"] - 1)
    report = cc.assess(case.name, small, options, got)
    assert not report.ok
    assert f"needs {got['shared_bytes']} bytes of shared memory" in report.problems[0]
    spilling = cc.assess(case.name, H100, options, got | {"spill_bytes": 8})
    assert spilling.problems == ("spills 8 bytes per thread to local memory",)


def test_cli_writes_reports_and_exits_zero(tmp_path, capsys):
    out = tmp_path / "reports.jsonl"
    code = cc.main(["--arch", "80", "--only", "^tree T=5 ", "--json", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["tree T=5 B=8 ctx=4096 bfloat16"]
    assert rows[0]["ok"] and rows[0]["arch"] == 80
    assert "tree T=5 B=8 ctx=4096 bfloat16" in capsys.readouterr().out


def test_cli_names_an_unknown_arch(capsys):
    with pytest.raises(SystemExit) as e:
        cc.main(["--arch", "75"])
    assert e.value.code == 2
    assert "--arch='75'" in capsys.readouterr().err
