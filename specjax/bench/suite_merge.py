"""One benchmark-suite section from a suite run taken in parts.

  python -m specjax.bench.suite_merge PART.json [PART.json ...] [--supersede]
      [--out docs/benchmarks.md] [--figures docs/figures] [--json FILE]

The whole grid (five categories, three batch sizes, two temperatures, every method and
peer, several rounds) takes hours on a 2-core CPU. Run it as `specjax bench suite
--json PART.json` calls over disjoint cells (e.g. one per category), with the same
workdir and settings; this writes the docs section, figures and JSON that one run
would have written. Parts that disagree on a setting, or time the same cell twice,
are refused by name.

With `--supersede`, a part re-run later replaces what the earlier parts timed: each
group of cells (category, temperature, batch) a later part times drops the earlier
parts' rows in that group, so that a method's speedup and its peers' ratios come from
the rounds its reference ran in. The section names, beside each part's command, the
groups a later part took over; a part left with no cell is refused by name.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specjax.bench import suite_report

# settings every part must share for their rows to sit in one table
SAME = ("workdir", "new", "repeats", "prompts", "k", "seed", "adaptive", "calibrate",
        "kv_cache_dtype", "verification")
# settings that grow with the parts: the union, in first-seen order
UNION = ("categories", "batches", "temperatures", "methods")


def _union(values) -> list:
    return list(dict.fromkeys(v for vs in values for v in vs))


def group(row: dict) -> tuple:
    """(category, temperature, batch): the cells one part's rounds time together, each
    method measured against the same autoregressive reference."""
    return row["category"], row["temperature"], row["batch"]


def superseded(parts: list[dict], names: list[str]) -> list[dict]:
    """`parts` with each one's rows (and calibration priors and tree choices) in groups a
    later part also times left out, and the groups it lost in its `superseded` list; a
    part left with no row is refused by name."""
    out, later = [], set()  # later: the groups of the parts after the one at hand
    for name, part in reversed(list(zip(names, parts))):
        rows = [r for r in part["rows"] if group(r) not in later]
        if not rows:
            raise ValueError(f"{name}: later parts time every group it times; leave it out")
        own = {group(r) for r in part["rows"]}
        out.append(dict(part, rows=rows, superseded=[list(g) for g in sorted(own & later)],
                        priors=[x for x in part.get("priors", []) if group(x) not in later],
                        eagle_trees=[x for x in part.get("eagle_trees", [])
                                     if group(x) not in later]))
        later |= own
    return out[::-1]


def merge_results(parts: list[dict], names: list[str] | None = None, *,
                  supersede: bool = False) -> dict:
    """The results dict of one suite run from the dicts of its parts (`suite.suite`'s,
    as `--json` writes them); names: the parts' file names, for errors. supersede: a
    later part's groups replace the earlier parts' (`superseded`) instead of being
    refused as cells timed twice."""
    if not parts:
        raise ValueError("no parts to merge")
    names = names or [f"part {i}" for i in range(len(parts))]
    first = parts[0]["settings"]
    for name, part in zip(names[1:], parts[1:]):
        for key in SAME:
            if part["settings"].get(key) != first.get(key):
                raise ValueError(f"{name}: settings.{key} = {part['settings'].get(key)!r}, "
                                 f"but {names[0]} has {first.get(key)!r}")
    if supersede:
        parts = superseded(parts, names)
    seen = {}
    for name, part in zip(names, parts):
        for r in part["rows"]:
            cell = (*group(r), r["method"])
            if cell in seen:
                raise ValueError(f"{name} and {seen[cell]} both time {cell} (category, "
                                 "temperature, batch, method)")
            seen[cell] = name
    settings = dict(first, **{k: _union(p["settings"][k] for p in parts) for k in UNION})
    settings["batches"] = sorted(settings["batches"])
    prompt_sets, rows = {}, []
    for part in parts:
        prompt_sets.update(part["prompt_sets"])
        rows += part["rows"]
    notes = [p["note"] for p in parts if p.get("note")]
    return dict(parts[0], settings=settings, prompt_sets=prompt_sets,
                date=", ".join(sorted({p["date"] for p in parts})),
                note="; ".join(dict.fromkeys(notes)),
                prompts=[x for p in parts for x in p["prompts"]],
                priors=[x for p in parts for x in p.get("priors", [])],
                eagle_trees=[x for p in parts for x in p.get("eagle_trees", [])],
                parts=[dict(date=p["date"], command=p["command"],
                            superseded=p.get("superseded", [])) for p in parts],
                rows=suite_report.peer_ratios(rows))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.suite_merge",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", help="`specjax bench suite --json` files")
    ap.add_argument("--out", default="docs/benchmarks.md",
                    help="markdown file to write the section into ('' = don't write)")
    ap.add_argument("--figures", default="docs/figures", help="plots directory ('' = none)")
    ap.add_argument("--json", default="", help="also write the merged results here")
    ap.add_argument("--supersede", action="store_true",
                    help="a later part's (category, temperature, batch) groups replace the "
                         "earlier parts' rows there, instead of an error")
    args = ap.parse_args(argv)
    try:
        parts = [json.loads(Path(p).read_text()) for p in args.parts]
        result = merge_results(parts, args.parts, supersede=args.supersede)
    except (OSError, ValueError, KeyError) as e:
        print(f"specjax bench suite_merge: error: {e!r}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "specjax.bench.suite_merge", *argv])
    suite_report.report(result, command, out=args.out, figures=args.figures, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
