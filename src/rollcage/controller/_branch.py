"""Branching a rollout: k new rollouts that share a finished rollout's prefix and continue live.

``rollcage branch RUN ROLLOUT --at BOUNDARY -k K`` and ``rollcage.branch(record, at=..., k=...)``
point resume's machinery (:mod:`rollcage.resume`) forward. Each branch is a rollout of its own:
its own sandbox, budgets, receipt, capture, grading. Its worker is given the source's journal cut
at the boundary, as a *strict* resume:

* model calls the prefix holds are answered from the journal (the model server never sees them),
  resource calls from the journal, cells are run again in the branch's fresh executor and their
  output compared with the recorded one (which is how the workspace and the executor's state,
  also of a task image's copy-on-write root, are rebuilt: the source's workspace at that
  boundary is not kept, so it is always rebuilt by re-running cells);
* everything after the boundary runs live, with the model and sampling settings asked for;
* a prefix that cannot be replayed exactly (a cell whose output differs, a journal that does not
  fold) ends the branch as ``infra_failure`` with the reason (:class:`BranchReplayError`), never
  as a silent fresh start.

A boundary is named by turn (``turn:T`` or ``T``: the branch makes model call ``T`` live), by the
source journal's sequence number (``seq:N``: the records up to ``N`` are the prefix; the end of a
model call, of a tool call or of a cell), or by a rule: ``first-failed-tool`` (the turn whose
model call asked for the first tool call that failed: re-ask it) or ``last-turn``.

Records carry ``branched_from`` (run, rollout, boundary, turn). ``OUT/tree.json`` carries the
shared prefix once and each branch's suffix, reward and advantage against its siblings.

Rows with an environment are refused up front: a NeMo Gym environment cannot recreate a session
at a point inside it (its protocol only seeds new sessions), so the branch's resource calls
would act on state the prefix never built. Harness rollouts are refused too (a harness cannot
replay recorded answers).

A branch run killed midway is continued by the same command: each branch without a record is
resumed from its own journal (strict as well), else branched again from the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollcage.controller._ids import rollout_id
from rollcage.controller._unit import (
    Endpoints,
    GradingPlan,
    PreparedRollout,
    ResumeSource,
    RolloutSettings,
    SuperviseFn,
    prepare_rollout,
    run_rollout,
    set_aside,
    task_change,
)
from rollcage.errors import ConfigError, JournalCorruptError, ResumeRefusedError, RollcageError
from rollcage.protocol import BranchLink, ResponseItem, RolloutRecord, Trajectory, WorkerInput

__all__ = [
    "BranchPlan",
    "BranchPoint",
    "branch",
    "branch_id",
    "branch_source",
    "export_tree",
    "parse_boundary",
    "plan_branches",
    "resolve_boundary",
]

_RULES = ("first-failed-tool", "last-turn")
_MAX_INPUT_BYTES = 64 * 1024 * 1024
_MAX_JOURNAL_BYTES = 1 << 30
_BOUNDARY = re.compile(r"(?:(turn|seq):)?(\d{1,9})")
TREE_FILE = "tree.json"
"""The branches of one source in one file: the shared prefix once, each branch's suffix."""


@dataclass(frozen=True)
class BranchPoint:
    """A resolved boundary of the source journal.

    Attributes:
        seq: The journal's last record in the prefix (``0``: none, the branch starts fresh).
        turn: The first model call the branch makes live (``0``: all of them).
        asked: The boundary as it was asked for (``turn:3``, ``seq:12``, ``last-turn``).
    """

    seq: int
    turn: int
    asked: str


@dataclass(frozen=True)
class BranchPlan:
    """What a branch run does: the source, the point, and the k prepared first attempts.

    Attributes:
        run: The source's run directory.
        source_id: The source rollout's id.
        source_dir: Its directory (evidence: read, never written).
        point: Where the branches fork.
        prepared: One prepared attempt per branch (its directory not made yet).
        notices: What the user should know (not graded, an image rebuilt by re-running cells).
    """

    run: Path
    source_id: str
    source_dir: Path
    point: BranchPoint
    prepared: list[PreparedRollout]
    notices: list[str] = field(default_factory=list)


