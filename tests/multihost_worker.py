"""One process of a two-process run on CPU (`test_sharding.py::test_two_processes`).

    python tests/multihost_worker.py PROCESS_ID PORT CHECKPOINT_DIR

Each process has 4 CPU devices; together they form a 2×4 (data×model) mesh over
`jax.distributed` with gloo collectives, as hosts of a multi-host launch would. The
process loads the checkpoint onto the global mesh, generates, and prints one JSON line.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=pid)

import specjax  # noqa: E402

PROMPTS = json.loads(os.environ["SPECJAX_PROMPTS"])
mesh = specjax.make_mesh({"data": 2, "model": 4})
model = specjax.load(ckpt, mesh=mesh)
out = {kind: specjax.generate(model, PROMPTS, max_new_tokens=6, ignore_eos=True,
                              speculator=spec).tokens
       for kind, spec in (("plain", None), ("ngram", specjax.speculators.NGram(k=3)))}
print("RESULT " + json.dumps(out), flush=True)
