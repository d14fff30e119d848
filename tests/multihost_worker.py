"""One process of a two-process run on CPU (`test_sharding.py::test_two_processes`).

    python tests/multihost_worker.py PROCESS_ID PORT CHECKPOINT_DIR

Each process has 4 CPU devices; together they form a 2×4 (data×model) mesh over
`jax.distributed` with gloo collectives, as hosts of a multi-host launch would. The
process loads the checkpoint onto the global mesh, generates, and prints one JSON line;
then both train Medusa heads on the sharded target for two steps into one shared workdir
(`CHECKPOINT_DIR/train`), and process 0 writes the gathered heads to
`CHECKPOINT_DIR/heads.npz`.
"""

import json
import os
import sys
from pathlib import Path

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

import numpy as np  # noqa: E402
from multidevice import medusa_two_steps  # noqa: E402

from specjax.sharding import to_host  # noqa: E402

result = medusa_two_steps(model, Path(ckpt) / "train", mesh=mesh)
heads = {k: to_host(v) for k, v in result.params.items()}  # collective: every process
if pid == 0:
    np.savez(Path(ckpt) / "heads.npz", eval_loss=result.eval["loss"], **heads)
