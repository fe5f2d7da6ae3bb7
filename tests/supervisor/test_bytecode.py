"""The worker's compiled bytecode cache: used by the worker, mounted read-only, never stale, never foreign."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.supervisor import BwrapSandbox, RolloutLayout, default_worker_command
from rollcage.supervisor.bytecode import prime_bytecode
from rollcage.supervisor.sandbox import BwrapLauncher, BwrapTools

TOOLS = BwrapTools(
    bwrap="/usr/bin/bwrap", prlimit="/usr/bin/prlimit", setpriv="/usr/bin/setpriv", disable_userns=True
)


def _loaded_from(cache: Path, code: str, *, path: Path | None = None) -> tuple[str, str]:
    """Run ``code`` as the worker's interpreter does (``-I -B``, the cache); its stdout and ``-v`` log."""
    prefix = default_worker_command(str(cache))[:-3]  # python -I -B -X pycache_prefix=CACHE
    setup = f"import sys; sys.path.insert(0, {str(path)!r}); " if path is not None else ""
    done = subprocess.run(
        [*prefix, "-v", "-c", setup + code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout, done.stderr


def test_the_worker_interpreter_reads_rollcage_from_the_primed_cache(tmp_path: Path) -> None:
    cache = prime_bytecode(tmp_path / "cache", ["rollcage.worker", "rollcage.model"])
    _, log = _loaded_from(cache, "import rollcage.worker, rollcage.model")
    import rollcage.worker

    source = os.path.realpath(rollcage.worker.__file__)
    compiled = f"{cache}{os.path.dirname(source)}/worker.{sys.implementation.cache_tag}.pyc"
    assert f"code object from '{compiled}'" in log
    # The whole package is compiled, not only what the priming imported (lazy imports).
    assert Path(
        f"{cache}{os.path.dirname(source)}/viewer/_report.{sys.implementation.cache_tag}.pyc"
    ).is_file()


def test_a_changed_source_is_never_run_from_old_bytecode_and_is_compiled_again(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    module = src / "stalemod.py"
    module.write_text("X = 1\n")
    cache = prime_bytecode(tmp_path / "cache", ["stalemod"], paths=[str(src)])
    compiled = Path(f"{cache}{os.path.realpath(src)}/stalemod.{sys.implementation.cache_tag}.pyc")
    out, log = _loaded_from(cache, "import stalemod; print(stalemod.X)", path=src)
    assert out.strip() == "1" and f"code object from '{compiled}'" in log

    module.write_text("X = 222\n")  # another size: the recorded one no longer matches
    out, _ = _loaded_from(cache, "import stalemod; print(stalemod.X)", path=src)
    assert out.strip() == "222"
    assert int.from_bytes(compiled.read_bytes()[12:16], "little") == len("X = 1\n")

    prime_bytecode(tmp_path / "cache", ["stalemod"], paths=[str(src)])  # the fingerprint changed
    assert int.from_bytes(compiled.read_bytes()[12:16], "little") == len("X = 222\n")
    out, log = _loaded_from(cache, "import stalemod; print(stalemod.X)", path=src)
    assert out.strip() == "222" and f"code object from '{compiled}'" in log


def test_a_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.raises(OSError, match="only this user can write"):
        prime_bytecode(cache, ["json"])


def test_the_sandbox_mounts_the_cache_read_only(tmp_path: Path) -> None:
    cache = str(prime_bytecode(tmp_path / "cache", ["json"]))
    launcher = BwrapLauncher(BwrapSandbox(executor_cage="shared"))
    launcher._tools = TOOLS  # the command line only: no bubblewrap is run
    plan = launcher.plan(
        RolloutLayout(tmp_path / "r"),
        worker_command=default_worker_command(cache),
        worker_env={},
        token_env={},
        extra_ro=[cache],
    )
    argv = plan.argv
    binds = [i for i in range(len(argv) - 2) if argv[i : i + 3] == ["--ro-bind", cache, cache]]
    assert binds
    # After the sandbox's /tmp (where the test's cache lives) is made, or that tmpfs would hide it.
    tmpfs = [i for i in range(len(argv) - 1) if argv[i : i + 2] == ["--tmpfs", "/tmp"]]
    assert tmpfs and binds[-1] > tmpfs[-1]
    assert f"pycache_prefix={cache}" in plan.argv
