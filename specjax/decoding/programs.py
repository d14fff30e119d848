"""`ProgramCache`: the compiled prefill and decode programs `generate` runs, held by an
explicit object rather than jit's own cache, which would compile on first call and so
put compile time into TTFT. `LayoutCache`: the speculators laid out for those programs."""

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


class LayoutCache:
    """Speculators laid out for decoding (`Speculator.for_decoding`), by speculator object
    and layout: repeated `generate` calls with one speculator convert its weights once
    (a draft's unrolled copy costs a good part of a second on CPU). An entry holds the
    speculator itself, so its id is not reused while cached; the oldest go past `size`."""

    def __init__(self, size: int = 4):
        self.size = size
        self._laid_out: collections.OrderedDict = collections.OrderedDict()

    def get(self, speculator, layout: str):
        key = (id(speculator), layout)
        hit = self._laid_out.get(key)
        if hit is None or hit[0] is not speculator:
            hit = (speculator, speculator.for_decoding(layout))
            self._laid_out[key] = hit
            while len(self._laid_out) > self.size:
                self._laid_out.popitem(last=False)
        self._laid_out.move_to_end(key)
        return hit[1]

    def clear(self) -> None:
        self._laid_out.clear()
