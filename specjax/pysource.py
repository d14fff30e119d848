"""Python source documents cut at function boundaries: the pieces the benchmarks'
prompts and the regenerated training text start from (`ast` gives the functions'
lines; the text is cut from the source itself so comments and layout stay)."""

from __future__ import annotations

import ast
import io


def functions(source: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method defined in `source` (nested ones too), in source
    order; [] if it does not parse as Python."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted(found, key=lambda n: n.lineno)


def split_lines(source: str) -> list[str]:
    """Lines as the parser and `tokenize` count them (str.splitlines would also split at
    form feeds and other separators Python source may hold), newlines kept."""
    return io.StringIO(source).readlines()


def source_lines(source: str, first: int, last: int) -> str:
    """Lines first..last (1-based, inclusive) of `source`, each ending in a newline."""
    return "".join(line.rstrip("\n") + "\n"
                   for line in split_lines(source)[first - 1:last])


def docstring_text(source: str, fn) -> str | None:
    """The `def` line(s) and docstring, ending right after the docstring; None if the
    function has no docstring or nothing after it."""
    if ast.get_docstring(fn, clean=False) is None or len(fn.body) < 2:
        return None
    return source_lines(source, fn.lineno, fn.body[0].end_lineno)


def docstring_texts(source: str) -> list[str]:
    """`docstring_text` of every function in `source` that has one, in source order."""
    return [t for fn in functions(source) if (t := docstring_text(source, fn)) is not None]
