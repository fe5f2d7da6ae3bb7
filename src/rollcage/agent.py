"""The agent loop: model call → actions → tool results → … until an answer or a limit.

Two action styles:

* ``function_calling``: tools are offered as function tools; one response may
  request several calls, which run concurrently (Python cells take turns on the
  one executor, HTTP tools run in parallel);
* ``codeact``: the model writes fenced Python; resource tools and ``submit`` are
  Python functions in the executor whose calls come back to this loop, so each is
  recorded, timed and checkpointed like any other tool call.

Every turn starts with a ``turn_start`` boundary (its question: the items added to
the conversation since the last model call, and the id of the model call it is
about to make), so a call still in flight when the rollout stops leaves a trace.
After every model response and every tool completion the loop emits a *boundary*
and waits until the boundary sink returns before taking its next action; the
worker makes that wait cover the journal's fsync. Each model call has an id
(``<rollout_id>:m<index>``) and belongs to exactly one turn (``<rollout_id>:t<index>``);
one that is cancelled in flight is recorded ``incomplete`` (``interrupted``). Calls a response asks for but
that are not run (the response was cut off, the tool-call budget is spent) end in
that response's own boundary, so however many calls a response holds, refusing
them costs one journal record.

Tool-call ids are the loop's own, unique by construction (``call_<turn>_<k>``):
servers omit ids or reuse them across turns, so the server's id is kept as
evidence (``ToolCall.server_call_id``, and the raw response) and never used as a key.
A call the loop cannot run as asked (arguments that are not a JSON object, a tool
that does not exist, Python without ``code``) is an unusable output and counts
against ``max_invalid_outputs``, once per response.

All state lives in the ``TrajectoryRecorder`` handed in, so whoever cancels the
loop still holds everything that happened.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollcage.errors import ModelError, ResumeRefusedError
from rollcage.http import PolicyCalls
from rollcage.protocol import (
    BashToolSpec,
    BoundaryRecord,
    EditorToolSpec,
    ModelCall,
    PythonToolSpec,
    ResourceToolSpec,
    ResponseItem,
    ResumedFrom,
    TerminationReason,
    ToolCall,
    ToolStatus,
    TurnStart,
    WorkerInput,
)
from rollcage.resume import Replay
from rollcage.trajectory import TrajectoryRecorder, arguments_json, message_text
from rollcage.wire import SUBMIT, function_tools, own_call_ids

__all__ = [
    "Agent",
    "AgentResult",
    "BoundarySink",
    "CellRunner",
    "ModelCaller",
    "ResourceCaller",
    "SweTools",
    "extract_code_blocks",
]

BoundarySink = Callable[[BoundaryRecord], Awaitable[None]]
"""Receives each boundary; the loop waits for it before its next action."""

_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


class ModelCaller(Protocol):
    """What the loop needs of the model client."""

    async def call(
        self,
        *,
        input: list[ResponseItem],
        instructions: str | None,
        tools: list[dict[str, Any]],
        index: int,
        id: str,
        turn: int,
    ) -> ModelCall:
        """Make one model call; raise a ``ModelError`` carrying ``.record`` on failure.

        **Cancellation:** the request in flight is abandoned and ``CancelledError``
        propagates; the interrupted call's record is then ``interrupted``.
        """
        ...

    @property
    def interrupted(self) -> ModelCall | None:
        """The record of the last call cancelled in flight (``incomplete``, ``interrupted``), if any."""
        ...

    @property
    def cookies(self) -> dict[str, str]:
        """Current model cookies."""
        ...


class ResourceCaller(Protocol):
    """What the loop needs of the HTTP resource tools."""

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[ToolStatus, str]:
        """Call one resource tool; return its status (failed: an error answer) and the text for the model.

        **Cancellation:** the request is abandoned and ``CancelledError`` propagates.
        """
        ...

    @property
    def cookies(self) -> dict[str, str]:
        """Current resource cookies."""
        ...


class CellRunner(Protocol):
    """What the loop needs of the Python executor: run one cell, text out."""

    async def run_cell(self, code: str, timeout_s: float) -> tuple[ToolStatus, str]:
        """Run ``code``; return the call status and the bounded text shown to the model.

        **Cancellation:** the cell is interrupted (the executor is stopped if it does not
        stop in time) and ``CancelledError`` propagates.
        """
        ...

    def prestart(self) -> None:
        """Start the executor in the background, if it is not running yet."""
        ...


class SweTools(Protocol):
    """What the loop needs of the ``bash`` tool and the file editor (both run in the executor's cage)."""

    async def run_bash(self, command: str | None, restart: bool, timeout_s: float) -> tuple[ToolStatus, str]:
        """Run one command in the rollout's shell session (after restarting it when ``restart``).

        **Cancellation:** the command is interrupted (the session killed if it will not stop) and
        ``CancelledError`` propagates.
        """
        ...

    async def edit(self, arguments: dict[str, Any], timeout_s: float) -> tuple[ToolStatus, str]:
        """Carry out one file editor call (``command``, ``path`` and the command's arguments).

        **Cancellation:** the editor's process is killed and ``CancelledError`` propagates.
        """
        ...


@dataclass(frozen=True)
class AgentResult:
    """How the loop ended."""

    termination_reason: TerminationReason
    final_answer: str | None


class Agent:
    """Runs one episode for one ``WorkerInput``.

    Args:
        spec: The validated worker input.
        model: The model client.
        resources: The resource tools (may be None when the input offers none).
        cells: The Python executor (may be None when the input offers no Python tool).
        recorder: Where every call is recorded (shared with the caller).
        boundary: Receives each boundary record; awaited before the next action.
        replay: An earlier attempt's journal to replay first (see ``rollcage.resume``); the
            loop emits a ``resumed`` boundary when it leaves the journal's prefix, and
            raises ``ResumeRefusedError`` while replaying if the replay diverges.
    """

    def __init__(
        self,
        spec: WorkerInput,
        *,
        model: ModelCaller,
        resources: ResourceCaller | None,
        cells: CellRunner | None,
        recorder: TrajectoryRecorder,
        boundary: BoundarySink,
        replay: Replay | None = None,
        swe: SweTools | None = None,
    ) -> None:
        """Bind the loop to its collaborators (``swe``: the bash tool and the file editor, if offered)."""
        self._replay = replay
        self._spec = spec
        self._model = model
        self._resources = resources
        self._cells = cells
        self._recorder = recorder
        self._boundary = boundary
        self._history: list[ResponseItem] = _initial_input(spec.input)
        self._asked = 0
        """How much of the history earlier turns' model calls have seen: the rest is the next question."""
        self._tool_count = 0
        self._invalid = 0
        self._python = next((t for t in spec.tools if isinstance(t, PythonToolSpec)), None)
        self._resource_specs = {t.name: t for t in spec.tools if isinstance(t, ResourceToolSpec)}
        self._bash = next((t for t in spec.tools if isinstance(t, BashToolSpec)), None)
        self._editor = next((t for t in spec.tools if isinstance(t, EditorToolSpec)), None)
        self._swe = swe
        # One lock for every tool that acts in the cage (cells, bash, the editor): they take turns in
        # call order, so a replay re-runs them in the order the journal recorded.
        self._cell_lock = asyncio.Lock()
        self._submitted: str | None = None
        self._bridged = 0
        self._cookies_seen: tuple[dict[str, str], dict[str, str]] = ({}, {})

    def attach_cells(self, cells: CellRunner) -> None:
        """Attach the executor after construction (its bridge is this agent's ``bridge``)."""
        self._cells = cells

    def _local(self, name: str) -> bool:
        """Whether ``name`` is a tool that acts in the executor's cage: re-run, not answered, on replay."""
        return any(
            spec is not None and spec.name == name for spec in (self._python, self._bash, self._editor)
        )

    async def run(self) -> AgentResult:
        """Run the episode to its end.

        Raises:
            ModelError: the model call failed (after the client's retries).
            ResumeRefusedError: replaying the journal diverged (only before the loop
                left the journal's prefix; the caller starts the rollout fresh).
            RollcageError: a tool failed in a way that ends the rollout.

        Cancellation:
            Safe at any await. Tool calls still running are left pending in the
            recorder; the caller marks them cancelled and builds the result.
        """
        if self._spec.agent.mode == "codeact":
            result = await self._run_codeact()
        else:
            result = await self._run_function_calling()
        # The journal held the whole episode (the attempt died after its last boundary).
        await self._leave_replay()
        return result

    # ------------------------------------------------------------------ function calling

    async def _run_function_calling(self) -> AgentResult:
        tools = function_tools(self._spec.tools, codeact=False)
        last_text: str | None = None
        calls = PolicyCalls(self._spec.agent.max_policy_calls)
        while calls.take():
            index = calls.spent - 1
            call, server_ids = await self._call_model(index, tools)
            pending = self._start_calls(call, server_ids)
            self._answered(call.output)
            text = _text_of(call.output)
            if text:
                last_text = text
            if call.status == "incomplete":
                # A response cut off at the token limit is not an action we can trust.
                reason = f"not run: the response was cut off ({call.incomplete_reason})"
                await self._emit("model_call", model_call=call, tool_calls=self._reject(pending, reason))
                if self._count_invalid():
                    return AgentResult("invalid_policy_output", last_text)
                continue
            if not pending:
                await self._emit("model_call", model_call=call, tool_calls=[])
                return AgentResult("completed", text)
            if self._tool_count + len(pending) > self._spec.agent.max_tool_calls:
                reason = "not run: the rollout's tool-call limit was reached"
                await self._emit("model_call", model_call=call, tool_calls=self._reject(pending, reason))
                return AgentResult("max_tool_calls", last_text)
            await self._emit("model_call", model_call=call, tool_calls=pending)
            self._tool_count += len(pending)
            malformed = await self._run_tool_calls(pending)
            if malformed and self._count_invalid():
                return AgentResult("invalid_policy_output", last_text)
        return AgentResult("max_policy_calls", last_text)

    def _start_calls(self, call: ModelCall, server_ids: list[str | None]) -> list[ToolCall]:
        """Record the response's function calls as pending (their ids are already the loop's own)."""
        items = [i for i in call.output if i.get("type") == "function_call"]
        return [
            self._recorder.start_tool_call(
                str(item["call_id"]),
                str(item.get("name", "")),
                str(item.get("arguments", "")),
                call.index,
                server_call_id=server_id,
            )
            for item, server_id in zip(items, server_ids, strict=True)
        ]

    async def _run_tool_calls(self, pending: list[ToolCall]) -> bool:
        """Run one response's calls concurrently; return whether any could not be run as asked.

        While replaying, the calls the journal holds ended go first (answered from it,
        cells re-run), and only then the replay ends and the others run for real: the
        replay stays a strict prefix of what the rollout does, whatever ended first.
        """
        malformed = False
        replay = self._replay
        answers = {c.call_id: replay.tool(c.call_id, c.name, c.arguments) for c in pending} if replay else {}

        async def one(call: ToolCall) -> None:
            nonlocal malformed
            arguments, problem = self._usable(call)
            if problem is not None:
                malformed = True
                await self._finish(call.call_id, "failed", f"error: {problem}")
                return
            recorded = answers.get(call.call_id)
            if recorded is None:
                status, output = await self._dispatch(call, arguments)
            elif self._local(call.name):
                # Cells, shell commands and edits are run again: that is how the cage's state comes back.
                status, output = await self._dispatch(call, arguments)
                assert self._replay is not None
                self._replay.check_cell(call.call_id, recorded, status, output)
            else:
                status, output = self._replayed(recorded)
            await self._finish(call.call_id, status, output)

        replayed = [call for call in pending if answers.get(call.call_id) is not None]
        fresh = [call for call in pending if answers.get(call.call_id) is None]
        if replayed:
            await _run_all(replayed, one)
        if fresh:
            await self._leave_replay()
            await _run_all(fresh, one)
        for call in pending:
            self._history.append(
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": self._recorder.get(call.call_id).output or "",
                }
            )
        return malformed

    def _usable(self, call: ToolCall) -> tuple[dict[str, Any], str | None]:
        """The call's arguments, or why the call cannot be run as the model wrote it."""
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            return {}, f"arguments are not valid JSON ({exc})"
        if not isinstance(arguments, dict):
            return {}, "arguments are not valid JSON (arguments must be a JSON object)"
        if self._python is not None and call.name == self._python.name:
            if not isinstance(arguments.get("code"), str):
                return {}, f"the {call.name} tool takes one string argument 'code'"
            return arguments, None
        if self._bash is not None and call.name == self._bash.name:
            if not isinstance(arguments.get("command"), str) and arguments.get("restart") is not True:
                return {}, f"the {call.name} tool takes a string argument 'command' (or 'restart': true)"
            return arguments, None
        if self._editor is not None and call.name == self._editor.name:
            if not isinstance(arguments.get("command"), str) or not isinstance(arguments.get("path"), str):
                return {}, f"the {call.name} tool takes string arguments 'command' and 'path'"
            return arguments, None
        if call.name in self._resource_specs and self._resources is not None:
            return arguments, None
        return {}, f"there is no tool named {call.name!r}"

    async def _dispatch(self, call: ToolCall, arguments: dict[str, Any]) -> tuple[ToolStatus, str]:
        if self._python is not None and call.name == self._python.name:
            return await self._run_cell(call.call_id, str(arguments["code"]))
        if self._local(call.name):
            return await self._run_swe(call.call_id, call.name, arguments)
        self._recorder.mark_started(call.call_id)
        return await self._call_resource(call.name, arguments)

    # ------------------------------------------------------------------ codeact

    async def _run_codeact(self) -> AgentResult:
        if self._cells is not None:
            self._cells.prestart()  # overlap the executor's start with the first model call
        last_text: str | None = None
        calls = PolicyCalls(self._spec.agent.max_policy_calls)
        while calls.take():
            index = calls.spent - 1
            call, server_ids = await self._call_model(index, [])
            text = _text_of(call.output)
            last_text = text or last_text
            self._answered(_as_input(call.output))
            # No function was offered: in codeact, tools are functions called from code. Every call
            # the model made anyway gets its refusal as output, as the API requires of every call.
            stray = self._reject(
                self._start_calls(call, server_ids),
                "not run: tools are Python functions here; call them from a ```python block",
            )
            blocks = extract_code_blocks(text) if call.status == "completed" else []
            pending = [
                self._recorder.start_tool_call(f"cell-{index}-{n}", "python", code, index)
                for n, code in enumerate(blocks)
            ]
            if call.status == "incomplete" or stray:
                cut = call.status == "incomplete"
                if cut or self._invalid >= self._spec.agent.max_invalid_outputs:
                    refused = self._reject(pending, "not run: the response was unusable", history=False)
                    await self._emit("model_call", model_call=call, tool_calls=[*stray, *refused])
                    if self._count_invalid():
                        return AgentResult("invalid_policy_output", last_text)
                    if cut:
                        self._history.append(_user("Your response was cut off. Reply with a shorter one."))
                    continue
                self._count_invalid()  # tolerated: the code blocks of the response still run
            if not blocks and not stray:
                await self._emit("model_call", model_call=call, tool_calls=[])
                return AgentResult("completed", text)
            if self._tool_count + len(blocks) > self._spec.agent.max_tool_calls:
                reason = "not run: the rollout's tool-call limit was reached"
                refused = self._reject(pending, reason, history=False)
                await self._emit("model_call", model_call=call, tool_calls=[*stray, *refused])
                return AgentResult("max_tool_calls", last_text)
            await self._emit("model_call", model_call=call, tool_calls=[*stray, *pending])
            observations: list[str] = []
            for cell in pending:
                self._tool_count += 1
                if self._submitted is not None:
                    await self._finish(cell.call_id, "failed", "not run: the answer was already submitted")
                    continue
                recorded = (
                    self._replay.tool(cell.call_id, cell.name, cell.arguments) if self._replay else None
                )
                if recorded is None:
                    await self._leave_replay()
                    status, output = await self._run_cell(cell.call_id, cell.arguments)
                else:
                    status, output = await self._rerun_cell(cell.call_id, cell.arguments, recorded)
                await self._finish(cell.call_id, status, output)
                observations.append(output)
            if self._submitted is not None:
                return AgentResult("completed", self._submitted)
            if observations:
                self._history.append(_user("Execution output:\n" + "\n\n".join(observations)))
        return AgentResult("max_policy_calls", last_text)

    async def bridge(self, name: str, kwargs: dict[str, Any]) -> str:
        """Carry out a tool call made from agent code (codeact), recording it as its own tool call.

        Cancellation:
            Propagates; the call stays pending in the recorder.
        """
        turn = max(0, len(self._recorder.model_calls) - 1)
        self._bridged += 1
        call_id = f"bridge-{turn}-{self._bridged}"
        arguments = arguments_json(kwargs)
        self._recorder.start_tool_call(call_id, name, arguments, turn)
        if self._replay is not None and self._replay.active:
            # Agent code re-run from the journal: its tool calls are answered from it, never sent again.
            return await self._bridge_replayed(call_id, name, arguments, kwargs)
        if name == SUBMIT:
            answer = kwargs.get("answer", next(iter(kwargs.values()), ""))
            self._submitted = str(answer)
            await self._finish(call_id, "completed", "submitted")
            return "submitted"
        if name not in self._resource_specs or self._resources is None:
            await self._finish(call_id, "failed", f"error: there is no tool named {name!r}")
            return f"error: there is no tool named {name!r}"
        self._tool_count += 1
        status, output = await self._call_resource(name, kwargs)
        await self._finish(call_id, status, output)
        return output

    async def _bridge_replayed(self, call_id: str, name: str, arguments: str, kwargs: dict[str, Any]) -> str:
        assert self._replay is not None
        try:
            recorded = self._replay.tool(call_id, name, arguments)
        except ResumeRefusedError as exc:
            recorded = None
            self._replay.diverge(str(exc))
        if recorded is None:
            # Raising here would only reach agent code: the cell's check raises it instead.
            self._replay.diverge(
                f"replay diverged at tool call {call_id}: the journal does not hold it ended"
            )
            await self._finish(call_id, "failed", "error: replay diverged")
            return "error: replay diverged"
        status, output = self._replayed(recorded)
        if name == SUBMIT:
            self._submitted = str(kwargs.get("answer", next(iter(kwargs.values()), "")))
        elif name in self._resource_specs:
            self._tool_count += 1
        await self._finish(call_id, status, output)
        return output

    # ------------------------------------------------------------------ replay

    def _replayed(self, recorded: ToolCall) -> tuple[ToolStatus, str]:
        """A tool call's recorded end, used instead of sending it again."""
        assert self._replay is not None
        self._replay.replayed_tools.append(recorded.call_id)
        return recorded.status, recorded.output or ""

    async def _rerun_cell(self, call_id: str, code: str, recorded: ToolCall) -> tuple[ToolStatus, str]:
        """Run a recorded cell again to restore the executor's state; its output must match the record."""
        assert self._replay is not None
        status, output = await self._run_cell(call_id, code)
        self._replay.check_cell(call_id, recorded, status, output)
        return status, output

    async def _leave_replay(self) -> None:
        """The loop is past the journal's prefix: say so in a boundary (the worker makes it durable)."""
        if self._replay is None or not self._replay.active:
            return
        self._replay.active = False
        resumed = self._replay.resumed_from()
        self._recorder.resumed_from = resumed
        await self._emit("resumed", resumed_from=resumed)

    # ------------------------------------------------------------------ shared steps

    async def _call_model(
        self, index: int, tools: list[dict[str, Any]]
    ) -> tuple[ModelCall, list[str | None]]:
        """One turn's model call, recorded with the loop's own tool-call ids; also the server's ids, in order.

        The turn's start is journaled first. A call cancelled in flight is recorded
        as the client kept it (``incomplete``, ``interrupted``) before the
        cancellation goes on; it gets no boundary of its own (the turn's start is
        its trace in the journal).
        """
        rollout = self._spec.rollout_id
        start = TurnStart(
            index=index,
            id=f"{rollout}:t{index}",
            model_call_id=f"{rollout}:m{index}",
            started_at=time.time(),
            input=self._history[self._asked :],
        )
        self._recorder.start_turn(start)
        await self._emit("turn_start", turn=start)
        replayed = self._replay.model_call(index, start.input) if self._replay is not None else None
        if replayed is not None:
            self._recorder.add_model_call(replayed[0])
            return replayed
        await self._leave_replay()
        try:
            call = await self._model.call(
                input=list(self._history),
                instructions=self._instructions(),
                tools=tools,
                index=index,
                id=start.model_call_id,
                turn=index,
            )
        except ModelError as exc:
            if exc.record is not None:
                self._recorder.add_model_call(exc.record)
                await self._emit("model_call", model_call=exc.record, tool_calls=[])
            raise
        except asyncio.CancelledError:
            interrupted = self._model.interrupted
            if interrupted is not None and interrupted.id == start.model_call_id:
                self._recorder.add_model_call(interrupted)
            raise
        call, server_ids = own_call_ids(call)
        self._recorder.add_model_call(call)
        return call, server_ids

    def _answered(self, items: list[ResponseItem]) -> None:
        """Add a model answer's items to the conversation; what follows them is the next turn's question."""
        self._history.extend(items)
        self._asked = len(self._history)

    def _instructions(self) -> str | None:
        if self._spec.agent.mode != "codeact":
            return self._spec.instructions
        functions = [f"{SUBMIT}(answer): submit your final answer and end the episode"]
        for spec in self._resource_specs.values():
            params = ", ".join(spec.parameters.get("properties", {}))
            functions.append(f"{spec.name}({params}): {spec.description}".rstrip(": "))
        preamble = (
            "Act by writing Python in ```python fenced blocks; they run in a persistent session and you "
            "see their output. These functions are defined there:\n- " + "\n- ".join(functions)
        )
        return f"{self._spec.instructions}\n\n{preamble}" if self._spec.instructions else preamble

    async def _run_cell(self, call_id: str, code: str) -> tuple[ToolStatus, str]:
        if self._cells is None:
            return "failed", "error: this task offers no Python executor"
        async with self._cell_lock:  # one kernel: cells take turns
            self._recorder.mark_started(call_id)
            return await self._cells.run_cell(code, self._spec.agent.tool_timeout_s)

    async def _run_swe(self, call_id: str, name: str, arguments: dict[str, Any]) -> tuple[ToolStatus, str]:
        """A bash command or an editor call, in the cage, taking its turn with the cells."""
        if self._swe is None:
            return "failed", f"error: the {name} tool is not available in this rollout"
        timeout_s = self._spec.agent.tool_timeout_s
        async with self._cell_lock:
            self._recorder.mark_started(call_id)
            if self._bash is not None and name == self._bash.name:
                command = arguments.get("command")
                restart = arguments.get("restart") is True
                return await self._swe.run_bash(
                    command if isinstance(command, str) else None, restart, timeout_s
                )
            return await self._swe.edit(arguments, timeout_s)

    async def _call_resource(self, name: str, arguments: dict[str, Any]) -> tuple[ToolStatus, str]:
        assert self._resources is not None
        status, text = await self._resources.call(name, arguments)
        limit = self._spec.agent.tool_output_limit
        if len(text) > limit:
            text = f"{text[:limit]}\n…[truncated {len(text) - limit} chars]"
        return status, text

    async def _finish(self, call_id: str, status: ToolStatus, output: str) -> None:
        done = self._recorder.finish_tool_call(call_id, status, output)
        await self._emit("tool_call", tool_calls=[done])

    def _reject(self, pending: list[ToolCall], reason: str, *, history: bool = True) -> list[ToolCall]:
        """End calls that will not run, without a boundary each: they go in their response's boundary.

        With ``history``, each refusal becomes the call's output in the conversation.
        """
        refused = [self._recorder.finish_tool_call(call.call_id, "failed", reason) for call in pending]
        if history:
            self._history.extend(
                {"type": "function_call_output", "call_id": call.call_id, "output": reason}
                for call in pending
            )
        return refused

    def _count_invalid(self) -> bool:
        """Count one unusable response; True when the tolerance is used up."""
        self._invalid += 1
        return self._invalid > self._spec.agent.max_invalid_outputs

    async def _emit(
        self,
        kind: Literal["turn_start", "model_call", "tool_call", "resumed"],
        *,
        turn: TurnStart | None = None,
        model_call: ModelCall | None = None,
        tool_calls: list[ToolCall] | None = None,
        resumed_from: ResumedFrom | None = None,
    ) -> None:
        model_cookies = dict(self._model.cookies)
        resource_cookies = dict(self._resources.cookies) if self._resources is not None else {}
        seen_model, seen_resource = self._cookies_seen
        record = BoundaryRecord(
            kind=kind,
            at=time.time(),
            turn=turn,
            model_call=model_call,
            tool_calls=tool_calls or [],
            model_cookies=model_cookies if model_cookies != seen_model else None,
            resource_cookies=resource_cookies if resource_cookies != seen_resource else None,
            resumed_from=resumed_from,
        )
        self._cookies_seen = (model_cookies, resource_cookies)
        await self._boundary(record)


