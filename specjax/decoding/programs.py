"""`ProgramCache`: the compiled prefill and decode programs `generate` runs, held by an
explicit object rather than jit's own cache, which would compile on first call and so
put compile time into TTFT. `LayoutCache`: the speculators laid out for those programs."""

from __future__ import annotations

import collections
from pathlib import Path

import jax

from specjax import huge_pages
from specjax.sharding import rules as shard
from specjax.xla_options import compile_decode, decode_options


def memory_maps() -> int | None:
    """This process's memory maps (Linux's /proc/self/maps), None where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_budget(fraction: float = 0.75) -> int | None:
    """`fraction` of Linux's per-process limit on memory maps (`vm.max_map_count`), None
    where there is none to read."""
    try:
        return int(int(Path("/proc/sys/vm/max_map_count").read_text()) * fraction)
    except (OSError, ValueError):
        return None


class ProgramCache:
    """Compiled programs by (name, static loop, argument structure, shapes and shardings):
    compiled ahead of the call so that compile time stays out of TTFT. Least recently
    used programs are dropped past `size`, so a long session does not keep them all.

    Every XLA:CPU program holds memory maps (thousands for a 30-layer model's decode
    loop) that jax's own caches keep alive after this cache drops the program; past the
    OS limit the next compile fails ("Cannot allocate memory") and the process dies.
    So before compiling, when the process holds more maps than `budget`, this cache and
    jax's caches are cleared (`jax.clear_caches`): later calls recompile (from the
    persistent compilation cache where it is on) instead of crashing."""

    def __init__(self, size: int = 32, budget: int | None = None):
        self._programs = _Lru(size)
        self.budget = map_budget() if budget is None else budget

    def get(self, name: str, fn, static, args: tuple, kwargs: dict, mesh=None):
        leaves, treedef = jax.tree.flatten(args)
        sig = (name, static, treedef, tuple(kwargs.items()),
               tuple(sorted(decode_options().items())),  # an edited option recompiles
               tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))),
                      getattr(x, "sharding", None)) for x in leaves))  # last: tests read it

        def compile_():
            self._make_room()
            with shard.use_mesh(mesh):  # traced under the mesh: attention runs per shard
                return compile_decode(fn.lower(static, *args, **kwargs))

        return self._programs.get(sig, lambda hit: hit is not None, compile_)

    def _make_room(self) -> None:
        maps = memory_maps()
        if maps is not None and self.budget is not None and maps > self.budget:
            self.clear()
            jax.clear_caches()

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
        self._laid_out = _Lru(size)

    def get(self, speculator, layout: str):
        return self._laid_out.get(
            (id(speculator), layout), lambda hit: hit is not None and hit[0] is speculator,
            lambda: (speculator, _advised(speculator.for_decoding(layout))))[1]

    def clear(self) -> None:
        self._laid_out.clear()


def _advised(laid_out):
    """`laid_out`, its weights backed with huge pages where the host allows, as the
    target's are (`specjax.huge_pages`)."""
    huge_pages.advise_soon(laid_out)
    return laid_out


class _Lru:
    """The least-recently-used store both caches keep: at most `size` entries."""

    def __init__(self, size: int):
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, valid, make):
        """The entry for `key`, made by `make()` when missing or when `valid(entry)` fails."""
        if not valid(self._items.get(key)):
            self._items[key] = make()
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        self._items.move_to_end(key)
        return self._items[key]

    def items(self):
        return self._items.items()

    def clear(self) -> None:
        self._items.clear()
