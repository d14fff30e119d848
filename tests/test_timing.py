"""Timing side by side: passes split in calls interleave call by call."""

from specjax.timing import balanced_order, side_by_side, side_by_side_calls


def logged(log: list, name: str, calls: int) -> list:
    """`calls` zero-argument calls of pass `name`, each logging (name, j) and returning it."""
    return [lambda j=j: log.append((name, j)) or (name, j) for j in range(calls)]


def test_side_by_side_calls_runs_call_j_of_every_pass_before_any_call_j_plus_1():
    log = []
    passes = {"a": logged(log, "a", 3), "b": logged(log, "b", 3), "c": logged(log, "c", 2)}
    got = side_by_side_calls(passes, 2)
    # each pass's results per round, its calls in order
    assert got == {name: [[(name, j) for j in range(len(calls))]] * 2
                   for name, calls in passes.items()}
    names = list(passes)
    expected = [(names[i], j) for r in range(2) for j in range(3)
                for i in balanced_order(3, r * 3 + j) if j < len(passes[names[i]])]
    assert log == expected
    assert [j for _, j in log[:8]] == [0, 0, 0, 1, 1, 1, 2, 2]  # c has no call 2
    assert {log[i][0] for i in (0, 3, 6, 8, 11, 14)} != {log[0][0]}  # openers vary


def test_side_by_side_is_one_call_per_pass():
    log = []
    passes = {name: logged(log, name, 1)[0] for name in "abcd"}
    got = side_by_side(passes, 3)
    assert got == {name: [(name, 0)] * 3 for name in "abcd"}
    assert [n for n, _ in log] == ["abcd"[i] for r in range(3) for i in balanced_order(4, r)]