def parse_boundary(text: str) -> str | tuple[Literal["turn", "seq"], int]:
    """``--at``: ``turn:T`` / ``T``, ``seq:N``, or a rule (``first-failed-tool``, ``last-turn``).

    Raises:
        ConfigError: It is none of these.
    """
    value = text.strip()
    if value in _RULES:
        return value
    match = _BOUNDARY.fullmatch(value)
    if match is None:
        raise ConfigError(
            f"--at {text!r}: name a boundary as turn:T (or T), seq:N, first-failed-tool or last-turn"
        )
    kind: Literal["turn", "seq"] = "seq" if match.group(1) == "seq" else "turn"
    return kind, int(match.group(2))


def _turn_starts(records: list[dict[str, Any]]) -> dict[int, int]:
    """seq of each turn's ``turn_start`` record, by turn index."""
    found: dict[int, int] = {}
    for record in records:
        turn = record.get("turn")
        if (
            record.get("kind") == "turn_start"
            and isinstance(turn, dict)
            and isinstance(turn.get("index"), int)
        ):
            found.setdefault(turn["index"], int(record["seq"]))
    return found


def resolve_boundary(records: list[dict[str, Any]], at: str, *, where: str) -> BranchPoint:
    """The prefix of the source journal ``records`` that ``at`` names.

    Raises:
        ConfigError: The journal has no such boundary, or the prefix cannot be replayed; the
            message names the source and the boundary.
    """
    asked = parse_boundary(at)
    starts = _turn_starts(records)
    turn: int
    if asked == "last-turn":
        if not starts:
            raise ConfigError(f"{where}: its journal holds no turn to branch at")
        turn = max(starts)
    elif asked == "first-failed-tool":
        failed = next(
            (
                tool
                for record in records
                if record.get("kind") == "tool_call"
                for tool in record.get("tool_calls") or []
                if isinstance(tool, dict) and tool.get("status") == "failed"
            ),
            None,
        )
        if failed is None or not isinstance(failed.get("turn"), int):
            raise ConfigError(f"{where}: no tool call failed in its journal (--at first-failed-tool)")
        turn = failed["turn"]
    elif asked[0] == "seq":
        seq = int(asked[1])
        last = int(records[-1]["seq"]) if records else 0
        if not 1 <= seq <= last:
            raise ConfigError(f"{where}: --at seq:{seq} is not in its journal (records 1 to {last})")
        return _checked(records, BranchPoint(seq=seq, turn=-1, asked=at), where=where)
    else:
        turn = int(asked[1])
    if turn not in starts:
        known = f"turns 0 to {max(starts)}" if starts else "no turn"
        raise ConfigError(f"{where}: --at {at} names turn {turn}; its journal holds {known}")
    # The prefix ends just before the turn starts: its model call is the branch's first live one.
    return _checked(records, BranchPoint(seq=starts[turn] - 1, turn=turn, asked=at), where=where)


def _checked(records: list[dict[str, Any]], point: BranchPoint, *, where: str) -> BranchPoint:
    """Fold the prefix as the branch's worker will; its answered calls say the first live turn."""
    from rollcage.checkpoint import fold_records
    from rollcage.resume import plan_replay

    prefix = [r for r in records if int(r["seq"]) <= point.seq]
    if not any(r.get("kind") == "model_call" for r in prefix):
        if point.turn > 0:
            raise ConfigError(f"{where}: no model call was answered before {point.asked}: nothing to replay")
        return BranchPoint(seq=0, turn=0, asked=point.asked)  # no prefix: each branch starts fresh
    try:
        checkpoint = fold_records(prefix, source=where)
        plan = plan_replay(checkpoint, str(checkpoint.rollout_id))
    except (JournalCorruptError, ResumeRefusedError, ValueError) as exc:
        raise ConfigError(f"{where}: its journal cannot be replayed up to {point.asked}: {exc}") from exc
    live = len(plan.calls)
    if point.turn >= 0 and live != point.turn:
        raise ConfigError(
            f"{where}: model call {live} was not answered in its journal, so turn {point.turn} cannot be "
            "reached by replaying it"
        )
    return BranchPoint(seq=point.seq, turn=live, asked=point.asked)


def _read_input(directory: Path) -> WorkerInput:
    from rollcage.durable import read_bounded

    path = directory / "input.json"
    try:
        return WorkerInput.model_validate_json(read_bounded(path, limit=_MAX_INPUT_BYTES))
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot be read ({exc.strerror or exc}): is it a rollout directory?"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"{path}: not a rollout's input.json: {exc}") from exc


