"""vllm-project/speculators in its own virtual environment, built once and cached.

speculators pins transformers <= 5.19, older than the test environment's, so its code runs
in a separate venv under `$XDG_CACHE_HOME/specjax-test/speculators-<hash of the
requirements and the test environment's packages>`, built on first use and reused
after; `run_jobs` runs tests/speculators_interop.py there. The venv sees the test
environment's packages (torch among them: installing its wheel again was most of the
build) beneath its own, so its transformers and whatever else speculators pins shadow
ours.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

NO_DEPS = ("speculators==0.9.0", "hs-connectors==0.9.0")  # their own pins clash, see above
DEPS = ("transformers<=5.19", "pydantic", "pydantic-settings", "loguru", "openai",
        "datasets<=5.1", "safetensors", "numpy")
SCRIPT = Path(__file__).with_name("speculators_interop.py")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax-test"


def _pip(python: Path, *args: str) -> None:
    # --no-compile: the interop script imports a few of the modules pip would byte-compile
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile",
                           "--disable-pip-version-check", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"building speculators' venv: pip install {' '.join(args)} "
                           f"failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def speculators_python() -> Path:
    """The python of a venv where `import speculators.models.eagle3` works (built if
    missing; a lock keeps parallel workers from building it twice)."""
    # the venv resolves against the test environment's packages: another set, another venv
    here = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    key = hashlib.sha256(json.dumps([sys.prefix, sys.version, here, NO_DEPS, DEPS]).encode()
                         ).hexdigest()[:12]
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    home = root / f"speculators-{key}"
    python = home / "bin" / "python"
    with open(root / f"speculators-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "ready").exists():
            shutil.rmtree(home, ignore_errors=True)
            venv.create(home, with_pip=True, system_site_packages=True)
            _pip(python, "--no-deps", *NO_DEPS)
            _pip(python, *DEPS)
            subprocess.run([str(python), "-c", "import speculators.models.eagle3"],
                           check=True)
            (home / "ready").write_text(key)
    return python


def run_jobs(jobs: list[dict], workdir: Path) -> None:
    """Runs the interop jobs (see tests/speculators_interop.py) in speculators' venv."""
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "XLA_"))}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([str(speculators_python()), str(SCRIPT), str(spec)],
                          capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode:
        raise AssertionError(f"speculators' code failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
