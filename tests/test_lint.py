"""The habits the suite enforces: the package layering (import-linter's contracts in
pyproject.toml), ruff's checks (pyflakes, import order, line length), and docs sections
named by title that still exist."""

import re
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


# `docs/<file>.md, "<section>"` in code, configs and docs (a line break may fall anywhere
# inside, a comment's `#` after it)
SECTION_REF = re.compile(r'(docs/[a-z_]+\.md),?\s+"([^"]+)"')


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines()
            if re.match(r"#+ ", line)]


def test_section_references_name_a_heading():
    """A section named by its title must still exist: a heading that starts with it."""
    folders = ("specjax", "train", "pallas_kernels", "configs", "tests", "docs", "notebooks")
    files = [ROOT / "README.md"] + [p for f in folders for p in sorted((ROOT / f).rglob("*"))
                                    if p.suffix in (".py", ".md", ".gin", ".ipynb")]
    broken, seen = [], 0
    for path in files:
        text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text(errors="ignore"))
        for doc, section in SECTION_REF.findall(text):
            seen += 1
            target = ROOT / doc
            if not target.exists() or not any(h.startswith(section)
                                               for h in _headings(target)):
                broken.append(f"{path.relative_to(ROOT)}: {doc}, {section!r}")
    assert seen > 0  # the pattern still finds the references
    assert not broken, "\n".join(broken)
