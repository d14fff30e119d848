"""`specjax generate` from a training run: its target, draft and heads, its chain length
and tree, and its calibration passed to the adaptive rule; greedy output identical to
plain decoding for every speculator; bad input exits 2 naming the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specjax
from specjax import cli_generate
from specjax.cli import main as cli
from specjax.config import tiny_llama
from specjax.speculators import DraftModel, Eagle, Hybrid, Medusa, NGram

IDS = ["--ids", "5,6,7,8,5,6,7,8,5,6", "--max-new-tokens", "8"]
# the run's calibrations, as the comparison writes them into results.json
PRIORS = {"0.0": {"ngram": dict(prior=[0.9, 0.8], overhead=[0.01, 0.02], proposal=0.5,
                                idle=0.01),
                  "eagle3": dict(prior=[0.7, 0.6], overhead=[0.05, 0.1], proposal=1.0,
                                 idle=0.02, tries=[200.0, 120.0]),
                  "ngram_corpus": dict(prior=[0.6, 0.5], overhead=[0.02, 0.03],
                                       proposal=0.8, idle=0.01)},
          "1.0": {"eagle3": dict(prior=[0.3, 0.2], overhead=[0.05, 0.1], proposal=1.0,
                                 idle=0.02)}}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished run in miniature: target and draft exports, an EAGLE-3 stage (its tree
    in DONE.json) and Medusa heads, and results.json with k = 2 and calibrations."""
    w = tmp_path_factory.mktemp("cli") / "run"
    target = specjax.init_model(tiny_llama(64, num_layers=2), seed=0)
    draft = specjax.init_model(tiny_llama(64, num_layers=1, hidden_size=32,
                                          intermediate_size=64, num_heads=2,
                                          num_kv_heads=1), seed=1)
    specjax.save_hf(target, w / "target" / "export")
    specjax.save_hf(draft, w / "draft" / "export")
    Eagle.random(target, version=3, top_k=2, depth=2, total_tokens=3).save(
        w / "eagle3" / "heads")
    stage = {"settings": {"stage": {"eagle_tree": [2, 2, 3]}}}
    (w / "eagle3" / "DONE.json").write_text(json.dumps(stage))
    Medusa.random(target, num_heads=2, tree=[[0], [0, 0]]).save(w / "medusa" / "heads")
    (w / "results.json").write_text(json.dumps({"settings": {"k": 2}, "priors": PRIORS}))
    (w / "regenerated").mkdir()
    (w / "regenerated" / "regenerated.jsonl").write_text(
        "".join(json.dumps({"ids": [5, 6, 7, 8, 9, i]}) + "\n" for i in range(10, 14)))
    return w


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Every `specjax.generate` call's speculator and keyword arguments, the call itself
    unchanged."""
    seen, real = [], specjax.generate

    def recording(model, prompts, speculator=None, **kw):
        seen.append(dict(kw, speculator=speculator))
        return real(model, prompts, speculator=speculator, **kw)

    monkeypatch.setattr(specjax, "generate", recording)
    return seen


def test_eagle_from_a_run_uses_its_heads_tree_and_calibration(run, calls, capsys):
    assert cli(["generate", "--workdir", str(run), "--speculator", "eagle"] + IDS) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical: True" in out
    assert f"calibration: eagle3 at T = 0, from {run / 'results.json'}" in out
    spec, kw = calls[1]["speculator"], calls[1]
    assert isinstance(spec, Eagle) and (spec.top_k, spec.depth, spec.total_tokens) == (2, 2, 3)
    assert kw["acceptance_prior"] == [0.7, 0.6] and kw["step_overhead"] == [0.05, 0.1]
    assert kw["prior_tries"] == [200.0, 120.0]  # the calibration's tries come with it
    assert "acceptance_prior" not in calls[0]  # plain decoding takes no calibration
    # at T = 1 the run's T = 1 calibration
    assert cli(["generate", "--workdir", str(run), "--speculator", "eagle",
                "--temperature", "1"] + IDS) == 0
    assert calls[3]["acceptance_prior"] == [0.3, 0.2]
    # another tree than the run calibrated: that tree, and the rule's defaults
    assert cli(["generate", "--workdir", str(run), "--speculator", "eagle",
                "--tree", "1,2,2"] + IDS) == 0
    spec = calls[5]["speculator"]
    assert (spec.top_k, spec.depth, spec.total_tokens) == (1, 2, 2)
    assert "acceptance_prior" not in calls[5]
    assert "calibration: none" in capsys.readouterr().out


def test_chains_and_medusa_from_a_run(run, calls, capsys):
    """n-gram and the draft take the run's k (and n-gram its calibration); another k
    drops the calibration; Medusa loads the run's medusa/heads. Greedy, all lossless."""
    assert cli(["generate", "--workdir", str(run), "--speculator", "ngram"] + IDS) == 0
    assert isinstance(calls[1]["speculator"], NGram) and calls[1]["speculator"].k == 2
    assert calls[1]["acceptance_prior"] == [0.9, 0.8]
    assert cli(["generate", "--workdir", str(run), "--speculator", "ngram", "--k", "3"]
               + IDS) == 0
    assert calls[3]["speculator"].k == 3 and "acceptance_prior" not in calls[3]
    assert cli(["generate", "--workdir", str(run), "--speculator", "draft"] + IDS) == 0
    assert isinstance(calls[5]["speculator"], DraftModel) and calls[5]["speculator"].k == 2
    assert "acceptance_prior" not in calls[5]  # the run has no draft calibration
    assert cli(["generate", "--workdir", str(run), "--speculator", "medusa"] + IDS) == 0
    assert isinstance(calls[7]["speculator"], Medusa)
    assert capsys.readouterr().out.count("greedy outputs identical: True") == 4


