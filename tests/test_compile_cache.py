"""jax's persistent compilation cache as the command lines turn it on
(`specjax.compile_cache`, `specjax --compilation-cache`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from specjax import cli, compile_cache

_KEYS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
         "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(autouse=True)
def _restore_jax_config(monkeypatch, tmp_path):
    """jax's config is process-wide and later tests share this worker: put it back. Also
    no user setting leaks in, and the default location is under tmp_path."""
    for var in (compile_cache.ENV, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    before = {k: getattr(jax.config, k) for k in _KEYS}
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for k, v in before.items():
        jax.config.update(k, v)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def test_default_is_under_xdg_cache_home(tmp_path):
    d = compile_cache.enable()
    assert d == tmp_path / "xdg" / "specjax" / "jax" and d.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(d)
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    assert threshold == compile_cache.MIN_COMPILE_TIME_SECS
    assert compile_cache.enable() == d  # idempotent


def test_argument_beats_env_beats_jax_setting(tmp_path, monkeypatch):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert compile_cache.enable() == tmp_path / "jax"  # JAX_COMPILATION_CACHE_DIR kept
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.enable() == tmp_path / "env"
    assert compile_cache.enable(tmp_path / "arg") == tmp_path / "arg"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "arg")
    monkeypatch.setenv(compile_cache.ENV, "")  # empty: unset
    assert compile_cache.resolve() == (tmp_path / "arg", "jax")


def test_off(tmp_path, monkeypatch):
    compile_cache.enable(tmp_path / "c")
    assert compile_cache.enable("off") is None
    assert not jax.config.jax_enable_compilation_cache
    assert compile_cache.enable() is None  # stays off until a directory is named
    assert compile_cache.enable(tmp_path / "c") == tmp_path / "c"
    assert jax.config.jax_enable_compilation_cache
    monkeypatch.setenv(compile_cache.ENV, "OFF")
    assert compile_cache.enable() is None


def test_a_file_is_an_error_naming_it(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="file.*not a directory"):
        compile_cache.enable(f)
    monkeypatch.setenv(compile_cache.ENV, str(f))
    with pytest.raises(ValueError, match="SPECJAX_COMPILATION_CACHE=.*file"):
        compile_cache.enable()
    with pytest.raises(ValueError, match="JAX_COMPILATION_CACHE_DIR"):
        compile_cache.enable("gs://bucket/cache")  # not made into a local ./gs:/ directory
    assert jax.config.jax_compilation_cache_dir is None  # nothing changed


@pytest.mark.parametrize("before", [True, False])
def test_cli_flag(tmp_path, monkeypatch, capsys, before):
    seen = []
    monkeypatch.setattr(cli.cli_generate, "main", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(cli, "_bench", lambda args, rest: seen.append(rest) or 0)

    def run(value, *cmd):
        flag = ["--compilation-cache", str(value)]
        return cli.main(flag + list(cmd) if before else list(cmd) + flag)

    assert run(tmp_path / "c", "generate") == 0
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert run("off", "generate") == 0
    assert not jax.config.jax_enable_compilation_cache
    assert run(tmp_path / "b", "bench", "suite") == 0
    assert seen[-1] == []  # the option is not passed on to the benchmark's own parser
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "b")
    (tmp_path / "f").write_text("")
    assert run(tmp_path / "f", "generate") == 2
    assert str(tmp_path / "f") in capsys.readouterr().err


_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
import specjax
library = jax.config.jax_compilation_cache_dir  # importing specjax turns nothing on
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("/cache_hits") else None)
d = specjax.compile_cache.enable()
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) + 1)(jnp.ones((16, 16)))
y.block_until_ready()
print(json.dumps({"library": library, "dir": str(d), "hits": len(hits)}))
"""


def test_a_second_process_reads_what_the_first_wrote(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    # a tiny program compiles in milliseconds: cache it anyway
    env.update({compile_cache.ENV: str(cache), "JAX_PLATFORMS": "cpu",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})

    def run():
        out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).parent.parent)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first == {"library": None, "dir": str(cache), "hits": 0}
    entries = sorted(p.name for p in cache.iterdir())
    assert entries
    second = run()
    assert second["hits"] >= 1
    assert sorted(p.name for p in cache.iterdir()) == entries
