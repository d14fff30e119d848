"""`ProgramCache`: the compiled prefill and decode programs `generate` runs, held by an
explicit object rather than jit's own cache, which would compile on first call and so
put compile time into TTFT."""

from __future__ import annotations

import collections

import jax

from specjax.sharding import rules as shard
from specjax.xla_options import compile_decode


class ProgramCache:
    """Compiled programs by (name, static loop, argument structure, shapes and shardings):
    compiled ahead of the call so that compile time stays out of TTFT. Least recently
    used programs are dropped past `size`, so a long session does not keep them all."""

    def __init__(self, size: int = 32):
        self.size = size
        self._programs: collections.OrderedDict = collections.OrderedDict()

    def get(self, name: str, fn, static, args: tuple, kwargs: dict, mesh=None):
        leaves, treedef = jax.tree.flatten(args)
        sig = (name, static, treedef, tuple(kwargs.items()),
               tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))),
                      getattr(x, "sharding", None)) for x in leaves))
        if sig not in self._programs:
            with shard.use_mesh(mesh):  # traced under the mesh: attention runs per shard
                self._programs[sig] = compile_decode(fn.lower(static, *args, **kwargs))
            while len(self._programs) > self.size:
                self._programs.popitem(last=False)
        self._programs.move_to_end(sig)
        return self._programs[sig]

    def items(self):
        return self._programs.items()

    def clear(self) -> None:
        self._programs.clear()
