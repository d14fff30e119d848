"""specjax: speculative decoding for large language models in JAX/XLA."""

from specjax import compile_cache, export, heads, kv_quant, sharding, speculators
from specjax.cache import OutOfPagesError, PagedKVCache, PagePool
from specjax.chat import apply_chat_template
from specjax.checkpoint import load, restore_orbax, save_gguf, save_hf, save_orbax
from specjax.config import ModelConfig
from specjax.decoding.cost import VerifyCost
from specjax.decoding.generate import GenerationResult, generate
from specjax.export import export_eagle3, export_gguf, export_medusa, export_speculators
from specjax.model import Model, forward, init_model, init_params, param_shapes, step
from specjax.sampling import Sampling
from specjax.sharding import check_fits, make_mesh, plan_memory, shard_model
from specjax.stats import GenerationStats
from specjax.tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "DraftTree", "GenerationResult", "GenerationStats", "Model", "ModelConfig",
    "OutOfPagesError", "PagePool", "PagedKVCache", "VerifyCost", "forward",
    "init_model", "init_params", "load", "param_shapes", "restore_orbax", "save_hf",
    "Sampling", "save_orbax", "speculators", "step", "generate",
    "check_fits", "make_mesh", "plan_memory", "shard_model", "sharding", "heads",
    "kv_quant", "compile_cache", "save_gguf", "export", "export_eagle3", "export_gguf",
    "export_medusa", "export_speculators", "apply_chat_template",
]
