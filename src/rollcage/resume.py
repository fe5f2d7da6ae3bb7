"""Continuing a rollout from an earlier attempt's journal instead of starting over.

The earlier attempt's ``checkpoint.jsonl`` holds every boundary that reached the
disk. ``load_replay`` folds it and validates it as *evidence*, not as truth: it was
written by a worker inside a sandbox, so anything malformed, torn mid-file or
inconsistent (ids that are not the attempt's, gaps in the calls, a journal of
another attempt) refuses the resume with ``ResumeRefusedError``, and the rollout
starts fresh with that reason recorded.

A ``Replay`` then drives the agent loop through the journal's prefix:

* a model call the journal holds (answered: completed, or cut off) is not sent;
  the recorded response is returned once the question the loop built for that
  turn equals the recorded one (the model-visible history is rebuilt by the loop
  itself, from the same responses, and checked item for item);
* a resource tool call or ``submit`` the journal holds as ended is not sent
  again: its recorded output is the answer;
* a Python cell the journal holds is run again in the fresh executor, which is
  how the executor's state (variables, files in the workspace) is restored; its
  output must equal the recorded one, else the replay has diverged (agent code
  that prints a time or a random number), and the rollout starts fresh. A ``bash``
  command and a file editor call are cells in this sense: run again (the shell's
  directory and variables, the files and the editor's undo history come back),
  compared the same way.

Everything after the journal's prefix runs for real. Why re-run cells rather than
restore a snapshot of the earlier workspace: the earlier attempt's directory is
evidence and stays untouched, a kill can land between a cell's side effects and
its boundary (a snapshot would then hold effects no boundary accounts for), and a
cell's recorded output is exactly the check that the restored state is the one
the model saw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rollcage.errors import JournalCorruptError, ResumeRefusedError
from rollcage.protocol import Checkpoint, ModelCall, ResponseItem, ResumedFrom, ToolCall, Turn
from rollcage.trajectory import INTERRUPTED

__all__ = ["Replay", "ReplayPlan", "load_replay", "plan_replay"]

_ENDED = ("completed", "failed")


@dataclass(frozen=True)
class ReplayPlan:
    """What a validated journal allows a new attempt to skip.

    Attributes:
        previous_rollout_id: The attempt that wrote the journal.
        boundary: ``seq`` of the journal's last intact record.
        turns: The recorded turns whose model call is replayed, in order.
        calls: Their model calls (answered, contiguous from the first).
        tools: Every tool call the journal holds, by id (ended or not).
        model_cookies: The latest model cookies the journal recorded.
        resource_cookies: The latest resource cookies it recorded.
    """

    previous_rollout_id: str
    boundary: int
    turns: list[Turn]
    calls: list[ModelCall]
    tools: dict[str, ToolCall]
    model_cookies: dict[str, str]
    resource_cookies: dict[str, str]


def load_replay(path: str | os.PathLike[str], previous_rollout_id: str) -> ReplayPlan:
    """Fold and validate an earlier attempt's journal (blocking).

    Raises:
        ResumeRefusedError: The journal is missing, damaged, of another attempt,
            inconsistent, or holds no answered model call; the message says which.
    """
    from rollcage.checkpoint import load_checkpoint

    try:
        checkpoint = load_checkpoint(path)
    except JournalCorruptError as exc:
        raise ResumeRefusedError(f"the earlier attempt's journal is unusable: {exc}") from exc
    except OSError as exc:
        raise ResumeRefusedError(
            f"the earlier attempt's journal {path} cannot be read: {exc.strerror or exc}"
        ) from exc
    except (ValueError, RecursionError) as exc:  # a record that folds into nonsense
        raise ResumeRefusedError(f"the earlier attempt's journal is unusable: {exc}") from exc
    return plan_replay(checkpoint, previous_rollout_id)


def plan_replay(checkpoint: Checkpoint, previous_rollout_id: str) -> ReplayPlan:
    """What of ``checkpoint`` a new attempt may replay.

    Raises:
        ResumeRefusedError: The checkpoint is not the named attempt's, is
            inconsistent with how the agent loop writes journals, or has nothing to
            replay.
    """
    if checkpoint.seq is None:
        raise ResumeRefusedError("the earlier attempt's journal is empty: nothing to resume")
    if checkpoint.rollout_id != previous_rollout_id:
        raise ResumeRefusedError(
            f"the journal was written by attempt {checkpoint.rollout_id!r}, not by {previous_rollout_id!r}"
        )
    trajectory = checkpoint.trajectory
    prefix = f"{previous_rollout_id}:"
    for index, turn in enumerate(trajectory.turns):
        if turn.index != index or turn.id != f"{prefix}t{index}":
            raise ResumeRefusedError(f"the journal's turn {index} is out of order ({turn.id!r})")
    for index, call in enumerate(trajectory.model_calls):
        if call.index != index or call.turn != index or call.id != f"{prefix}m{index}":
            raise ResumeRefusedError(f"the journal's model call {index} is out of order ({call.id!r})")
        if index >= len(trajectory.turns):
            raise ResumeRefusedError(f"the journal's model call {index} has no turn")
    answered: list[ModelCall] = []
    for call in trajectory.model_calls:
        if call.status == "failed" or call.incomplete_reason == INTERRUPTED:
            break
        ids = [str(item.get("call_id")) for item in call.output if item.get("type") == "function_call"]
        if ids != [f"call_{call.index}_{k}" for k in range(len(ids))]:
            # The loop names every function call itself: other ids were not written by it.
            raise ResumeRefusedError(
                f"the journal's model call {call.index} has tool-call ids the loop never gives"
            )
        answered.append(call)
    if not answered:
        raise ResumeRefusedError(
            "no model call was answered before the earlier attempt ended: nothing to resume"
        )
    tools = {tool.call_id: tool for tool in trajectory.tool_calls}
    for tool in tools.values():
        if tool.turn >= len(trajectory.model_calls):
            raise ResumeRefusedError(f"the journal's tool call {tool.call_id!r} belongs to no model call")
    return ReplayPlan(
        previous_rollout_id=previous_rollout_id,
        boundary=checkpoint.seq,
        turns=trajectory.turns[: len(answered)],
        calls=answered,
        tools=tools,
        model_cookies=dict(checkpoint.model_cookies),
        resource_cookies=dict(checkpoint.resource_cookies),
    )


@dataclass
class Replay:
    """The agent loop's side of a resume: answers from the journal while ``active``.

    Not thread-safe; it lives on the worker's event loop. Every method that finds
    the loop doing something the journal does not say raises ``ResumeRefusedError``
    (only while active: once the loop has left the journal's prefix, nothing of it
    is consulted again).
    """

    plan: ReplayPlan
    rollout_id: str
    active: bool = True
    replayed_calls: list[str] = field(default_factory=list)
    replayed_tools: list[str] = field(default_factory=list)
    rerun_cells: list[str] = field(default_factory=list)
    diverged: str | None = None

    def model_call(
        self, index: int, question: list[ResponseItem]
    ) -> tuple[ModelCall, list[str | None]] | None:
        """The recorded answer to model call ``index`` and the server's tool-call ids, if the journal has one.

        Raises:
            ResumeRefusedError: The question the loop built differs from the recorded one.
        """
        if not self.active or index >= len(self.plan.calls):
            return None
        recorded = self.plan.turns[index].input
        if question != recorded:
            raise ResumeRefusedError(
                f"replay diverged at model call {index}: the conversation rebuilt from the journal differs "
                "from the one recorded"
            )
        call = self.plan.calls[index]
        server_ids: list[str | None] = []
        for item in call.output:
            if item.get("type") == "function_call":
                tool = self.plan.tools.get(str(item.get("call_id")))
                server_ids.append(tool.server_call_id if tool is not None else None)
        replayed = call.model_copy(update={"id": f"{self.rollout_id}:m{index}"})
        self.replayed_calls.append(replayed.id)
        return replayed, server_ids

    def tool(self, call_id: str, name: str, arguments: str) -> ToolCall | None:
        """The recorded end of a tool call, if the journal holds it ended (else the replay is over).

        Raises:
            ResumeRefusedError: The journal holds a call of that id with another name or arguments.
        """
        if not self.active:
            return None
        recorded = self.plan.tools.get(call_id)
        if recorded is None or recorded.status not in _ENDED:
            return None
        if recorded.name != name or recorded.arguments != arguments:
            raise ResumeRefusedError(
                f"replay diverged at tool call {call_id}: the journal recorded {recorded.name} with other "
                "arguments"
            )
        return recorded

    def check_cell(self, call_id: str, recorded: ToolCall, status: str, output: str) -> None:
        """Compare a cell run again with its recorded run.

        Raises:
            ResumeRefusedError: Its status or output differs, or a tool call it made did.
        """
        if self.diverged is not None:
            raise ResumeRefusedError(self.diverged)
        if status != recorded.status or output != (recorded.output or ""):
            raise ResumeRefusedError(
                f"replay diverged at cell {call_id}: run again in a fresh executor, its output differs from "
                "the recorded one"
            )
        self.rerun_cells.append(call_id)

    def diverge(self, reason: str) -> None:
        """Note a divergence found where it cannot be raised (inside agent code's tool call)."""
        if self.diverged is None:
            self.diverged = reason

    def resumed_from(self) -> ResumedFrom:
        """What this replay did, for the trajectory."""
        return ResumedFrom(
            previous_rollout_id=self.plan.previous_rollout_id,
            boundary=self.plan.boundary,
            replayed_model_calls=list(self.replayed_calls),
            replayed_tool_calls=list(self.replayed_tools),
            rerun_cells=list(self.rerun_cells),
        )
