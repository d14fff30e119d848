"""Run-directory state: orbax checkpoints of (trainable params, optimizer state) and
the run's identity.

A run's *identity* is a JSON dict of everything that decides its numbers: the method
and its configs, the optimizer and step count, the data (row hash, seed, tokenizer),
and the shape/dtype of every leaf of the train state. It is written to
`<workdir>/config.json` and into every checkpoint. Resuming requires the identity to
match; anything else (another method, other shapes, other data, a directory that is
not ours, a checkpoint that cannot be read) raises `CheckpointError` naming the
directory, before anything in it is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

FORMAT = "specjax.train/1"
CONFIG_FILE = "config.json"


class CheckpointError(RuntimeError):
    """A run directory or checkpoint that this run must not resume from or overwrite."""


def jsonable(tree: Any) -> Any:
    """`tree` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(tree, sort_keys=True, default=str))


def state_signature(abstract_state: Any) -> dict[str, list]:
    """{leaf path: [shape, dtype]} of a (possibly abstract) pytree."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    return {jax.tree_util.keystr(path): [list(x.shape), str(x.dtype)] for path, x in leaves}


def diff(saved: Any, current: Any, prefix: str = "", *,
         names: tuple[str, str] = ("the checkpoint", "this run")) -> list[str]:
    """Human-readable differences between two JSON values (`names`: what each one is)."""
    old, new = names
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in saved:
                out.append(f"{where}: absent in {old}, {current[key]!r} in {new}")
            elif key not in current:
                out.append(f"{where}: {saved[key]!r} in {old}, absent in {new}")
            else:
                out.extend(diff(saved[key], current[key], where, names=names))
        return out
    if saved != current:
        return [f"{prefix or 'value'}: {saved!r} in {old} != {current!r} in {new}"]
    return []


def _mismatch(where: Path, problems: list[str]) -> CheckpointError:
    shown = "\n  ".join(problems[:8]) + (f"\n  ... {len(problems) - 8} more"
                                         if len(problems) > 8 else "")
    return CheckpointError(
        f"{where} belongs to a different run (method, shapes, data or optimizer differ); "
        f"refusing to resume from it or overwrite it. Use a new workdir, or delete it "
        f"yourself.\n  {shown}")


def check_run_config(workdir: Path, identity: dict[str, Any]) -> bool:
    """Raises if `workdir/config.json` names another run; True if it exists (and matches)."""
    path = workdir / CONFIG_FILE
    if not path.exists():
        return False
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); refusing to reuse "
                              f"{workdir}") from e
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by specjax train/ (no "
                              f"format={FORMAT!r}); refusing to reuse {workdir}")
    problems = diff(saved.get("identity"), jsonable(identity))
    if problems:
        raise _mismatch(path, problems)
    return True


def write_run_config(workdir: Path, identity: dict[str, Any], extra: dict[str, Any]) -> None:
    """Writes `workdir/config.json`: the identity plus informational settings (`extra`)."""
    record = {"format": FORMAT, "identity": jsonable(identity), "settings": jsonable(extra)}
    tmp = workdir / f".{CONFIG_FILE}.tmp"  # atomic: another host may be reading it
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, workdir / CONFIG_FILE)


def _is_orbax_entry(name: str) -> bool:
    return name.isdigit() or "orbax-checkpoint-tmp" in name


class RunCheckpoints:
    """orbax `CheckpointManager` over one directory, with identity checks on restore."""

    def __init__(self, directory: str | Path, identity: dict[str, Any], *, keep: int = 3):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.identity = jsonable(identity)
        if self.directory.exists():
            if not self.directory.is_dir():
                raise CheckpointError(f"checkpoint directory {self.directory} is a file")
            foreign = sorted(p.name for p in self.directory.iterdir()
                             if not _is_orbax_entry(p.name))
            if foreign:
                raise CheckpointError(
                    f"{self.directory} is not a specjax checkpoint directory (unexpected "
                    f"entries {foreign[:5]}); refusing to write into it")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=True)
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state saved at `step`, after checking it was written by this same run."""
        ocp = self._ocp
        where = self.directory / str(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # orbax raises KeyError/ValueError/OSError variously
            raise CheckpointError(f"{where}: unreadable checkpoint metadata ({e!r}); it was "
                                  f"not written by specjax train/ or is corrupt") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a specjax train/ checkpoint "
                                  f"(metadata {str(meta)[:200]})")
        problems = diff(meta.get("identity"), self.identity)
        if problems:
            raise _mismatch(where, problems)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state))).state
        except Exception as e:
            raise CheckpointError(f"{where}: cannot restore the train state ({e!r}); the "
                                  f"checkpoint is corrupt") from e

    def save(self, step: int, state: Any) -> None:
        ocp = self._ocp
        meta = {"format": FORMAT, "step": step, "identity": self.identity}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
