"""Backs the CPU decode weights with 2 MB transparent huge pages (Linux), best effort.

A decode step streams every weight once. On 4 KB pages that walk misses the TLB at
every page; where the kernel's THP mode is `madvise` (a common default) XLA's buffers
stay on 4 KB pages, since nothing advises them. `advise` asks the kernel to back the
2 MB-aligned span of each large single-device CPU array with huge pages:
`MADV_HUGEPAGE` (later faults and khugepaged may use them) and `MADV_COLLAPSE` (Linux
>= 6.1: moves the pages now). The arrays' contents do not change. Elsewhere (an older
kernel, another OS), with THP `never`, or with `SPECJAX_HUGE_PAGES=off`, it does
nothing. `Model.decode_params` and the speculators' `LayoutCache` call it, in the
background (`advise_soon`), on the layouts they make; docs/design.md ("Huge pages for
the decode weights") has the measurements' pointer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import jax

from specjax.compile_cache import OFF

ENV = "SPECJAX_HUGE_PAGES"
HUGE = 2 << 20  # x86-64's and arm64's (4 KB base pages) PMD-sized huge page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# decoded tokens a fresh process needs to earn back the collapse's CPU time (the steps'
# gain against the first call's cost: docs/benchmarks.md, "First-call compile")
EARNS_BACK = 1024


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"), None where unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def kernel_collapses(release: str | None = None) -> bool:
    """Whether the Linux kernel (`release`, default this one's) has MADV_COLLAPSE (6.1+)."""
    release = os.uname().release if release is None else release
    try:
        major, minor = (int(part) for part in release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 1)


def is_on() -> bool:
    """Whether `advise` acts: Linux 6.1+, THP not `never`, and `SPECJAX_HUGE_PAGES` not
    off. (Without MADV_COLLAPSE the weights, written already, would wait for khugepaged.)"""
    return (sys.platform == "linux" and kernel_collapses()
            and thp_mode() not in (None, "never")
            and os.environ.get(ENV, "").strip().lower() not in OFF)


def _madvise():
    """libc's `madvise`: no library wraps it for an address Python did not map
    (`mmap.madvise` only takes an `mmap` object's own pages)."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def span(x: jax.Array) -> tuple[int, int] | None:
    """[start, end) of the 2 MB-aligned pages wholly inside `x`'s buffer, None where it
    holds none or is not one CPU device's array."""
    devices = x.devices() if isinstance(x, jax.Array) else ()
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return None
    address = x.unsafe_buffer_pointer()
    start = -(-address // HUGE) * HUGE
    end = (address + x.nbytes) // HUGE * HUGE
    return (start, end) if end > start else None


def advise(tree: Any) -> int:
    """Advises huge pages over the aligned span of every leaf of `tree` (see the module's
    docstring); the bytes whose collapse the kernel reported done (0 where it did
    nothing). A refusal (an older kernel, no free huge page) leaves the leaf as it was."""
    if not is_on():
        return 0
    madvise, done = _madvise(), 0
    # an array still being computed has no pages yet, and a span with none is refused
    for leaf in jax.block_until_ready(jax.tree.leaves(tree)):
        where = span(leaf)
        if where is None:
            continue
        start, size = where[0], where[1] - where[0]
        madvise(start, size, MADV_HUGEPAGE)
        if madvise(start, size, MADV_COLLAPSE) == 0:
            done += size
    return done


def off_unless_earned(tokens: int) -> contextlib.AbstractContextManager:
    """A context in which `advise` does nothing, where the user left `SPECJAX_HUGE_PAGES`
    unset and a one-shot process decodes fewer than `EARNS_BACK` tokens in all; a null
    context otherwise."""
    if ENV in os.environ or tokens >= EARNS_BACK:
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {ENV: "off"})


_PENDING: list[threading.Thread] = []


def advise_soon(tree: Any) -> None:
    """`advise(tree)` in a background thread: the kernel's work (compacting memory for
    the huge pages, the copy) overlaps the caller's compile and first steps instead of
    adding to its first call. The thread holds `tree`, so its buffers outlive it;
    readers meanwhile see the same values. `wait()` joins it."""
    if not is_on():
        return
    thread = threading.Thread(target=advise, args=(tree,), name="specjax-huge-pages",
                              daemon=True)
    _PENDING[:] = [t for t in _PENDING if t.is_alive()] + [thread]
    thread.start()


def wait() -> None:
    """Returns once every `advise_soon` started so far has finished."""
    while _PENDING:
        _PENDING.pop().join()


def huge_bytes(x: jax.Array) -> int:
    """Bytes of huge pages (/proc/self/smaps' AnonHugePages) in the mappings that hold
    `x`'s aligned span: what the kernel reports, to check `advise` by (0 off Linux)."""
    where = span(x)
    if where is None:
        return 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's header: "start-end ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < where[1] and hi > where[0]
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
