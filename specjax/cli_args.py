"""Checks the command-line tools share on their parsed arguments."""

from __future__ import annotations

import argparse


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """`parser.error` (exit 2) naming the first flag among `names` (argparse dests)
    whose value is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
