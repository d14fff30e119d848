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

# jax arrays (tracers included) or numpy arrays: every entry point runs jnp ops on its
# arguments, so host arrays are valid input and the annotations must say so.
_A = Array | np.ndarray

RowLengths = Int[_A, "B"]  # per-row counts: KV lengths, new-token counts, prefixes

# The paged KV cache (specjax.cache): one layer's pages and int8 scales, the table.
Pages = Shaped[_A, "K P Z H"]  # float, or int8 with Scales
Scales = Float[_A, "K P Z"]
PageTable = Int[_A, "B M"]
SlotIndex = Int[_A, "B T"]  # a page id or an offset in it, per row and new token
SlotValid = Bool[_A, "B T"]
LayerIndex = Int[_A, ""] | int  # traced in a layer scan, a Python int unrolled
# One layer's pages or scales, or all layers' ([L, ...]) beside a LayerIndex.
LayerPages = Shaped[_A, "*L K P Z H"]
LayerScales = Float[_A, "*L K P Z"]

# int8 quantization (specjax.kv_quant): per vector of H values, any leading axes.
FloatVectors = Float[_A, "*lead H"]
Int8Vectors = Int8[_A, "*lead H"]
VectorScales = Float[_A, "*lead"]

# Attention: T queries per row, keys/values as rows see them, masks.
Queries = Float[_A, "B T N H"]
RowKV = Float[_A, "B S K H"]  # a row's keys or values gathered from its pages
NewKV = Float[_A, "B T K H"]  # the T new tokens' keys or values
TreeMask = Bool[_A, "B T T"]  # [b, i, j]: new token i may see new token j
AllowedMask = Bool[_A, "B T S"]  # [b, i, s]: query i may see key slot s

__all__ = ["AllowedMask", "FloatVectors", "Int8Vectors", "LayerIndex", "LayerPages",
           "LayerScales", "NewKV", "PageTable",
           "Pages", "Queries", "RowKV", "RowLengths", "Scales", "SlotIndex", "SlotValid",
           "TreeMask", "VectorScales"]
