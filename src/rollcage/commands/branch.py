"""``rollcage branch RUN ROLLOUT --at BOUNDARY -k K --out OUT``: k continuations of a rollout's prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

__all__ = ["command"]


def command(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN", help="The source's run directory.")],
    rollout: Annotated[str, typer.Argument(metavar="ROLLOUT", help="The source rollout's id.")],
    at: Annotated[
        str,
        typer.Option(
            "--at",
            help="Where to branch: turn:T (or T; the branches make model call T live), seq:N (the source "
            "journal's records up to N are the prefix), first-failed-tool, or last-turn.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="The branch run's directory (rerun it to continue).")],
    k: Annotated[int, typer.Option("-k", min=1, max=10_000, help="How many branches.")] = 1,
    tasks: Annotated[
        Path | None,
        typer.Option("--tasks", help="The dataset holding the source's row, to grade the branches by."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Another model endpoint URL (ending in /v1) for the live part."),
    ] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="Another model name.")] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, help="Another sampling temperature.")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Another sampling seed.")] = None,
    sandbox: Annotated[str, typer.Option("--sandbox", help="bwrap or none.")] = "bwrap",
    deadline_s: Annotated[
        float, typer.Option("--deadline", min=1.0, help="Each branch's wall-clock deadline in seconds.")
    ] = 600.0,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", min=1, help="Branches in flight at most (default: k).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print nothing but errors.")] = False,
) -> None:
    """Branch a finished rollout: k new rollouts replay its prefix from its journal, then continue live.

    Exit status: 0 when every branch has a record, 3 when every branch ended in infra_failure.
    """
    import asyncio

    from rollcage.commands import fail, finite
    from rollcage.controller import branch, branch_source
    from rollcage.errors import ConfigError

    finite(temperature)
    if sandbox not in ("bwrap", "none"):
        fail("branch", f"--sandbox {sandbox!r}: bwrap or none")
    chosen: Literal["bwrap", "none"] = "bwrap" if sandbox == "bwrap" else "none"

    def say(line: str) -> None:
        if not quiet:
            typer.echo(line)

    async def go() -> list[str]:
        outcomes: list[str] = []
        source = branch_source(run_dir.absolute(), rollout)
        async for record in branch(
            source,
            at=at,
            k=k,
            out=out,
            run=run_dir,
            tasks=tasks,
            model=model,
            model_name=model_name,
            temperature=temperature,
            seed=seed,
            sandbox=chosen,
            deadline_s=deadline_s,
            concurrency=concurrency,
            notice=say,
        ):
            outcomes.append(record.outcome)
            reward = "not graded" if record.reward is None else f"reward {record.reward:g}"
            reason = f" ({record.receipt.outcome_reason})" if record.outcome == "infra_failure" else ""
            say(f"{record.rollout_id}: {record.outcome}, {reward}{reason}")
        return outcomes

    try:
        outcomes = asyncio.run(go())
    except ConfigError as exc:
        fail("branch", str(exc))
    say(f"{len(outcomes)} branch(es) ran; {out / 'tree.json'} holds the shared prefix and each suffix")
    if outcomes and all(o == "infra_failure" for o in outcomes):
        raise typer.Exit(3)