def test_another_model_or_cache_than_the_run_calibrated_drops_its_calibration(run, calls,
                                                                            capsys):
    """The run's calibration holds for its own target with the default KV cache:
    --model or --kv-cache-dtype leave the rule at its defaults."""
    base = ["generate", "--workdir", str(run), "--speculator", "ngram"] + IDS
    for extra in (["--model", str(run / "target" / "export")],
                  ["--kv-cache-dtype", "int8"]):
        assert cli(base + extra) == 0
        assert "acceptance_prior" not in calls[-1]
        assert "calibration: none" in capsys.readouterr().out
    assert cli(base) == 0  # and without them, the run's calibration
    assert calls[-1]["acceptance_prior"] == [0.9, 0.8]


def test_the_runs_own_continuations_come_with_their_calibration(run, calls, tmp_path):
    """--ngram-corpus naming the run's regenerated continuations: its comparison's
    `ngram_corpus` calibration; the same texts in another file: none."""
    own = run / "regenerated" / "regenerated.jsonl"
    base = ["generate", "--workdir", str(run), "--speculator", "ngram"] + IDS
    assert cli(base + ["--ngram-corpus", str(own)]) == 0
    assert calls[1]["speculator"].corpus is not None
    assert calls[1]["acceptance_prior"] == [0.6, 0.5]
    other = tmp_path / "copy.jsonl"
    other.write_text(own.read_text())
    assert cli(base + ["--ngram-corpus", str(other)]) == 0
    assert "acceptance_prior" not in calls[3]


def test_ngram_eagle_pairs_the_lookup_with_the_runs_head(run, calls, capsys):
    """--speculator ngram_eagle: the run's EAGLE head in its tree, n-gram's chain of the
    run's k where lookup matches; no calibration (the run's is the head's alone)."""
    assert cli(["generate", "--workdir", str(run), "--speculator", "ngram_eagle"] + IDS) == 0
    spec = calls[1]["speculator"]
    assert isinstance(spec, Hybrid) and spec.lookup.k == 2
    assert isinstance(spec.model, Eagle) and spec.model.total_tokens == 3
    assert "acceptance_prior" not in calls[1]
    assert "greedy outputs identical: True" in capsys.readouterr().out


