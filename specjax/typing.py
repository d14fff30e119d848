"""Shape-annotated array types (jaxtyping) for specjax's signatures.

One letter per axis, the same letters throughout the code and docs:
  B rows (sequences)       T new tokens per row      S key slots per row (M·Z)
  N query heads            K KV heads                G = N / K   H head dim
  L layers                 P pages in the pool       Z slots per page (page size)
  M pages per row (table)  D hidden size             V vocabulary
  Dm draft depth           Nd draft-tree nodes (root excluded)

A letter binds one size within a call: `q: Queries` and `mask: TreeMask` must agree on
B and T. The test suite checks the annotated functions of the modules named in
pyproject's `--jaxtyping-packages` (jaxtyping's pytest plugin, beartype) at run time,
tracers included, so an annotation that lies fails a test; library users pay nothing
(no checker runs outside the tests). Not instrumented: modules that define pytree
dataclasses (`cache`, `verify`, `tree`), since jaxtyping would check their fields at
every unflatten, where jax passes leaves that are not arrays; and the kernel's public
`api`, whose own validation must be what a caller sees (its `launch` is checked).
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Array, Bool, Float, Int, Int8, Shaped

# Tokens and positions of T new tokens per row.
Tokens = Int[Array, "B T"]
Positions = Int[Array, "B T"]
RowLengths = Int[Array, "B"]  # per-row counts: KV lengths, new-token counts, prefixes
HostRowLengths = Int[Array | np.ndarray, "B"]

# The paged KV cache (specjax.cache): one layer's pages, all layers', int8 scales.
Pages = Shaped[Array, "K P Z H"]  # float, or int8 with Scales
LayerPages = Shaped[Array, "L K P Z H"]
Scales = Float[Array, "K P Z"]
PageTable = Int[Array, "B M"]
HostPageTable = Int[Array | np.ndarray, "B M"]  # what a PagePool hands out, or on device
SlotIndex = Int[Array, "B T"]  # a page id or an offset in it, per row and new token
SlotValid = Bool[Array, "B T"]
LayerIndex = Int[Array, ""] | int  # traced in a layer scan, a Python int unrolled

# int8 quantization (specjax.kv_quant): per vector of H values, any leading axes.
FloatVectors = Float[Array, "*lead H"]
Int8Vectors = Int8[Array, "*lead H"]
VectorScales = Float[Array, "*lead"]

# Attention: T queries per row, keys/values as rows see them, masks.
Queries = Float[Array, "B T N H"]
RowKV = Float[Array, "B S K H"]  # a row's keys or values gathered from its pages
NewKV = Float[Array, "B T K H"]  # the T new tokens' keys or values
TreeMask = Bool[Array, "B T T"]  # [b, i, j]: new token i may see new token j
AllowedMask = Bool[Array, "B T S"]  # [b, i, s]: query i may see key slot s

# Model outputs.
Logits = Float[Array, "B T V"]
Hidden = Float[Array, "B T D"]

__all__ = ["AllowedMask", "FloatVectors", "Hidden", "HostPageTable", "HostRowLengths",
           "Int8Vectors", "LayerIndex", "LayerPages", "Logits", "NewKV", "PageTable", "Pages",
           "Positions", "Queries", "RowKV", "RowLengths", "Scales", "SlotIndex", "SlotValid",
           "Tokens", "TreeMask", "VectorScales"]