async def _run_all(calls: list[ToolCall], one: Callable[[ToolCall], Coroutine[Any, Any, None]]) -> None:
    """Run ``one`` on every call concurrently; the first real failure escapes, not the group."""
    # A failing sibling must not hide the others' outputs: each call records its own
    # outcome, and only a RollcageError that ends the rollout escapes the group.
    try:
        async with asyncio.TaskGroup() as group:
            for call in calls:
                group.create_task(one(call))
    except BaseExceptionGroup as group_error:
        # Callers classify by exception type (infrastructure vs agent), so surface the
        # first real failure rather than the group that wraps it.
        raise _first_leaf(group_error) from group_error


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def extract_code_blocks(text: str) -> list[str]:
    """The fenced Python blocks of a message, in order."""
    return [m.group(1).strip("\n") for m in _CODE_BLOCK.finditer(text) if m.group(1).strip()]


def _initial_input(value: str | list[ResponseItem]) -> list[ResponseItem]:
    if isinstance(value, str):
        return [_user(value)]
    return [dict(item) for item in value]


def _user(text: str) -> ResponseItem:
    return {"type": "message", "role": "user", "content": text}


def _text_of(items: list[ResponseItem]) -> str:
    return "".join(message_text(i) for i in items if i.get("type") == "message")


def _as_input(items: list[ResponseItem]) -> list[ResponseItem]:
    """Model output items as they go back into the next request's input."""
    return [i for i in items if i.get("type") in ("message", "reasoning", "function_call")]
