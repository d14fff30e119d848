"""Ragged paged attention with a tree mask: Pallas kernels (Triton for GPU, Mosaic for TPU).

T new query tokens per row at the end of its KV, KV read through a page table, GQA/MQA,
causal or tree mask among the new tokens, ragged lengths, optional soft-cap and sliding
window; float32 online softmax. The plain-jnp reference with the same signature:
`reference_ragged_paged_attention` (`reference.py`); the contract and the entry point
that picks kernel or reference: `specjax.attention`. Optional int8 pages with per-slot
scales (`quantize_pages`; reference: `dequantize_pages` then the reference).
Design notes: docs/kernels.md.
"""

from specjax.pallas_kernels.ragged_paged_attention._common import dequantize_pages, quantize_pages
from specjax.pallas_kernels.ragged_paged_attention.api import (
    native_lowering,
    ragged_paged_attention,
    resolve_block_sizes,
)
from specjax.pallas_kernels.ragged_paged_attention.reference import reference_ragged_paged_attention
from specjax.pallas_kernels.ragged_paged_attention.tuned_block_sizes import (
    TUNED_BLOCK_SIZES,
    BlockSizes,
    get_block_sizes,
)
from specjax.pallas_kernels.ragged_paged_attention.validation import check_inputs, static_check

__all__ = [
    "BlockSizes", "TUNED_BLOCK_SIZES", "check_inputs", "dequantize_pages",
    "get_block_sizes", "native_lowering", "quantize_pages", "ragged_paged_attention",
    "reference_ragged_paged_attention", "resolve_block_sizes", "static_check",
]
