"""``rollcage run DATASET``: the main job — run a dataset of tasks, grade, report.

Exit codes: 0 the run finished (whatever the rewards); 1 the controller failed
(e.g. rollouts.jsonl could not be written); 2 bad command line, dataset or
configuration (nothing ran); 3 every sample that ended, ended in
``infra_failure`` (the setup is broken, not the policy); 130 interrupted by
Ctrl-C/SIGTERM (rerun the same command to resume).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollcage.commands import fail, finite
from rollcage.commands._sandbox_options import (
    Cgroups,
    DiskBudgets,
    ExecutorCage,
    MaxProcesses,
    MemoryBudget,
    RequireBudgets,
    ShmBudget,
    ShmInodes,
    TmpBudget,
    TmpInodes,
    WorkerStart,
    WorkspaceBudget,
    WorkspaceInodes,
    bwrap_fields,
)

if TYPE_CHECKING:
    from rollcage.commands._progress import RichReporter
    from rollcage.controller import RunConfig, RunSummary
    from rollcage.errors import ConfigError

__all__ = ["command", "tune_collector"]


class _Sandbox(enum.StrEnum):
    bwrap = "bwrap"
    none = "none"


class _Backend(enum.StrEnum):
    local = "local"
    ray = "ray"


class _Api(enum.StrEnum):
    chat = "chat"
    responses = "responses"


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


class _Format(enum.StrEnum):
    auto = "auto"
    rollcage = "rollcage"
    nemo_gym = "nemo-gym"
    inspect = "inspect"


_GENERIC_STEMS = frozenset({"dataset", "data", "train", "test", "eval", "tasks"})


def _default_out(dataset: Path) -> Path:
    import time

    stem = dataset.stem
    name = dataset.resolve().parent.name if stem in _GENERIC_STEMS else stem
    return Path("runs") / f"{name or stem}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


def command(
    dataset: Annotated[Path, typer.Argument(help="JSONL dataset, one task a line.")],
    out: Annotated[
        Path | None, typer.Option(help="Output directory; default runs/<dataset-name>-<UTC time>/.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="OpenAI-compatible base URL ending in /v1; default: embedded policy.")
    ] = None,
    model_name: Annotated[str | None, typer.Option(help="Model name (with --model).")] = None,
    api_key_env: Annotated[
        str | None, typer.Option(help="Environment variable with the API key (never written to disk).")
    ] = None,
    api: Annotated[_Api, typer.Option(help="API style, unless a row says otherwise.")] = _Api.chat,
    policy: Annotated[
        Path | None, typer.Option(help="Policy script for the embedded scripted policy.")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Rollouts in flight at most.")] = 8,
    attempts: Annotated[int, typer.Option(min=1, help="Samples per task (k of pass@k).")] = 1,
    deadline: Annotated[
        float, typer.Option(min=0.1, help="Wall-clock deadline of one rollout, s.", callback=finite)
    ] = 600.0,
    grace: Annotated[float, typer.Option(min=0.0, help="SIGTERM → SIGKILL grace, s.", callback=finite)] = 5.0,
    max_infra_retries: Annotated[int, typer.Option(min=0, help="Retries of an infra_failure.")] = 2,
    retry_backoff: Annotated[
        float, typer.Option(min=0.0, help="First retry delay, s (doubles).", callback=finite)
    ] = 1.0,
    sandbox: Annotated[
        _Sandbox, typer.Option(help="bwrap: contained (default); none: agent code runs uncontained.")
    ] = _Sandbox.bwrap,
    memory_budget: MemoryBudget = None,
    max_processes: MaxProcesses = None,
    workspace_budget: WorkspaceBudget = None,
    workspace_inodes: WorkspaceInodes = None,
    tmp_budget: TmpBudget = None,
    tmp_inodes: TmpInodes = None,
    shm_budget: ShmBudget = None,
    shm_inodes: ShmInodes = None,
    cgroups: Cgroups = None,
    disk_budgets: DiskBudgets = None,
    require_budgets: RequireBudgets = None,
    executor_cage: ExecutorCage = None,
    worker_start: WorkerStart = None,
    backend: Annotated[
        _Backend, typer.Option(help="Where rollouts run: this machine, or a Ray cluster (rollcage[ray]).")
    ] = _Backend.local,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster (HOST:PORT of its head, or 'auto'); default: RAY_ADDRESS, else a private "
            "local instance. With --backend ray."
        ),
    ] = None,
    ray_num_cpus_per_rollout: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="CPUs Ray reserves per rollout (default 1). With --backend ray.", callback=finite
        ),
    ] = None,
    shared_dir: Annotated[
        Path | None,
        typer.Option(
            help="A directory every Ray node mounts at the same path, holding --out: nodes write rollout "
            "directories in place instead of shipping them. With --backend ray."
        ),
    ] = None,
    ray_max_artifact_mib: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Largest rollout directory shipped to the driver, MiB (default 64). With --backend ray.",
        ),
    ] = None,
    max_capture_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="Budget of one rollout's model_capture.jsonl, MiB; past it the rollout ends as agent_error.",
        ),
    ] = 256,
    strict: Annotated[bool, typer.Option(help="Stop before running anything if a row is malformed.")] = False,
    format: Annotated[
        _Format, typer.Option("--format", help="How rows are written; auto: detected (and printed).")
    ] = _Format.auto,
    environment: Annotated[
        str | None,
        typer.Option(
            help="Environment (bundled name or resource server URL) of rows naming none, e.g. NeMo Gym's."
        ),
    ] = None,
    harness: Annotated[
        _Harness | None,
        typer.Option(
            help="Agent of rows that name none: builtin (default), nooa, or command (--harness-command)."
        ),
    ] = None,
    harness_command: Annotated[
        str | None,
        typer.Option(help="With --harness command: the command line (shell words), run in the workspace."),
    ] = None,
    harness_task: Annotated[
        _TaskVia,
        typer.Option(help="With --harness command: the task on stdin, as one more argument, or a file."),
    ] = _TaskVia.stdin,
    harness_answer: Annotated[
        _AnswerFrom,
        typer.Option(
            help="With --harness command: the answer is its stdout, answer.txt, or an 'answer' event."
        ),
    ] = _AnswerFrom.stdout,
    harness_env: Annotated[
        Path | None,
        typer.Option(
            help="Virtualenv of a nooa or command harness, mounted read-only in every sandbox; default for "
            "nooa: the one 'rollcage harness install nooa' made."
        ),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            help="Task image for rows whose sandbox names none (docker://HOST/NAME:TAG, oci:PATH, "
            "docker-archive:PATH, dir:PATH): agent code runs in a copy-on-write root of it (root only)."
        ),
    ] = None,
    grade_timeouts: Annotated[bool, typer.Option(help="Grade results of rollouts that timed out.")] = False,
    resume_rollouts: Annotated[
        bool,
        typer.Option(
            help="A retry after infra_failure, or a rollout a killed run interrupted, continues from the "
            "earlier attempt's journal: recorded model calls are not sent again."
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run a dataset of tasks in sandboxes, grade outside them, and report."""
    flags = dict(locals())  # the parameters, before anything else is bound: the budget flags among them
    import asyncio

    from pydantic import ValidationError

    from rollcage.commands._progress import RichReporter, render_summary
    from rollcage.controller import (
        EXIT_USAGE,
        EmbeddedPolicyConfig,
        LocalBackendConfig,
        ModelEndpointConfig,
        RayBackendConfig,
        RunConfig,
    )
    from rollcage.errors import ConfigError
    from rollcage.protocol import describe_validation_error

    if (model is None) != (model_name is None):
        raise typer.BadParameter("--model and --model-name go together", param_hint="--model")
    if model is not None and policy is not None:
        raise typer.BadParameter(
            "--policy is for the embedded policy; drop it with --model", param_hint="--policy"
        )
    if api_key_env is not None and model is None:
        raise typer.BadParameter("--api-key-env needs --model", param_hint="--api-key-env")
    if model is not None:
        _check_model_url(model)
    if api_key_env is not None and backend is _Backend.local:
        _check_key_variable(api_key_env)
    ray_options = {
        "--ray-address": ray_address,
        "--ray-num-cpus-per-rollout": ray_num_cpus_per_rollout,
        "--shared-dir": shared_dir,
        "--ray-max-artifact-mib": ray_max_artifact_mib,
    }
    given = [name for name, value in ray_options.items() if value is not None]
    if given and backend is not _Backend.ray:
        raise typer.BadParameter(f"{given[0]} needs --backend ray", param_hint=given[0])
    where: LocalBackendConfig | RayBackendConfig = LocalBackendConfig()
    if backend is _Backend.ray:
        ray_values: dict[str, Any] = {"address": ray_address, "shared_dir": shared_dir}
        if ray_num_cpus_per_rollout is not None:
            ray_values["num_cpus_per_rollout"] = ray_num_cpus_per_rollout
        if ray_max_artifact_mib is not None:
            ray_values["max_artifact_bytes"] = ray_max_artifact_mib * 1024 * 1024
        where = RayBackendConfig(**ray_values)
    from rollcage.supervisor import BwrapSandbox

    try:
        bwrap = BwrapSandbox(**bwrap_fields(flags, sandbox=sandbox.value))
    except ValidationError as exc:
        raise typer.BadParameter(describe_validation_error(exc)) from exc
    run_harness = _harness_spec(harness, harness_command, harness_task, harness_answer)
    reporter = RichReporter(quiet=quiet)
    _log_through(reporter)
    source: EmbeddedPolicyConfig | ModelEndpointConfig
    if model is not None and model_name is not None:
        source = ModelEndpointConfig(base_url=model, model_name=model_name, api_key_env=api_key_env)
    else:
        source = EmbeddedPolicyConfig(script=policy)
    try:
        config = RunConfig(
            dataset=dataset,
            out=out if out is not None else _default_out(dataset),
            model=source,
            api=api.value,
            concurrency=concurrency,
            attempts=attempts,
            max_infra_retries=max_infra_retries,
            retry_backoff_s=retry_backoff,
            deadline_s=deadline,
            grace_s=grace,
            sandbox=sandbox.value,
            bwrap=bwrap,
            grade_timeouts=grade_timeouts,
            resume_rollouts=resume_rollouts,
            strict=strict,
            backend=where,
            max_capture_bytes=max_capture_mib * 1024 * 1024,
            dataset_format=format.value,
            environment=environment,
            harness=run_harness,
            harness_env=harness_env,
            image=image,
        )
    except ValidationError as exc:
        raise typer.BadParameter(describe_validation_error(exc)) from exc
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    tune_collector()
    try:
        summary = asyncio.run(_run(config, reporter))
    except ConfigError as exc:
        fail("run", str(exc), code=EXIT_USAGE)
    render_summary(summary, reporter.console)
    raise typer.Exit(summary.exit_code)


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


def _check_model_url(url: str) -> None:
    """Refuse a ``--model`` that no rollout could reach, before anything runs (as ``collect`` does)."""
    from rollcage.controller import model_url_problem

    problem = model_url_problem(url)
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="--model")


def _check_key_variable(name: str) -> None:
    """Refuse an ``--api-key-env`` naming an unset variable: every rollout would fail on it.

    Only for the local backend: with Ray the variable may be set on the nodes instead.
    """
    from rollcage.controller import api_key_problem

    problem = api_key_problem(name)
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="--api-key-env")


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
