"""specjax.bench.first_call: each setting runs in a process of its own, the filled cache
holds the kernels the empty-cache process built, every process decodes the same tokens, and bad
flags name themselves."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax.bench import first_call
from specjax.config import tiny_llama


def test_three_caches_in_their_own_processes(tmp_path, monkeypatch):
    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    path = specjax.save_gguf(model, tmp_path / "tiny.gguf")
    seen = []
    real = first_call._run_child

    def recording(args, speculator, layout, cache):  # the cache each child was given
        got = real(args, speculator, layout, cache)
        seen.append((cache, sorted(p.name for p in _tree(cache))))
        return got

    monkeypatch.setattr(first_call, "_run_child", recording)
    out = tmp_path / "rows.json"
    code = first_call.main(["--target", str(path), "--speculators", "none", "--prompt-tokens",
                            "12", "--new", "4", "--processes", "1", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["cache"] for r in rows] == list(first_call.CACHES)
    assert all(r["same_tokens"] and r["first_s"] >= r["compile_s"] > 0 for r in rows)
    assert all(r["first_s"] >= r["kernels_s"] + r["layout_s"] for r in rows)
    assert all(r["import_s"] > 0.1 for r in rows)  # jax and specjax imported in the child
    (empty, after_empty), (filled, after_filled), (off, _) = seen
    assert empty == filled != "off" and off == "off"
    assert after_empty  # the empty-cache process wrote its programs there
    # the next process found the kernels the first built (no library of its own); a
    # program may still be added, where its compile crossed the cache's time threshold
    # in one process and not the other
    assert set(after_empty) <= set(after_filled)
    assert [f for f in after_filled if f.endswith(".so")] == [
        f for f in after_empty if f.endswith(".so")]


def _tree(cache: str):
    from pathlib import Path

    root = Path(cache)
    return [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


@pytest.mark.parametrize("argv, message", [
    (["--speculators", "eagle"],
     "--speculators='eagle': unknown ['eagle']; choose from none,ngram"),
    (["--layouts", "flat"], "--layouts='flat': unknown ['flat']; choose from"),
    (["--processes", "0"], "--processes=0 must be >= 1"),
])
def test_bad_flags_name_themselves(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        first_call.main(argv)
    assert message in str(e.value) + capsys.readouterr().err