def test_heads_without_a_run(run, calls, capsys):
    """--model and --heads alone: the default tree (4,4,16), no calibration."""
    assert cli(["generate", "--model", str(run / "target" / "export"), "--speculator",
                "eagle", "--heads", str(run / "eagle3" / "heads")] + IDS) == 0
    spec = calls[1]["speculator"]
    assert (spec.top_k, spec.depth, spec.total_tokens) == cli_generate.DEFAULT_TREE
    assert "acceptance_prior" not in calls[1]
    assert "greedy outputs identical: True" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--speculator", "eagle"], "--speculator eagle needs --heads DIR"),
    (["--speculator", "medusa", "--workdir", "{run}/eagle3"], "no target/export"),
    (["--speculator", "eagle", "--heads", "{run}/medusa/heads"],
     "holds 'medusa' heads, not 'eagle' heads"),
    (["--workdir", "{run}", "--speculator", "eagle", "--tree", "4,4"],
     "--tree='4,4' must be TOP_K,DEPTH,NODES"),
    (["--workdir", "{run}", "--speculator", "eagle", "--tree", "2,2,9"],
     "--tree='2,2,9': Eagle dynamic tree needs"),
    (["--workdir", "{run}", "--k", "0"], "--k=0 must be >= 1"),
    (["--speculator", "draft"], "--speculator draft needs --draft DIR"),
    (["--workdir", "{run}", "--speculator", "medusa", "--tree", "2,2,3"],
     "--tree is for --speculator eagle or ngram_eagle; --speculator is 'medusa'"),
    (["--speculator", "none", "--tree", "1,2,2"],
     "--tree is for --speculator eagle or ngram_eagle; --speculator is 'none'"),
    (["--speculator", "ngram_eagle"], "--speculator ngram_eagle needs --heads DIR"),
    (["--speculator", "ngram", "--heads", "{run}/eagle3/heads"],
     "--heads is for --speculator eagle or medusa or ngram_eagle; --speculator is 'ngram'"),
    (["--speculator", "eagle", "--draft", "{run}/draft", "--heads", "{run}/eagle3/heads"],
     "--draft is for --speculator draft; --speculator is 'eagle'"),
    (["--speculator", "ngram", "--draft-vocab", "vocab.npy"],
     "--draft-vocab is for --speculator draft; --speculator is 'ngram'"),
])
def test_bad_input_exits_2_naming_it(run, argv, message, capsys):
    argv = [a.replace("{run}", str(run)) for a in argv]
    if "--workdir" not in argv and "--heads" in argv:
        argv += ["--model", str(run / "target" / "export")]
    assert cli(["generate"] + argv + IDS) == 2
    assert message in capsys.readouterr().err


def test_ids_that_are_not_integers_exit_2_naming_them(capsys):
    assert cli(["generate", "--speculator", "none", "--ids", "1,x"]) == 2
    assert "--ids='1,x' must be comma-separated integers" in capsys.readouterr().err


