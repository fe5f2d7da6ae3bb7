"""``rollcage run DATASET``: the main job — run a dataset of tasks, grade, report.

Exit codes: 0 the run finished (whatever the rewards); 1 the controller failed
(e.g. rollouts.jsonl could not be written); 2 bad command line, dataset or
configuration (nothing ran); 3 every sample that ended, ended in
``infra_failure`` (the setup is broken, not the policy); 130 interrupted by
Ctrl-C/SIGTERM (rerun the same command to resume).

The options are made from :class:`rollcage.controller.RunConfig`
(:mod:`rollcage.commands._config_options`): a field added there is an option here
(``image`` -> ``--image``) without a line in this module. What is spelled by hand
is the small table below: the fields that are unions of models (the model, the
backend, the harness), flags that keep an older spelling or unit, and ``--quiet``.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollcage.commands import fail
from rollcage.commands._config_options import (
    FieldOption,
    Spelling,
    describe_errors,
    field_options,
    given_values,
)
from rollcage.commands._sandbox_options import FLAG_OF_FIELD

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rollcage.commands._progress import RichReporter
    from rollcage.controller import RunConfig, RunSummary

__all__ = ["SPELLED_BY_HAND", "build_command", "command", "run_options", "tune_collector"]

_MIB = 1 << 20
_SANDBOX_PANEL = "Sandbox (with --sandbox bwrap)"
_RAY_PANEL = "Ray (with --backend ray)"

SPELLED_BY_HAND: dict[tuple[str, ...], str] = {
    ("dataset",): "the DATASET argument",
    (
        "model",
    ): "a union of models: --model, --model-name, --api-key-env (an endpoint) or --policy (embedded)",
    ("backend",): "a union of models: --backend picks one; the Ray backend's fields are the --ray-* options",
    ("backend", "type"): "the backend's tag: --backend",
    ("harness",): "a union of models: --harness, --harness-command, --harness-task, --harness-answer",
    ("bwrap", "type"): "the sandbox's tag: --sandbox",
    (
        "bwrap",
        "system_paths",
    ): "a list of host paths: set in code (rollcage.collect), not on the command line",
    (
        "bwrap",
        "extra_ro_paths",
    ): "a list of host paths: set in code (rollcage.collect), not on the command line",
}
"""``RunConfig`` fields (by path) the generated options leave out, each with where it is spelled, or why."""

_SPELLINGS: dict[tuple[str, ...], Spelling] = {
    ("out",): Spelling(help="Output directory; default runs/<dataset-name>-<UTC time>/."),
    ("dataset_format",): Spelling("--format"),
    ("max_capture_bytes",): Spelling("--max-capture-mib", unit=_MIB, unit_name="MiB", minimum=1),
    ("bwrap", "bwrap_path"): Spelling("--bwrap-path"),
    **{("bwrap", field): Spelling(flag) for field, flag in FLAG_OF_FIELD.items()},
    ("backend", "shared_dir"): Spelling("--shared-dir"),
    ("backend", "max_artifact_bytes"): Spelling(
        "--ray-max-artifact-mib", unit=_MIB, unit_name="MiB", minimum=1
    ),
}
"""Flags that keep a spelling (or unit) of their own: scripts and docs use them."""


class _Backend(enum.StrEnum):
    local = "local"
    ray = "ray"


class _Harness(enum.StrEnum):
    builtin = "builtin"
    nooa = "nooa"
    command = "command"


class _TaskVia(enum.StrEnum):
    stdin = "stdin"
    argv = "argv"
    file = "file"


class _AnswerFrom(enum.StrEnum):
    stdout = "stdout"
    file = "file"
    events = "events"


def _by_hand() -> list[inspect.Parameter]:
    """The options that are not one field each (the unions of models, ``--quiet``), in typer's form."""

    def option(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)

    opt = typer.Option
    return [
        inspect.Parameter(
            "dataset",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Annotated[Path, typer.Argument(help="JSONL dataset, one task a line.")],
        ),
        option(
            "model",
            Annotated[
                str | None, opt(help="OpenAI-compatible base URL ending in /v1; default: embedded policy.")
            ],
        ),
        option("model_name", Annotated[str | None, opt(help="Model name (with --model).")]),
        option(
            "api_key_env",
            Annotated[str | None, opt(help="Environment variable with the API key (never written to disk).")],
        ),
        option("policy", Annotated[Path | None, opt(help="Policy script for the embedded scripted policy.")]),
        option(
            "backend",
            Annotated[
                _Backend, opt(help="Where rollouts run: this machine, or a Ray cluster (rollcage[ray]).")
            ],
            _Backend.local,
        ),
        option(
            "harness",
            Annotated[
                _Harness | None,
                opt(
                    help="Agent of rows that name none: builtin (default), nooa, "
                    "or command (--harness-command)."
                ),
            ],
        ),
        option(
            "harness_command",
            Annotated[
                str | None,
                opt(help="With --harness command: the command line (shell words), run in the workspace."),
            ],
        ),
        option(
            "harness_task",
            Annotated[
                _TaskVia,
                opt(help="With --harness command: the task on stdin, as one more argument, or a file."),
            ],
            _TaskVia.stdin,
        ),
        option(
            "harness_answer",
            Annotated[
                _AnswerFrom,
                opt(
                    help="With --harness command: the answer is its stdout, answer.txt, or an 'answer' event."
                ),
            ],
            _AnswerFrom.stdout,
        ),
        option("quiet", Annotated[bool, opt(help="No progress bar.")], False),
    ]


