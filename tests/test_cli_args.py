"""The command-line tools' shared argument checks (`specjax.cli_args`)."""

from __future__ import annotations

import argparse

import pytest

from specjax.cli_args import comma_list


@pytest.mark.parametrize("text, kw, want", [
    ("1,2, 8", dict(convert=int), [1, 2, 8]),
    ("4,4,16", dict(convert=int, minimum=1), [4, 4, 16]),  # order and repeats kept
    ("0,1.5", dict(convert=float, minimum=0), [0.0, 1.5]),
    ("ngram,,eagle", dict(choices=("ngram", "eagle", "draft")), ["ngram", "eagle"]),
])
def test_comma_list_parses_in_order(text, kw, want):
    assert comma_list(argparse.ArgumentParser(), "--x", text, **kw) == want


@pytest.mark.parametrize("text, kw, message", [
    ("1,a", dict(convert=int), "--x='1,a' must be comma-separated integers"),
    ("0.5,hot", dict(convert=float), "--x='0.5,hot' must be comma-separated numbers"),
    (" , ", {}, "--x=' , ': give at least one value"),
    ("ngram,poems", dict(choices=("ngram", "eagle")),
     "--x='ngram,poems': unknown ['poems']; choose from ngram,eagle"),
    ("4,0", dict(convert=int, minimum=1), "--x='4,0': every value must be >= 1"),
])
def test_comma_list_names_the_flag_and_its_value(text, kw, message, capsys):
    with pytest.raises(SystemExit) as e:
        comma_list(argparse.ArgumentParser(), "--x", text, **kw)
    assert e.value.code == 2 and message in capsys.readouterr().err
