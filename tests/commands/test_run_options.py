"""``rollcage run``'s options are made from ``RunConfig``: every field reachable, a new field an option.

The command is built in this process (``build_command``) with a ``start`` that keeps the
validated configuration instead of running it, and driven through typer's runner.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from rollcage.commands.run import SPELLED_BY_HAND, build_command, run_options
from rollcage.controller import RayBackendConfig, RunConfig

FLAGS_IN_USE = (
    "--out --model --model-name --api-key-env --api --policy --concurrency --attempts --deadline --grace "
    "--max-infra-retries --retry-backoff --sandbox --memory-budget --max-processes --workspace-budget "
    "--workspace-inodes --tmp-budget --tmp-inodes --shm-budget --shm-inodes --cgroups --disk-budgets "
    "--require-budgets --executor-cage --worker-start --backend --ray-address --ray-num-cpus-per-rollout "
    "--shared-dir --ray-max-artifact-mib --max-capture-mib --strict --format --environment --harness "
    "--harness-command --harness-task --harness-answer --harness-env --grade-timeouts --resume-rollouts "
    "--quiet"
).split()
"""Every flag ``rollcage run`` had before its options were generated: scripts and docs use them."""


def _leaves(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        where = (*path, name)
        kind = field.annotation
        if where not in SPELLED_BY_HAND and isinstance(kind, type) and issubclass(kind, BaseModel):
            found += _leaves(kind, where)
        else:
            found.append(where)
    return found


def _invoke(config: type[RunConfig], *args: str) -> tuple[Any, list[RunConfig]]:
    started: list[RunConfig] = []
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(build_command(config, start=lambda cfg, quiet: started.append(cfg)))
    return CliRunner().invoke(app, list(args)), started


def test_every_run_config_field_is_an_option_or_spelled_by_hand_with_a_reason() -> None:
    fields, ray = run_options(RunConfig)
    reachable = {option.path for option in [*fields, *ray]} | set(SPELLED_BY_HAND)
    missing = [path for path in _leaves(RunConfig) if path not in reachable]
    missing += [path for path in _leaves(RayBackendConfig, ("backend",)) if path not in reachable]
    assert missing == []
    assert all(reason.strip() for reason in SPELLED_BY_HAND.values())


def test_every_flag_in_use_is_still_an_option(tmp_path: Path) -> None:
    result, _ = _invoke(RunConfig, "--help")
    assert result.exit_code == 0, result.output
    command = typer.main.get_command(_app())
    flags = {flag for param in command.params for flag in [*param.opts, *param.secondary_opts]}
    assert sorted(set(FLAGS_IN_USE) - flags) == []


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(build_command())
    return app


class _WithMore(RunConfig):
    site_label: str | None = Field(default=None, description="The label of rows that name none.")
    tries: int = Field(default=3, ge=1, description="A bounded count.")


def test_a_field_added_to_the_config_is_an_option_without_touching_the_command(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    result, started = _invoke(
        _WithMore, str(dataset), "--out", str(tmp_path / "o"), "--site-label", "h/n:1", "--tries", "5"
    )
    assert result.exit_code == 0, result.output
    [config] = started
    assert isinstance(config, _WithMore)
    assert (config.site_label, config.tries) == ("h/n:1", 5)
    shown, _ = _invoke(_WithMore, "--help")
    assert "--site-label" in shown.output and "The label of rows" in shown.output


def test_an_invalid_value_names_its_option_not_the_field_path(tmp_path: Path) -> None:
    dataset = str(tmp_path / "d.jsonl")
    for args, flag in [
        (("--tries", "0"), "--tries:"),
        (("--concurrency", "0"), "--concurrency:"),
        (("--memory-budget", "1M"), "--memory-budget:"),
        (("--bwrap-budget-poll", "nan"), "--bwrap-budget-poll:"),
        (("--backend", "ray", "--ray-num-cpus-per-rollout", "-1"), "--ray-num-cpus-per-rollout:"),
        (("--model", "not a url", "--model-name", "m"), "--model:"),
    ]:
        result, started = _invoke(_WithMore, dataset, *args)
        assert result.exit_code == 2 and started == [], result.output
        assert flag in result.output, (args, result.output)
        assert "bwrap." not in result.output and "field '" not in result.output


def test_options_left_out_keep_the_configs_defaults_and_given_ones_override(tmp_path: Path) -> None:
    dataset, out = tmp_path / "d.jsonl", tmp_path / "o"
    result, started = _invoke(RunConfig, str(dataset), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert started[0] == RunConfig(dataset=dataset, out=out)
    result, started = _invoke(
        RunConfig,
        str(dataset),
        "--out",
        str(out),
        "--deadline",
        "7",
        "--memory-budget",
        "512M",
        "--bwrap-open-files",
        "99",
        "--no-strict",
        "--backend",
        "ray",
        "--ray-max-artifact-mib",
        "2",
        "--shared-dir",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    config = started[0]
    assert (config.deadline_s, config.bwrap.memory_bytes, config.bwrap.open_files) == (7.0, 512 << 20, 99)
    assert config.bwrap.tmp_inodes == RunConfig(out=out).bwrap.tmp_inodes
    assert isinstance(config.backend, RayBackendConfig)
    assert (config.backend.max_artifact_bytes, config.backend.shared_dir) == (2 << 20, tmp_path)


def test_a_field_with_no_command_line_form_must_be_spelled_or_excluded() -> None:
    class WithList(RunConfig):
        tags: list[str] = Field(default_factory=list)

    with pytest.raises(TypeError, match=r"WithList\.tags"):
        build_command(WithList)


def test_other_verbs_do_not_pay_for_runs_options() -> None:
    # run's options are made from RunConfig, which imports the controller: half a second of every
    # other verb's start if they were made for it too.
    script = (
        "import sys, contextlib, io\n"
        "from rollcage.cli import _dispatch\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = _dispatch(['schema', '--help'])\n"
        "print(code, 'rollcage.controller' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.split() == ["0", "False"], done.stdout + done.stderr