def run_options(config: type[BaseModel]) -> tuple[list[FieldOption], list[FieldOption]]:
    """The generated options of ``config`` (a ``RunConfig``, or a subclass), and those of its Ray backend.

    Raises:
        TypeError: A field has no command-line form and is not in :data:`SPELLED_BY_HAND`.
    """
    from rollcage.controller import RayBackendConfig

    fields = field_options(
        config,
        spellings=_SPELLINGS,
        spelled_by_command=SPELLED_BY_HAND,
        panels={("bwrap",): _SANDBOX_PANEL},
    )
    ray = field_options(
        RayBackendConfig,
        spellings=_SPELLINGS,
        spelled_by_command=SPELLED_BY_HAND,
        prefix="ray-",
        path=("backend",),
        tag="ray",
        panels={("backend",): _RAY_PANEL},
    )
    return fields, ray


def build_command(
    config: type[RunConfig] | None = None, *, start: Callable[[RunConfig, bool], None] | None = None
) -> Callable[..., None]:
    """The ``rollcage run`` command for ``config`` (``RunConfig``; a subclass adds its fields as options).

    Args:
        config: The run's configuration model.
        start: What runs the validated configuration (and ``--quiet``); default: the run itself.
    """
    from rollcage.controller import RunConfig

    model = config or RunConfig
    fields, ray = run_options(model)

    def command(**given: Any) -> None:
        _start = start or _start_run
        _start(_config(model, fields, ray, given), bool(given["quiet"]))

    params = _by_hand()
    taken = {param.name for param in params}
    for option in [*fields, *ray]:
        if option.param in taken:
            raise TypeError(f"{option.flag} is spelled twice: rename the field or spell it in the table")
        taken.add(option.param)
        params.append(
            inspect.Parameter(
                option.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option.annotation
            )
        )
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = "Run a dataset of tasks in sandboxes, grade outside them, and report."
    return command


def _config(
    model: type[RunConfig], fields: list[FieldOption], ray: list[FieldOption], given: dict[str, Any]
) -> RunConfig:
    """The validated run configuration from the command line, every error naming its option."""
    from pydantic import ValidationError

    _refuse_misplaced(fields, ray, given)
    values = given_values(fields, given)
    backend = given["backend"]
    values["backend"] = {"type": backend.value, **given_values(ray, given).get("backend", {})}
    values["model"] = _model_source(given)
    values["harness"] = _harness_spec(
        given["harness"], given["harness_command"], given["harness_task"], given["harness_answer"]
    )
    dataset: Path = given["dataset"]
    values["dataset"] = dataset
    values.setdefault("out", _default_out(dataset))
    flags = {option.loc: option.flag for option in [*fields, *ray]}
    flags |= {
        ("model", "endpoint", "base_url"): "--model",
        ("model", "endpoint", "model_name"): "--model-name",
        ("model", "endpoint", "api_key_env"): "--api-key-env",
        ("model", "embedded", "script"): "--policy",
    }
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise typer.BadParameter(describe_errors(exc, flags)) from exc


def _refuse_misplaced(fields: list[FieldOption], ray: list[FieldOption], given: dict[str, Any]) -> None:
    """Refuse options that the rest of the command line makes meaningless (they would be ignored)."""
    sandbox = given.get("sandbox")
    for option in fields:
        if (
            option.path[0] == "bwrap"
            and option.path != ("bwrap", "worker_start")  # --sandbox none starts warm or cold too
            and given.get(option.param) is not None
            and sandbox not in (None, "bwrap")
        ):
            why = f"{option.flag} needs --sandbox bwrap: with --sandbox {sandbox} no budget is enforced"
            raise typer.BadParameter(why, param_hint=option.flag)
    for option in ray:
        if given.get(option.param) is not None and given["backend"] is not _Backend.ray:
            raise typer.BadParameter(f"{option.flag} needs --backend ray", param_hint=option.flag)


