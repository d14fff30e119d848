"""specjax.typing: the shape annotations are checked at run time under the tests."""
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from specjax import attention, kv_quant


def test_the_suite_runs_with_the_shape_checks(pytestconfig):
    """pyproject's addopts instrument these modules (jaxtyping's pytest plugin)."""
    packages = (pytestconfig.getoption("--jaxtyping-packages") or "").split(",")
    assert {"specjax.attention", "specjax.kv_quant",
            "specjax.pallas_kernels.ragged_paged_attention.launch"} <= set(packages), packages


def test_a_call_whose_shapes_disagree_fails_naming_the_argument():
    """B = 2 queries against a page table of 3 rows: the annotation, not XLA, says so."""
    q = jnp.zeros((2, 3, 4, 8))
    pages = jnp.zeros((2, 5, 4, 8))
    lens = jnp.ones((2,), jnp.int32)
    with pytest.raises(jaxtyping.TypeCheckError, match="page_table"):
        attention.reference_paged_attention(q, pages, pages, jnp.zeros((3, 2), jnp.int32),
                                            lens, lens, scale=1.0)
    ok = attention.reference_paged_attention(q, pages, pages, jnp.zeros((2, 2), jnp.int32),
                                             lens, lens, scale=1.0)
    assert ok.shape == q.shape
    # host (numpy) arrays are valid input to the entry point, and the annotations say so
    host = attention.paged_attention(*map(np.asarray, (q, pages, pages)),
                                     np.zeros((2, 2), np.int32), np.asarray(lens),
                                     np.asarray(lens), scale=1.0, backend="reference")
    np.testing.assert_array_equal(host, ok)


def test_dtype_annotations_are_checked_too():
    """`dequantize` takes int8 codes; float codes are refused."""
    x = jnp.ones((3, 8))
    codes, scales = kv_quant.quantize(x)
    assert codes.dtype == jnp.int8
    with pytest.raises(jaxtyping.TypeCheckError, match="q"):
        kv_quant.dequantize(x, scales, jnp.float32)
