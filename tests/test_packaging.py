"""One top-level package: the wheel installs `specjax` only, with the root folders
train/ and pallas_kernels/ inside it (`specjax.train`, `specjax.pallas_kernels`), so no
generic name lands in site-packages."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder in the repository -> its package in the installed tree
FOLDERS = {"specjax": "specjax", "train": "specjax/train",
           "pallas_kernels": "specjax/pallas_kernels"}


def source_packages() -> set[str]:
    """Every package folder of the repository, as its installed path."""
    return {f"{FOLDERS[folder]}/{init.parent.relative_to(ROOT / folder)}".rstrip("/.")
            for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)


def test_wheel_holds_only_specjax(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # the installed setuptools when it builds wheels itself (>= 70.1), else pip's isolated one
    isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("specjax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "specjax"}
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["specjax"]
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert {"specjax/train", "specjax/train/methods", "specjax/pallas_kernels",
            "specjax/pallas_kernels/ragged_paged_attention"} <= packages
    # a package folder missing from pyproject.toml's list would be left out of the wheel
    assert packages == source_packages()
    assert "specjax/train/run.py" in names and "specjax/pallas_kernels/compile_check.py" in names
    # the CPU kernels' sources and the headers they include, built on the user's machine
    csrc = {f"specjax/csrc/{p.name}" for p in (ROOT / "specjax" / "csrc").iterdir()}
    assert {"specjax/csrc/paged_attention.cc", "specjax/csrc/parallel_items.h"} <= csrc
    assert csrc <= set(names)


def test_installed_packages_map_the_root_folders():
    """The editable install (`pip install -e .`) serves the root folders under specjax."""
    import specjax.pallas_kernels.ragged_paged_attention as kernel
    import specjax.train.run as run

    assert Path(run.__file__) == ROOT / "train" / "run.py"
    assert Path(kernel.__file__) == ROOT / "pallas_kernels" / "ragged_paged_attention" / \
        "__init__.py"
