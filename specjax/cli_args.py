"""What the command-line tools share: checks on their parsed arguments, and spellings."""

from __future__ import annotations

import argparse

# A vocabulary-size flag's spelling of the whole vocabulary (`--sizes all,8192`): the
# draft's head over every id, as `bench.draft_vocab` and `train.step_time` take it.
ALL = "all"


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """`parser.error` (exit 2) naming the first flag among `names` (argparse dests)
    whose value is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
