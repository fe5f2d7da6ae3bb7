"""``rollcage supervise ROLLOUT_DIR``: run one prepared rollout under a supervisor (a thin face over the API).

Exit codes: 0 ``completed`` or ``agent_error`` (a gradable result); 1
``infra_failure``; 3 ``timeout``; 4 ``cancelled``; 2 the supervisor refused to
run (bad directory or configuration, bubblewrap missing without ``--sandbox none``).
"""

from __future__ import annotations

import shlex
from enum import StrEnum
from pathlib import Path
from typing import Annotated

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

__all__ = ["EXIT_CODES", "SandboxChoice", "command"]

EXIT_CODES = {"completed": 0, "agent_error": 0, "infra_failure": 1, "timeout": 3, "cancelled": 4}
"""Exit code of ``rollcage supervise`` per outcome."""


class SandboxChoice(StrEnum):
    """How the worker is contained."""

    bwrap = "bwrap"
    none = "none"


def command(
    rollout_dir: Annotated[
        Path, typer.Argument(metavar="ROLLOUT_DIR", help="A prepared rollout directory (with input.json).")
    ],
    deadline: Annotated[
        float, typer.Option(help="Wall-clock deadline of the whole rollout, seconds.", callback=finite)
    ] = 600.0,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.", callback=finite)] = 5.0,
    sandbox: Annotated[
        SandboxChoice, typer.Option(help="bwrap (contained) or none (NOT contained: trusted code only).")
    ] = SandboxChoice.bwrap,
    api_key_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding the model API key (added by the egress proxy)."),
    ] = None,
    worker_command: Annotated[
        str | None,
        typer.Option(help="Worker program (shell words); INPUT RESULT --checkpoint PATH are appended."),
    ] = None,
    ro_path: Annotated[
        list[Path] | None,
        typer.Option(
            help="Another host path the sandbox sees read-only (e.g. a custom worker's code); repeatable."
        ),
    ] = None,
    max_capture_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="Budget of model_capture.jsonl, MiB; past it the rollout ends as agent_error.",
        ),
    ] = 256,
    json_output: Annotated[bool, typer.Option("--json", help="Print the receipt as JSON.")] = False,
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
) -> None:
    """Run one prepared rollout under a supervisor; always ends with receipt.json."""
    flags = dict(locals())  # the parameters, before anything else is bound: the budget flags among them
    import asyncio
    import logging
    import signal

    from pydantic import ValidationError

    from rollcage.errors import ConfigError, SandboxError
    from rollcage.protocol import SupervisorReceipt
    from rollcage.supervisor import BwrapSandbox, NoSandbox, ProxyConfig, SupervisorConfig, supervise

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    budgets = bwrap_fields(flags, sandbox=sandbox.value)  # refuses budget flags with --sandbox none
    try:
        config = SupervisorConfig(
            deadline_s=deadline,
            grace_s=grace,
            sandbox=BwrapSandbox(extra_ro_paths=[str(p.absolute()) for p in ro_path or []], **budgets)
            if sandbox is SandboxChoice.bwrap
            else NoSandbox(),
            api_key_env=api_key_env,
            worker_command=shlex.split(worker_command) if worker_command else None,
            proxy=ProxyConfig(max_capture_bytes=max_capture_mib * 1024 * 1024),
        )
    except ValidationError as exc:
        from rollcage.protocol import describe_validation_error

        fail("supervise", describe_validation_error(exc))
    except ValueError as exc:  # --worker-command that does not split into words
        fail("supervise", f"--worker-command: {exc}")

    async def main() -> SupervisorReceipt:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, frame: object) -> None:
            loop.call_soon_threadsafe(stop.set)

        # SIGTERM/SIGINT to this process is an external stop: the worker gets SIGTERM, then SIGKILL
        # after the grace period, and the receipt says "cancelled". Plain handlers, not the loop's:
        # the loop's close puts the default actions back, which would end a process whose receipt
        # is written with -15 or -2 (below, they are ignored from then on instead).
        previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            receipt = await supervise(rollout_dir, config, stop=stop)
        except BaseException:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            raise
        # The receipt is written: the exit code is the receipt's, whatever signal comes now.
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)
        return receipt

    try:
        receipt = asyncio.run(main())
    except (ConfigError, SandboxError) as exc:
        fail("supervise", str(exc))
    if json_output:
        typer.echo(receipt.model_dump_json(indent=2))
    else:
        typer.echo(f"receipt: {rollout_dir / 'receipt.json'}")
        typer.echo(f"outcome: {receipt.outcome} ({receipt.outcome_reason})")
    raise typer.Exit(EXIT_CODES[receipt.outcome])
