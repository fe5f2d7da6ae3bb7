"""``rollcage supervise ROLLOUT_DIR``: run one prepared rollout under a supervisor (a thin face over the API).

Exit codes: 0 ``completed`` or ``agent_error`` (a gradable result); 1
``infra_failure``; 3 ``timeout``; 4 ``cancelled``; 2 the supervisor refused to
run (bad directory or configuration, bubblewrap missing without ``--sandbox none``).
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from rollcage.commands import fail, finite
from rollcage.commands._config_options import describe_errors
from rollcage.commands._sandbox_options import ExecutorCage, WorkerStart, bwrap_fields, sandbox_options

__all__ = ["EXIT_CODES", "SandboxChoice", "build_command", "command"]

EXIT_CODES = {"completed": 0, "agent_error": 0, "infra_failure": 1, "timeout": 3, "cancelled": 4}
"""Exit code of ``rollcage supervise`` per outcome."""


class SandboxChoice(StrEnum):
    """How the worker is contained."""

    bwrap = "bwrap"
    none = "none"


def _supervise(
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
    executor_cage: ExecutorCage = None,
    worker_start: WorkerStart = None,
    **budget_flags: Any,
) -> None:
    """Run one prepared rollout under a supervisor; always ends with receipt.json."""
    import asyncio
    import logging
    import signal

    from pydantic import ValidationError

    from rollcage.errors import ConfigError, SandboxError
    from rollcage.protocol import SupervisorReceipt
    from rollcage.supervisor import NoSandbox, ProxyConfig, SupervisorConfig, supervise

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = sandbox_options()
    flags = {**budget_flags, "executor_cage": executor_cage, "worker_start": worker_start}
    budgets = bwrap_fields(flags, sandbox=sandbox.value, options=options)  # refused with --sandbox none
    try:
        config = SupervisorConfig(
            deadline_s=deadline,
            grace_s=grace,
            # As the config's input, not a model: an error is then reported where its flag lands.
            sandbox={"type": "bwrap", "extra_ro_paths": [str(p.absolute()) for p in ro_path or []], **budgets}
            if sandbox is SandboxChoice.bwrap
            else NoSandbox(**{key: budgets[key] for key in ("worker_start",) if key in budgets}),
            api_key_env=api_key_env,
            worker_command=shlex.split(worker_command) if worker_command else None,
            proxy=ProxyConfig(max_capture_bytes=max_capture_mib * 1024 * 1024),
        )
    except ValidationError as exc:
        fail("supervise", describe_errors(exc, {option.loc: option.flag for option in options}))
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


def build_command() -> Callable[..., None]:
    """``rollcage supervise``: its own options, and one flag per budget of the budgets' model
    (:func:`~rollcage.commands._sandbox_options.sandbox_options`), generated as ``rollcage run``'s are."""

    def command(**given: Any) -> None:
        _supervise(**given)

    own = inspect.signature(_supervise, eval_str=True).parameters.values()
    params = [param for param in own if param.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {param.name for param in params}
    for option in sandbox_options():
        if option.param in taken:
            raise TypeError(f"{option.flag} is spelled twice: rename the budget or its flag")
        params.append(
            inspect.Parameter(
                option.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option.annotation
            )
        )
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = _supervise.__doc__
    return command


command = build_command()
"""``rollcage supervise``, as typer registers it."""