def _read_journal(directory: Path) -> list[dict[str, Any]]:
    from rollcage.durable import read_journal

    path = directory / "checkpoint.jsonl"
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path}: the source has no journal (a regular checkpoint.jsonl) to branch from")
    try:
        return read_journal(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    except JournalCorruptError as exc:
        raise ConfigError(f"the source's journal is damaged: {exc}") from exc


def branch_source(run: Path, rollout: str) -> Path:
    """``RUN/rollouts/ROLLOUT``, refused unless ``rollout`` is one plain file name and no link is followed.

    Raises:
        ConfigError: It is not, or there is no such directory.
    """
    from rollcage.runfiles import file_name_problem

    problem = file_name_problem(rollout)
    if problem is not None or rollout.startswith("."):
        raise ConfigError(f"rollout id {rollout!r} {problem or 'starts with a dot'}")
    directory = run / "rollouts" / rollout
    if directory.is_symlink() or (run / "rollouts").is_symlink():
        raise ConfigError(f"{directory}: a symbolic link; a source is read only inside its run")
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such rollout in run {run}")
    return directory


def _refuse_unbranchable(source: WorkerInput, where: str) -> None:
    harness = source.agent.harness
    if harness is not None and harness.type != "builtin":
        raise ConfigError(
            f"{where}: row {source.task_id!r} runs the {harness.type} harness, which cannot replay recorded "
            "answers: it cannot be branched"
        )
    if source.resources:
        keys = ", ".join(sorted(source.resources))
        raise ConfigError(
            f"{where}: row {source.task_id!r} uses the environment {keys}, which cannot recreate its session "
            "at a point inside it (NeMo Gym's protocol only seeds new sessions): it cannot be branched"
        )


def _grading(
    tasks: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None, source: WorkerInput, source_dir: Path
) -> GradingPlan | None:
    """The source row's grading, from the dataset given; the row must still be the task the source ran."""
    from rollcage.controller._dataset import InvalidRow, Task, detect_format, iter_dataset, tasks_from_rows

    if tasks is None:
        return None
    found: Task | None = None
    items: Iterable[Task | InvalidRow]
    if isinstance(tasks, str | os.PathLike):
        path = Path(tasks)
        items = iter_dataset(path, format=detect_format(path))
    else:
        items = tasks_from_rows(tasks, format="auto")
    for item in items:
        if isinstance(item, Task) and item.id == source.task_id:
            found = item
            break
    if found is None:
        raise ConfigError(f"the dataset given has no valid row {source.task_id!r} (the source's task)")
    endpoints = Endpoints(
        model=source.model,
        images={source.image.ref: source.image} if source.image is not None else {},
        image=source.image.ref if source.image is not None else None,
    )
    prepared = prepare_rollout(found, 0, 0, out_dir=source_dir, endpoints=endpoints)
    if prepared.environment is not None:
        raise ConfigError(
            f"row {source.task_id!r} uses an environment, which cannot recreate its session at a point "
            "inside it: it cannot be branched"
        )
    changed = task_change(source_dir / "input.json", prepared.worker_input, branch=True)
    if changed is not None:
        raise ConfigError(
            f"row {source.task_id!r} changed since the source ran ({changed}): not graded as it"
        )
    return prepared.grading


def branch_id(source_id: str, point: BranchPoint, index: int, try_index: int) -> str:
    """The id of branch ``index``'s attempt ``try_index``: ``<source>.b<seq>-s<index>-t<try>``."""
    return rollout_id(f"{source_id}.b{point.seq}", index, try_index)


def plan_branches(
    source: RolloutRecord | str | os.PathLike[str],
    *,
    at: str,
    k: int,
    out: str | os.PathLike[str],
    run: str | os.PathLike[str] | None = None,
    tasks: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    model: str | None = None,
    model_name: str | None = None,
    temperature: float | None = None,
    seed: int | None = None,
) -> BranchPlan:
    """Resolve the source and the boundary, and prepare the k branches' first attempts (blocking).

    Args:
        source: The source's record, or its rollout directory.
        at: The boundary (see :func:`parse_boundary`).
        k: How many branches.
        out: The branch run's directory.
        run: The source's run (default: the directory above ``rollouts/``).
        tasks: The dataset (a path or rows) holding the source's row, to grade the branches by; ``None``:
            the branches are not graded.
        model: Another model endpoint URL for the live part (default: the source's).
        model_name: Another model name.
        temperature: Another sampling temperature.
        seed: Another sampling seed.

    Raises:
        ConfigError: The source, the boundary or the row cannot be branched; the message says which.
    """
    if k < 1:
        raise ConfigError(f"-k {k}: at least one branch")
    if isinstance(source, RolloutRecord):
        directory = Path(source.rollout_dir)
    else:
        directory = Path(source)
    directory = directory.absolute()
    run_dir = Path(run).absolute() if run is not None else directory.parent.parent
    source_input = _read_input(directory)
    source_id = source_input.rollout_id
    where = f"rollout {source_id} ({directory})"
    _refuse_unbranchable(source_input, where)
    point = resolve_boundary(_read_journal(directory), at, where=where)
    grading = _grading(tasks, source_input, directory)
    notices: list[str] = []
    if grading is None:
        notices.append("no dataset given (--tasks): the branches are not graded")
    if source_input.image is not None:
        notices.append(
            f"task image {source_input.image.ref}: each branch's root is rebuilt by re-running the prefix's "
            "cells (the source's workspace at the boundary was not kept)"
        )
    endpoint = source_input.model
    if model is not None:
        endpoint = endpoint.model_copy(update={"base_url": model, "uds": None})
    if model_name is not None:
        endpoint = endpoint.model_copy(update={"model": model_name})
    sampling: dict[str, Any] = {}
    if temperature is not None:
        sampling["temperature"] = temperature
    if seed is not None:
        sampling["seed"] = seed
    if sampling:
        endpoint = endpoint.model_copy(update={"sampling": endpoint.sampling.model_copy(update=sampling)})
    endpoint = type(endpoint).model_validate(endpoint.model_dump())  # the overrides checked as a whole
    out_dir = Path(out).absolute()
    link = BranchLink(run=str(run_dir), rollout_id=source_id, boundary=point.seq, turn=point.turn)
    prepared: list[PreparedRollout] = []
    for index in range(k):
        rid = branch_id(source_id, point, index, 0)
        worker_input = source_input.model_copy(update={"rollout_id": rid, "model": endpoint, "resume": None})
        prepared.append(
            PreparedRollout(
                rollout_id=rid,
                task_id=source_input.task_id,
                sample=index,
                try_index=0,
                rollout_dir=str(out_dir / "rollouts" / rid),
                worker_input=worker_input,
                grading=grading,
                resume_from=_from_source(source_id, directory, point),
                branched_from=link,
            )
        )
    return BranchPlan(
        run=run_dir,
        source_id=source_id,
        source_dir=directory,
        point=point,
        prepared=prepared,
        notices=notices,
    )


def _from_source(source_id: str, directory: Path, point: BranchPoint) -> ResumeSource | None:
    if point.seq == 0:
        return None
    return ResumeSource(rollout_id=source_id, directory=str(directory), upto=point.seq, strict=True)


def _of_source(records: list[RolloutRecord], plan: BranchPlan) -> list[RolloutRecord]:
    """The records of branches of ``plan``'s source at its boundary."""
    return [
        r
        for r in records
        if r.branched_from is not None
        and (r.branched_from.rollout_id, r.branched_from.boundary) == (plan.source_id, plan.point.seq)
    ]


def _continue(plan: BranchPlan, out: Path, records: list[RolloutRecord]) -> list[PreparedRollout]:
    """The attempts still to run: branches without a record; one a killed run left is resumed (blocking)."""
    done = {r.sample for r in _of_source(records, plan)}
    todo: list[PreparedRollout] = []
    for first in plan.prepared:
        if first.sample in done:
            continue
        tries = 0
        while (out / "rollouts" / branch_id(plan.source_id, plan.point, first.sample, tries)).exists():
            tries += 1
        if tries == 0:
            todo.append(first)
            continue
        # The latest attempt was killed before its record: set it aside (evidence) and continue it from its
        # own journal; if its replay was not over yet, from the source's again.
        earlier = out / "rollouts" / branch_id(plan.source_id, plan.point, first.sample, tries - 1)
        moved = set_aside(earlier, out / "interrupted")
        own = (
            [ResumeSource(rollout_id=earlier.name, directory=str(moved), strict=plan.point.seq > 0)]
            if moved is not None
            else []
        )
        source = _from_source(plan.source_id, plan.source_dir, plan.point)
        chain = [*own, *([source] if source is not None else [])]
        resume = chain[0].model_copy(update={"earlier": chain[1:]}) if chain else None
        rid = branch_id(plan.source_id, plan.point, first.sample, tries)
        worker_input = first.worker_input.model_copy(update={"rollout_id": rid})
        todo.append(
            first.model_copy(
                update={
                    "rollout_id": rid,
                    "try_index": tries,
                    "rollout_dir": str(out / "rollouts" / rid),
                    "worker_input": worker_input,
                    "resume_from": resume,
                }
            )
        )
    return todo


def _existing(out: Path) -> list[RolloutRecord]:
    from rollcage.controller._records import load_records

    found: list[RolloutRecord] = []
    load_records(out / "rollouts.jsonl", found.append)
    return found


async def branch(
    source: RolloutRecord | str | os.PathLike[str],
    *,
    at: str,
    k: int,
    out: str | os.PathLike[str],
    run: str | os.PathLike[str] | None = None,
    tasks: Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    model: str | None = None,
    model_name: str | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    sandbox: Literal["bwrap", "none"] = "bwrap",
    deadline_s: float = 600.0,
    concurrency: int | None = None,
    settings: RolloutSettings | None = None,
    supervise: SuperviseFn | None = None,
    notice: Callable[[str], object] | None = None,
) -> AsyncIterator[RolloutRecord]:
    """Run ``k`` branches of ``source`` from boundary ``at``; yield each branch's record as it lands.

    Each branch is a new rollout whose prefix is replayed from the source's journal (model
    answers and resource calls from the journal, cells re-run and compared) and which then
    continues live; its record (appended, fsynced, to ``OUT/rollouts.jsonl`` first) carries
    ``branched_from``. When all have landed, ``OUT/tree.json`` holds the shared prefix once and
    every branch's suffix (:func:`export_tree`). Running it again with the same ``out``
    continues a killed run: finished branches are kept, unfinished ones resumed::

        async for record in rollcage.branch(record, at="last-turn", k=8, out="runs/b", tasks="data.jsonl"):
            print(record.rollout_id, record.reward)

    Args:
        source: The source's record (from ``rollcage.collect`` or ``rollouts.jsonl``) or rollout directory.
        at: The boundary: ``turn:T`` (or ``T``), ``seq:N``, ``first-failed-tool`` or ``last-turn``.
        k: How many branches.
        out: The branch run's directory.
        run: The source's run (default: the directory above its ``rollouts/``).
        tasks: The dataset holding the source's row, to grade the branches; ``None``: not graded.
        model: Another model endpoint URL for the live part.
        model_name: Another model name.
        temperature: Another sampling temperature.
        seed: Another sampling seed.
        sandbox: ``bwrap`` or ``none``.
        deadline_s: Each branch's wall-clock deadline.
        concurrency: Branches in flight at most (default: all ``k``).
        settings: Full rollout settings (overrides ``sandbox`` and ``deadline_s``).
        supervise: The supervisor's entry point (tests).
        notice: Called with each line the user should read (default: none).

    Raises:
        ConfigError: The source or boundary cannot be branched (before anything runs).
        RunFailedError: Another branch run holds ``out``.

    **Cancellation:** closing the iterator early, or cancelling the task iterating it, cancels the
    branches in flight (their supervisors stop and reap the workers); they are resumed by a rerun.
    """
    from rollcage.controller._records import RecordLog
    from rollcage.errors import RunFailedError

    out_dir = await asyncio.to_thread(Path(out).absolute)
    plan = await asyncio.to_thread(
        plan_branches,
        source,
        at=at,
        k=k,
        out=out_dir,
        run=run,
        tasks=tasks,
        model=model,
        model_name=model_name,
        temperature=temperature,
        seed=seed,
    )
    for line in plan.notices:
        if notice is not None:
            notice(line)
    chosen = settings or RolloutSettings(sandbox=sandbox, deadline_s=deadline_s)
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    lock = await asyncio.to_thread(
        os.open, out_dir / ".branch.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
    )
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RunFailedError(f"{out_dir}: another branch run is using it") from exc
        existing = await asyncio.to_thread(_existing, out_dir)
        todo = await asyncio.to_thread(_continue, plan, out_dir, existing)
        gate = asyncio.Semaphore(concurrency or k)

        async def one(prepared: PreparedRollout) -> RolloutRecord:
            async with gate:
                return await run_rollout(prepared, chosen, supervise=supervise)

        landed = list(existing)
        async with RecordLog(out_dir / "rollouts.jsonl") as log:
            tasks_in_flight = [asyncio.ensure_future(one(p)) for p in todo]
            try:
                for finished in asyncio.as_completed(tasks_in_flight):
                    record = await finished
                    await log.append(record)
                    landed.append(record)
                    yield record
            finally:
                for task in tasks_in_flight:
                    task.cancel()
                for task in tasks_in_flight:
                    with contextlib.suppress(asyncio.CancelledError, RollcageError):
                        await task
        await asyncio.to_thread(export_tree, out_dir, plan, landed)
    finally:
        os.close(lock)


def export_tree(out: Path, plan: BranchPlan, records: list[RolloutRecord]) -> Path:
    """Write ``OUT/tree.json``: the source's prefix once, each branch's suffix and advantage (blocking).

    ``prefix`` is the Responses-style output the branches share (the source's, up to the boundary);
    each branch's ``suffix`` is its own output after it, ``None`` when its output does not begin
    with the prefix (a branch that failed before the replay was over). ``advantage`` is the branch's
    reward minus the mean reward of the graded, unmasked branches of the same source.
    """
    from rollcage.checkpoint import fold_records
    from rollcage.durable import publish_json, read_journal
    from rollcage.trajectory import project_output

    journal = [
        r for r in read_journal(plan.source_dir / "checkpoint.jsonl") if int(r["seq"]) <= plan.point.seq
    ]
    prefix = _shared(fold_records(journal).trajectory) if journal and plan.point.seq > 0 else []
    mine = _of_source(records, plan)
    rewards = [r.reward for r in mine if r.reward is not None and not r.masked]
    mean = sum(rewards) / len(rewards) if rewards else None
    branches: list[dict[str, Any]] = []
    for record in sorted(mine, key=lambda r: (r.sample, r.try_index)):
        result = record.result(out)
        output = project_output(result.trajectory, partial=False) if result is not None else None
        suffix = _after(output, prefix) if output is not None else None
        branches.append(
            {
                "rollout_id": record.rollout_id,
                "sample": record.sample,
                "outcome": record.outcome,
                "reward": record.reward,
                "advantage": None if record.reward is None or mean is None else record.reward - mean,
                "suffix": suffix,
            }
        )
    tree = {
        "source": {"run": str(plan.run), "rollout_id": plan.source_id, "directory": str(plan.source_dir)},
        "boundary": {"seq": plan.point.seq, "turn": plan.point.turn, "at": plan.point.asked},
        "prefix": prefix,
        "branches": branches,
    }
    path = out / TREE_FILE
    publish_json(path, tree, mode=0o644)
    return path


def _shared(trajectory: Trajectory) -> list[ResponseItem]:
    """The prefix's items: every answered model call's output whole (tool calls it asked for that ran
    live in the branches included: they are the model's answer), and the outputs of the tool calls that
    ended within the prefix."""
    from rollcage.trajectory import project_calls

    ended = {t.call_id for t in trajectory.tool_calls if t.status in ("completed", "failed")}
    items: list[ResponseItem] = []
    for projected in project_calls(trajectory, partial=False):
        items += [
            item
            for item in projected.items
            if item.get("type") != "function_call_output" or str(item.get("call_id")) in ended
        ]
    return items


def _after(output: list[ResponseItem], prefix: list[ResponseItem]) -> list[ResponseItem] | None:
    """A branch's items beyond the prefix, in order; ``None`` when it lacks one of the prefix's items.

    Not a positional cut: a tool call pending at the boundary ends in the branch, and its output may
    come before the output of one that ended within the prefix.
    """
    left = list(prefix)
    suffix: list[ResponseItem] = []
    for item in output:
        if item in left:
            left.remove(item)
        else:
            suffix.append(item)
    return suffix if not left else None
