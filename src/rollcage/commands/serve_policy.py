"""`rollcage serve-policy`: the scripted OpenAI-compatible model server, with fault injection."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollcage.commands import fail, finite

__all__ = ["command"]


def command(
    script: Annotated[
        Path,
        typer.Option("--script", help="Policy script (YAML or JSON): the turns to play per task id."),
    ],
    host: Annotated[str, typer.Option(help="Host to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0: a free one, printed).")
    ] = 8000,
    uds: Annotated[
        Path | None, typer.Option("--uds", help="Listen on this Unix socket instead of TCP.")
    ] = None,
    fault: Annotated[
        list[str] | None,
        typer.Option(
            "--fault",
            help="Scheduled fault, e.g. 'call=3:status=503', 'call=2:kind=hang', "
            "'rollout=r-1:call=1:kind=reset' (repeatable).",
        ),
    ] = None,
    fault_rate: Annotated[
        float,
        typer.Option(
            help="Probability of a random fault per request (0 disables).", min=0.0, max=1.0, callback=finite
        ),
    ] = 0.0,
    fault_kinds: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated kinds random faults are drawn from: latency, 500, 503, 429, reset, hang, "
            "truncated, malformed, length, empty, bad_arguments (default: all but hang)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random fault draws.")] = 0,
    fault_log: Annotated[
        Path | None, typer.Option("--fault-log", help="Append every injected fault as a JSON line here.")
    ] = None,
) -> None:
    """Serve a policy script as an OpenAI-compatible model (/v1/chat/completions, /v1/responses, /v1/models).

    Deterministic and offline: the whole pipeline runs against it with no GPU and
    no network. Faults can be injected by schedule (--fault) or by seeded chance
    (--fault-rate); Ctrl-C stops it.
    """
    from rollcage.errors import ConfigError
    from rollcage.policy import serve

    try:
        state = serve(
            script,
            host=host,
            port=port,
            uds=uds,
            faults=fault or [],
            fault_rate=fault_rate,
            fault_kinds=fault_kinds,
            seed=seed,
            fault_log=fault_log,
            announce=lambda line: typer.echo(line, err=True),
        )
    except ConfigError as exc:
        fail("serve-policy", str(exc))
    typer.echo(
        f"rollcage serve-policy: served {state.calls} model requests, injected {len(state.faults)} faults",
        err=True,
    )
