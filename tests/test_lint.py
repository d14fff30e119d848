"""The habits the suite enforces: the package layering (import-linter's contracts in
pyproject.toml) and ruff's checks (pyflakes, import order, line length)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder in the repository -> where the wheel installs it (pyproject's package-dir)
INSTALLED = {"specjax": "specjax", "train": "specjax/train",
             "pallas_kernels": "specjax/pallas_kernels"}


def test_import_contracts_hold(tmp_path):
    """import-linter reads a package from one directory, so the contracts are checked on
    the installed layout: specjax/ with train/ and pallas_kernels/ copied inside it."""
    for folder, dest in INSTALLED.items():
        shutil.copytree(ROOT / folder, tmp_path / dest, ignore=shutil.ignore_patterns(
            "__pycache__"))
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, "
            "no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
