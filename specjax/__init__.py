"""specjax: speculative decoding for large language models in JAX/XLA."""

from specjax.cache import OutOfPagesError, PagedKVCache, PagePool
from specjax.checkpoint import load, restore_orbax, save_hf, save_orbax
from specjax.config import ModelConfig
from specjax.model import Model, forward, init_model, init_params, param_shapes, step

__version__ = "0.1.0"

__all__ = [
    "Model", "ModelConfig", "OutOfPagesError", "PagePool", "PagedKVCache", "forward",
    "init_model", "init_params", "load", "param_shapes", "restore_orbax", "save_hf",
    "save_orbax", "step",
]
