"""Block sizes per device kind and regime (decode / verify / prefill): the one tuning table.

HONEST STATUS: no entry below has been measured yet — no GPU or TPU was available when
the kernel was written. The values are first guesses from the usual constraints (Triton
dots need every dim >= 16; a KV block of ~64-128 slots amortises the page gather; decode
at small batch needs KV splits to fill the SMs). `python -m specjax.pallas_kernels.bench --tune`
sweeps the candidates on a real device and prints entries to paste here; replace a
guess only with a measured entry, and say so in docs/kernels.md.

The key is a prefix of `jax.devices()[0].device_kind` (first match wins, "" last).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_rows: int  # query rows (token x head-in-group) per program; power of 2
    block_kv: int  # KV slots per flash step; rounded to whole pages
    min_programs: int = 1  # split KV (flash-decoding) until B*K*row_blocks*splits >= this
    num_warps: int = 4  # Triton only
    num_stages: int = 2  # Triton only


# Regimes by T (new tokens per row): one kernel, different blocking.
DECODE, VERIFY, PREFILL = "decode", "verify", "prefill"
VERIFY_MAX_T = 64

TUNED_BLOCK_SIZES: dict[str, dict[str, BlockSizes]] = {
    # Unmeasured guesses (see module doc). 132 SMs: ask for ~2 programs per SM.
    # 64-row blocks take 8 warps: with 4 they compile to 250-255 registers a thread
    # (`python -m specjax.pallas_kernels.compile_check`, docs/kernels.md), with 8 to 128-129.
    "NVIDIA H": {
        DECODE: BlockSizes(block_rows=16, block_kv=64, min_programs=264),
        VERIFY: BlockSizes(block_rows=64, block_kv=64, min_programs=264, num_warps=8),
        PREFILL: BlockSizes(block_rows=64, block_kv=64, min_programs=1, num_warps=8),
    },
    "NVIDIA": {
        DECODE: BlockSizes(block_rows=16, block_kv=64, min_programs=216),
        VERIFY: BlockSizes(block_rows=32, block_kv=64, min_programs=216),
        PREFILL: BlockSizes(block_rows=64, block_kv=64, min_programs=1, num_warps=8),
    },
    # Unmeasured guesses; TPU runs the grid sequentially per core, so no KV splits.
    "TPU": {
        DECODE: BlockSizes(block_rows=8, block_kv=256),
        VERIFY: BlockSizes(block_rows=128, block_kv=256),
        PREFILL: BlockSizes(block_rows=256, block_kv=512),
    },
    # CPU runs the kernels in interpret mode (tests): few, large blocks are fastest.
    "": {
        DECODE: BlockSizes(block_rows=16, block_kv=256),
        VERIFY: BlockSizes(block_rows=128, block_kv=256),
        PREFILL: BlockSizes(block_rows=256, block_kv=256),
    },
}


def regime(t_len: int) -> str:
    """decode (T = 1), verify/tree (T <= 64) or prefill chunk (larger T)."""
    if t_len == 1:
        return DECODE
    return VERIFY if t_len <= VERIFY_MAX_T else PREFILL


def device_kind() -> str:
    return jax.devices()[0].device_kind


def get_block_sizes(t_len: int, kind: str | None = None) -> BlockSizes:
    """Table entry for `t_len` new tokens on device `kind` (default: the first device)."""
    kind = device_kind() if kind is None else kind
    for prefix, entries in TUNED_BLOCK_SIZES.items():
        if kind.startswith(prefix):
            return entries[regime(t_len)]
    raise AssertionError("the '' entry matches every device kind")
