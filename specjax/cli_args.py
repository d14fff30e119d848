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


# what a conversion's values are called in `comma_list`'s error
_KINDS = {int: "integers", float: "numbers"}


def comma_list(ap: argparse.ArgumentParser, flag: str, text: str, convert=str, *,
               choices=None, minimum=None) -> list:
    """A comma-separated flag's values, in order, each converted by `convert`;
    `ap.error` (exit 2) naming the flag and its value where none is given, one does not
    convert, is not among `choices` or is below `minimum`."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        ap.error(f"{flag}={text!r}: give at least one value")
    try:
        values = [convert(p) for p in parts]
    except ValueError:
        ap.error(f"{flag}={text!r} must be comma-separated {_KINDS.get(convert, 'values')}")
    if choices is not None:
        bad = [v for v in values if v not in choices]
        if bad:
            ap.error(f"{flag}={text!r}: unknown {bad}; choose from "
                     f"{','.join(map(str, choices))}")
    if minimum is not None and min(values) < minimum:
        ap.error(f"{flag}={text!r}: every value must be >= {minimum}")
    return values


def parse_tree(flag: str, text: str) -> tuple[int, int, int]:
    """An EAGLE dynamic tree's TOP_K,DEPTH,NODES from a flag's text; a ValueError naming
    the flag and value where it is not three integers >= 1, or no such tree exists
    (`eagle.check_tree`)."""
    from specjax.speculators.eagle import check_tree

    try:
        tree = tuple(int(p) for p in text.split(","))
    except ValueError:
        tree = ()
    if len(tree) != 3 or min(tree) < 1:
        raise ValueError(f"{flag}={text!r} must be TOP_K,DEPTH,NODES: three integers >= 1")
    try:
        check_tree(None, *tree)
    except ValueError as e:
        raise ValueError(f"{flag}={text!r}: {e}") from e
    return tree


def tree_arg(ap: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, int, int]:
    """`parse_tree`, its error through `ap.error` (exit 2)."""
    try:
        return parse_tree(flag, text)
    except ValueError as e:
        ap.error(str(e))
