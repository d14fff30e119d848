"""Sharding: logical axis names, one rules table, meshes, placement and the memory planner.

See docs/sharding.md. `load(path, mesh=...)` (`specjax.checkpoint.sharded`), `shard_model`
and `generate` use these.
"""

from specjax.sharding.memory import (
                                     DoesNotFitError,
                                     MemoryPlan,
                                     cache_bytes,
                                     check_fits,
                                     params_bytes,
                                     plan_memory,
)
from specjax.sharding.per_shard import per_shard_attention, per_shard_pages
from specjax.sharding.rules import (
                                     CACHE_AXES,
                                     PARAM_AXES,
                                     REPLICATE_IF_INDIVISIBLE,
                                     RULES,
                                     ShardingError,
                                     active_mesh,
                                     auto_mesh,
                                     cache_specs,
                                     constrain,
                                     constrain_cache,
                                     constrain_caches,
                                     create_cache,
                                     logical_spec,
                                     make_mesh,
                                     mesh_axis,
                                     mesh_of,
                                     page_axis,
                                     page_shards,
                                     param_logical_axes,
                                     param_shardings,
                                     param_specs,
                                     partition_spec,
                                     put,
                                     replicate,
                                     shard_batch,
                                     shard_model,
                                     shard_params,
                                     shard_speculator,
                                     to_host,
                                     tree_shardings,
                                     tree_specs,
                                     use_mesh,
)

__all__ = [
    "CACHE_AXES", "DoesNotFitError", "MemoryPlan", "PARAM_AXES", "REPLICATE_IF_INDIVISIBLE",
    "RULES", "ShardingError", "active_mesh", "auto_mesh", "cache_bytes", "cache_specs",
    "check_fits", "constrain", "constrain_cache", "constrain_caches", "create_cache",
    "logical_spec", "make_mesh", "mesh_axis", "mesh_of", "page_axis", "page_shards",
    "param_logical_axes", "param_shardings", "param_specs", "params_bytes", "partition_spec",
    "per_shard_attention", "per_shard_pages", "plan_memory", "put", "replicate", "shard_batch",
    "shard_model", "shard_params", "shard_speculator", "to_host", "tree_shardings",
    "tree_specs", "use_mesh",
]
