"""specjax.bench.load: each load opens the file with the reader it names, every pair is
timed each round, and a bad flag names itself."""

from __future__ import annotations

import pytest

import specjax
from specjax.bench import load as bench_load
from specjax.config import tiny_llama


def test_both_readers_load_and_every_round_is_timed(tmp_path, monkeypatch):
    model = specjax.init_model(tiny_llama(vocab_size=64), seed=0)
    path = specjax.save_gguf(model, tmp_path / "tiny.gguf")
    seen, real = [], bench_load._reader

    def recording(kind):  # the reader `kind` names, noting each file it opens
        class Reader(real(kind)):
            def __init__(self, *args, **kwargs):
                seen.append(kind)
                super().__init__(*args, **kwargs)
        return Reader

    monkeypatch.setattr(bench_load, "_reader", recording)
    times = bench_load.measure({"specjax.load": lambda k: bench_load.load_specjax(path, k)},
                               repeats=3)
    assert seen.count(bench_load.STOCK) == seen.count(bench_load.VIEW) == 4
    assert set(times) == {("specjax.load", bench_load.STOCK), ("specjax.load", bench_load.VIEW)}
    assert all(len(ts) == 3 and min(ts) > 0 for ts in times.values())
    assert "| specjax.load | reader_class |" in bench_load.report(times)


def test_bad_flags_name_themselves(tmp_path, capsys):
    for argv, message in ((["--repeats", "0"], "--repeats=0 must be >= 1"),
                          (["--checkpoint", str(tmp_path / "x.bin")], "must be a .gguf file")):
        with pytest.raises(SystemExit):
            bench_load.main(argv)
        assert message in capsys.readouterr().err