def _model_source(given: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` field from --model, --model-name, --api-key-env or --policy."""
    model, name, key, policy = given["model"], given["model_name"], given["api_key_env"], given["policy"]
    if (model is None) != (name is None):
        raise typer.BadParameter("--model and --model-name go together", param_hint="--model")
    if model is not None and policy is not None:
        raise typer.BadParameter(
            "--policy is for the embedded policy; drop it with --model", param_hint="--policy"
        )
    if key is not None and model is None:
        raise typer.BadParameter("--api-key-env needs --model", param_hint="--api-key-env")
    if model is not None:
        return {"type": "endpoint", "base_url": model, "model_name": name, "api_key_env": key}
    return {"type": "embedded", "script": policy}


def _start_run(config: RunConfig, quiet: bool) -> None:
    """Run ``config`` with a progress bar (unless ``quiet``), print the summary, exit with its code."""
    import asyncio

    from rollcage.commands._progress import RichReporter, render_summary
    from rollcage.controller import EXIT_USAGE
    from rollcage.errors import ConfigError

    reporter = RichReporter(quiet=quiet)
    _log_through(reporter)
    tune_collector()
    try:
        summary = asyncio.run(_run(config, reporter))
    except ConfigError as exc:
        fail("run", str(exc), code=EXIT_USAGE)
    render_summary(summary, reporter.console)
    raise typer.Exit(summary.exit_code)


_GENERIC_STEMS = frozenset({"dataset", "data", "train", "test", "eval", "tasks"})


def _default_out(dataset: Path) -> Path:
    import time

    stem = dataset.stem
    name = dataset.resolve().parent.name if stem in _GENERIC_STEMS else stem
    return Path("runs") / f"{name or stem}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


command = build_command()
"""``rollcage run``, as typer registers it."""


def tune_collector() -> None:
    """Set this process's garbage collector for a controller's run (``rollcage run`` calls it first).

    What start-up built (modules, models: ~46k tracked objects) lives as long as the run: frozen, out
    of every collection (time in the collector 1.0 -> 0.77 ms a rollout, instant model, C=8). The
    thresholds stay Python's: collecting the young generation every 10,000 allocations instead of 700
    saved another 0.4 ms a rollout but let cyclic garbage pile up between full collections, and the
    controller's peak RSS at 10k tasks grew to 1.30x of 1k (``bench/controller.py``; target 1.2x).
    """
    import gc

    gc.collect()
    gc.freeze()


def _harness_spec(harness: _Harness | None, command: str | None, task: _TaskVia, answer: _AnswerFrom) -> Any:
    """The run's harness from its flags (``None``: rows decide, builtin by default)."""
    import shlex

    from rollcage.protocol import BuiltinHarness, CommandHarness, NooaHarness

    if command is not None and harness not in (None, _Harness.command):
        raise typer.BadParameter(
            "--harness-command goes with --harness command", param_hint="--harness-command"
        )
    if harness is _Harness.command or command is not None:
        try:
            argv = shlex.split(command or "")
        except ValueError as exc:
            raise typer.BadParameter(f"not shell words: {exc}", param_hint="--harness-command") from exc
        if not argv:
            raise typer.BadParameter("--harness command needs --harness-command CMD", param_hint="--harness")
        return CommandHarness(type="command", argv=argv, task=task.value, answer=answer.value)
    if harness is _Harness.nooa:
        return NooaHarness(type="nooa")
    if harness is _Harness.builtin:
        return BuiltinHarness()
    return None


def _log_through(reporter: RichReporter) -> None:
    """Send warnings through the reporter's console (above the live bar), each distinct one once.

    A run of thousands of rollouts would otherwise repeat the same per-rollout
    warning (e.g. the supervisor's "sandbox disabled") thousands of times.
    """
    import logging

    from rich.logging import RichHandler

    seen: set[str] = set()

    def once(record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.getMessage()}"
        if key in seen:
            return False
        if len(seen) < 10_000:
            seen.add(key)
        return True

    handler = RichHandler(console=reporter.console, show_time=False, show_path=False, markup=False)
    handler.addFilter(once)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", handlers=[handler], force=True)


async def _run(config: RunConfig, reporter: RichReporter) -> RunSummary:
    """Collect the dataset's rollouts (``rollcage.collect``) with Ctrl-C/SIGTERM handling; return the summary.

    The records are shown by the reporter as they land. First signal: stop
    gracefully (in-flight rollouts stopped through their supervisors and recorded
    as cancelled). Second: cancel at once (records on disk stay consistent;
    abandoned rollouts rerun on resume). A third falls through to the default handler.

    **Cancellation:** see above; the summary is returned either way.
    """
    import asyncio
    import signal

    from rollcage.controller import Collection
    from rollcage.errors import ConfigError, RunFailedError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    collection = Collection(config, reporter=reporter, stop=stop)
    presses = 0

    async def guarded() -> RunSummary | ConfigError:
        # A ConfigError is returned, not raised, so it does not come out of the task
        # group wrapped in an ExceptionGroup; it is raised again below.
        try:
            async for _ in collection:
                pass  # each record is on disk, and on screen through the reporter, as it lands
        except ConfigError as exc:
            return exc
        except RunFailedError:
            pass  # the summary says why (exit code 1)
        return collection.summary()

    async with asyncio.TaskGroup() as group:
        job = group.create_task(guarded())

        def on_signal(name: str) -> None:
            nonlocal presses
            presses += 1
            if presses == 1:
                reporter.notice(
                    f"{name}: stopping; in-flight rollouts are being stopped (again to stop at once)"
                )
                stop.set()
                return
            reporter.notice(f"{name}: stopping at once")
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            job.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        try:
            await asyncio.wait([job])
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    if job.cancelled():
        return collection.summary(interrupted=True)
    outcome = job.result()
    if isinstance(outcome, ConfigError):
        raise outcome
    return outcome
