"""``rollcage supervise``'s budget flags are made from the budgets' model, spelled as ``rollcage run``'s.

The command is driven in this process through typer's runner, with the supervisor's entry point
replaced by one that keeps the validated configuration and stops there.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from rollcage.budgets import BudgetSettings
from rollcage.commands import supervise
from rollcage.commands.run import run_options
from rollcage.controller import RunConfig
from rollcage.supervisor import SupervisorConfig


class _Kept(Exception):
    """Raised by the stand-in supervisor with the configuration it was given."""

    def __init__(self, config: SupervisorConfig) -> None:
        super().__init__("kept")
        self.config = config


def _invoke(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, SupervisorConfig | None]:
    import rollcage.supervisor

    async def keep(rollout_dir: Path, config: SupervisorConfig, **_: Any) -> None:
        raise _Kept(config)

    monkeypatch.setattr(rollcage.supervisor, "supervise", keep)
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(supervise.build_command())
    result = CliRunner().invoke(app, list(args))
    kept = result.exception.config if isinstance(result.exception, _Kept) else None
    return result, kept


def _flags_of(command: Any) -> set[str]:
    app = typer.Typer(add_completion=False)
    app.command()(command)
    return {opt for param in typer.main.get_command(app).params for opt in param.opts}


def test_every_budget_of_the_model_is_a_flag_of_supervise_spelled_as_runs() -> None:
    fields, _ = run_options(RunConfig)
    run_flag = {option.path[1]: option.flag for option in fields if option.path[0] == "bwrap"}
    supervise_flags = _flags_of(supervise.build_command())
    missing = [
        f"{name} ({run_flag[name]})"
        for name in BudgetSettings.model_fields
        if run_flag[name] not in supervise_flags
    ]
    assert missing == []


def _other_value(name: str) -> tuple[str, Any]:
    """A valid value of the budget ``name`` that is not its default: as typed on the command line, and
    as the model holds it."""
    field = BudgetSettings.model_fields[name]
    default = field.default
    kind = typing.get_args(field.annotation) or (field.annotation,)
    if isinstance(default, bool):
        return ("no" if default else "yes"), not default
    if typing.get_origin(field.annotation) is typing.Literal:
        other = next(choice for choice in typing.get_args(field.annotation) if choice != default)
        return other, other
    if isinstance(default, float):
        return str(default * 2), default * 2
    assert int in kind and isinstance(default, int), name
    if name.endswith("_bytes"):
        return f"{default * 2 >> 20}M", default * 2
    return str(default * 2), default * 2


@pytest.mark.parametrize("name", sorted(BudgetSettings.model_fields))
def test_each_budget_flag_lands_in_the_supervisors_config(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    option = next(option for option in supervise.sandbox_options() if option.path == ("sandbox", name))
    typed, value = _other_value(name)
    if typed in ("yes", "no"):
        args = [option.flag if value else f"--no-{option.flag.removeprefix('--')}"]
    else:
        args = [option.flag, typed]
    result, config = _invoke(monkeypatch, str(tmp_path), *args)
    assert config is not None, result.output
    assert getattr(config.sandbox, name) == value
    left_out = BudgetSettings()
    for other in BudgetSettings.model_fields:
        if other != name:
            assert getattr(config.sandbox, other) == getattr(left_out, other)  # the model's defaults hold


def test_a_budget_the_model_refuses_names_its_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result, config = _invoke(monkeypatch, str(tmp_path), "--max-processes", "2", "--tmp-budget", "1K")
    assert config is None and result.exit_code == 2
    assert "--max-processes:" in result.output and "--tmp-budget:" in result.output