def test_sampling_flags_reach_both_calls_and_bad_ones_exit_2(calls, capsys):
    assert cli(["generate", "--speculator", "ngram", "--temperature", "0.8", "--top-k", "20",
                "--top-p", "0.9", "--min-p", "0.05"] + IDS) == 0
    for kw in calls:
        assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (0.8, 20, 0.9,
                                                                              0.05)
    assert len(calls) == 2
    assert cli(["generate", "--speculator", "none", "--min-p", "1.5"] + IDS) == 2
    assert "min_p=1.5 must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("speculator, new, switch", [
    ("ngram", "8", "off"),  # 16 tokens in two calls: the collapse would not pay
    ("ngram", "512", None),  # 1,024 tokens: the weights go onto huge pages as elsewhere
])
def test_a_short_run_leaves_the_weights_on_base_pages(speculator, new, switch,
                                                      monkeypatch):
    from specjax import huge_pages

    monkeypatch.delenv(huge_pages.ENV, raising=False)
    seen, real = [], huge_pages.advise_soon
    monkeypatch.setattr(huge_pages, "advise_soon", lambda tree: seen.append(
        huge_pages.os.environ.get(huge_pages.ENV)) or real(tree))
    assert cli(["generate", "--speculator", speculator, "--ids", "5,6,7,8",
                "--max-new-tokens", new]) == 0
    huge_pages.wait()
    assert seen and set(seen) == {switch}
    assert huge_pages.ENV not in huge_pages.os.environ


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[Path, specjax.Model]:
    """A tiny model whose tokenizer knows the words of a ChatML template, saved with it."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "Be",
             "brief", "Say", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = dataclasses.replace(specjax.init_model(tiny_llama(64, num_layers=1), seed=0),
                                tokenizer=tok, chat_template=template)
    path = tmp_path_factory.mktemp("chat") / "model"
    specjax.save_hf(model, path)
    return path, model


def test_chat_puts_the_prompt_in_the_models_template(chat_model, monkeypatch):
    path, model = chat_model
    prompts, real = [], specjax.generate

    def recording(m, p, **kw):
        prompts.append(p)
        return real(m, p, **kw)

    monkeypatch.setattr(specjax, "generate", recording)
    args = ["generate", "--model", str(path), "--speculator", "none", "--max-new-tokens", "2",
            "--prompt", "Say hi", "--chat"]
    assert cli(args) == 0
    assert prompts[-1] == [specjax.apply_chat_template(
        model, [{"role": "user", "content": "Say hi"}])]
    assert cli(args + ["--system", "Be brief"]) == 0
    want = specjax.apply_chat_template(model, [{"role": "system", "content": "Be brief"},
                                               {"role": "user", "content": "Say hi"}])
    assert prompts[-1] == [want] and want[:3] == [1, 3, 6]  # <|im_start|> system Be
    # the answer's start, continued: the chat ends inside the assistant's turn
    assert cli(args + ["--answer-start", "Say"]) == 0
    want = specjax.apply_chat_template(model, [{"role": "user", "content": "Say hi"},
                                               {"role": "assistant", "content": "Say"}],
                                       continue_final_message=True)
    assert prompts[-1] == [want] and want[-3:] == [1, 5, 8]  # <|im_start|> assistant Say


@pytest.mark.parametrize("argv, message", [
    (["--chat"], "--chat needs --prompt TEXT"),
    (["--chat", "--ids", "1,2"], "--chat needs --prompt TEXT"),
    (["--prompt", "Say hi", "--system", "Be brief"], "--system is for --chat"),
    (["--prompt", "Say hi", "--answer-start", "Hi"], "--answer-start is for --chat"),
])
def test_bad_chat_flags_exit_2(argv, message, capsys):
    assert cli(["generate", "--speculator", "none"] + argv) == 2
    assert message in capsys.readouterr().err


def test_chat_with_a_model_without_tokenizer_exits_2_saying_so(run, capsys):
    argv = ["generate", "--model", str(run / "target" / "export"), "--speculator", "none",
            "--prompt", "hi", "--chat"]
    assert cli(argv) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_says_when_the_rule_runs_plain_decodings_programs(run, capsys):
    """A speculator the calibration says cannot pay runs plain decoding's programs, and the
    output says so and why; one that drafts prints no such line."""
    assert cli(["generate", "--workdir", str(run), "--speculator", "eagle",
                "--temperature", "1"] + IDS) == 0
    out = capsys.readouterr().out
    assert "α=0.000" in out.splitlines()[3]
    assert ("(plain decoding's programs: the adaptive rule, from the calibration, expects "
            "no gain from drafting here)") in out
    assert cli(["generate", "--workdir", str(run), "--speculator", "ngram"] + IDS) == 0
    assert "plain decoding's programs" not in capsys.readouterr().out
