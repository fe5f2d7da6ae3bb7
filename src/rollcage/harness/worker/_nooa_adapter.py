"""rollcage's NOOA adapter: one rollout's task, run by NOOA's CodeAct agent (under NOOA's own Python).

Standalone on purpose: NOOA needs Python >= 3.12 and its own dependencies (litellm), so this
file runs under the harness environment's interpreter, where rollcage is not installed. It uses
the standard library and NOOA only, and never imports rollcage. The worker starts it inside the
sandbox (in the executor's cage) with::

    stdin                 the task, as JSON: task, instructions, model, api, temperature, top_p,
                          max_tokens, max_iterations, tools [{name, description, parameters}]
    OPENAI_BASE_URL       the worker's loopback forwarder (the model, through the egress proxy)
    OPENAI_API_KEY        the rollout's token for the forwarder (not the model's credential)
    ROLLCAGE_TOOLS_URL    where a tool call is posted: {ROLLCAGE_TOOLS_URL}/<tool name>, JSON arguments
    ROLLCAGE_EVENTS_FD    where its events go (one JSON object a line; see rollcage.harness._events)

The task becomes a generated agent method ``solve(task: str) -> str`` whose docstring asks for
the answer; the instructions are the agent's docstring (its system prompt); each resource tool
is a Python function in NOOA's execution context. NOOA's events map to rollcage's:

    ToolCallEvent        -> tool_start   (NOOA's input-inspection prefill, its synthetic first turn,
                                          is marked synthetic: no model call asked for it)
    PythonOutput         -> tool_end     (execute_python's output)
    AfterTurn            -> tool_end     for calls that produce no PythonOutput (return_result)
    the returned value   -> answer
    GenerationError etc. -> error

SIGTERM cancels the episode: NOOA unwinds (its own ``finally`` blocks run), the events so far
are flushed, ``{"type": "error", "message": "cancelled ..."}`` is written, and the process exits
with 143. Exit codes: 0 answered, 1 failed, 2 bad task input, 143 cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import keyword
import os
import signal
import sys
import types
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["main"]

_OUTPUT_CHARS = 256 * 1024
_TOOL_TIMEOUT_S = 60.0
_TOOL_RESPONSE_BYTES = 1 << 20
_MODULE = "rollout_task"
_METHOD_DOC = (
    "Solve the task given in `task` and return the final answer, exactly in the form the task asks for, "
    "with return_result(...)."
)


class _Events:
    """Writes events, one line each, to the worker's descriptor (nothing if there is none)."""

    def __init__(self) -> None:
        fd = os.environ.get("ROLLCAGE_EVENTS_FD")
        self._out = os.fdopen(int(fd), "w", buffering=1, encoding="utf-8") if fd else None

    def emit(self, **event: Any) -> None:
        if self._out is None:
            return
        try:
            self._out.write(json.dumps(event, ensure_ascii=False, default=str) + "\n")
            self._out.flush()
        except (OSError, ValueError):
            self._out = None  # the worker is gone: nothing more to report


def _text(value: Any, limit: int = _OUTPUT_CHARS) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def _make_tool(spec: dict[str, Any], url: str, token: str) -> Any:
    """A Python function that posts its arguments to the tool's route and returns the answer."""
    name = str(spec["name"])
    parameters = spec.get("parameters") or {}
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    names = [str(p) for p in properties] if isinstance(properties, dict) else []
    names = [p for p in names if p.isidentifier() and not keyword.iskeyword(p)]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    target = f"{url}/{urllib.parse.quote(name, safe='')}"

    def tool(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(names):
            raise TypeError(f"{name}() takes {len(names)} positional arguments ({', '.join(names)})")
        body = dict(zip(names, args, strict=False))
        body.update(kwargs)
        request = urllib.request.Request(
            target,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            method="POST",
        )
        try:
            with opener.open(request, timeout=_TOOL_TIMEOUT_S) as response:
                text = response.read(_TOOL_RESPONSE_BYTES).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode("utf-8", "replace")
            return f"error: HTTP {exc.code} from {name}: {detail}"
        try:
            return json.loads(text)
        except ValueError:
            return text

    tool.__name__ = tool.__qualname__ = name
    tool.__module__ = _MODULE
    tool.__doc__ = str(spec.get("description") or f"The {name} tool.")
    tool.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in names]
    )
    return tool


def _build_agent(task: dict[str, Any]) -> Any:
    """The agent: a class made in a module of its own, so NOOA's context shows the tools and nothing else."""
    from nooa import Agent, strategy
    from nooa.config.strategy_config import CodeActConfig
    from nooa.strategies import CodeActStrategy
    from nooa.unifiedllm.registry import get_llm_client

    keys = ("temperature", "top_p", "max_tokens")
    sampling = {key: task[key] for key in keys if task.get(key) is not None}
    llm = get_llm_client(
        f"openai/{task['model']}",
        client_type="responses" if task.get("api") == "responses" else "completion",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
    )
    config = CodeActConfig(max_iterations=int(task.get("max_iterations") or 16), **sampling)
    module = types.ModuleType(_MODULE)
    sys.modules[_MODULE] = module
    helpers = {
        "_Agent": Agent,
        "_strategy": strategy,
        "_CodeAct": CodeActStrategy,
        "_LLM": llm,
        "_CONFIG": config,
    }
    module.__dict__.update(helpers)
    module.__dict__["_agentdoc_hidden_names"] = {*helpers, "_agentdoc_hidden_names"}
    url, token = os.environ.get("ROLLCAGE_TOOLS_URL", ""), os.environ["OPENAI_API_KEY"]
    for spec in task.get("tools") or []:
        name = str(spec.get("name", ""))
        if name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_"):
            module.__dict__[name] = _make_tool(spec, url, token)
    instructions = task.get("instructions") or "You are an agent that solves tasks with Python."
    source = (
        "class RolloutAgent(_Agent, llm=_LLM):\n"
        f"    {json.dumps(instructions)}\n"
        "\n"
        "    @_strategy(_CodeAct(config=_CONFIG))\n"
        "    async def solve(self, task: str) -> str:\n"
        f"        {json.dumps(_METHOD_DOC)}\n"
        "        ...\n"
    )
    exec(compile(source, f"<{_MODULE}>", "exec"), module.__dict__)
    return module.__dict__["RolloutAgent"]()


class _Relay:
    """NOOA's events, as rollcage's (see the module docstring)."""

    def __init__(self, events: _Events) -> None:
        self._events = events
        self._open: dict[str, Any] = {}

    def __call__(self, event: Any) -> None:
        kind = getattr(event, "event_type", type(event).__name__)
        if kind == "ToolCallEvent" and getattr(event, "result", None) is None:
            call_id = str(event.tool_call_id)
            if call_id in self._open:
                return
            self._open[call_id] = event
            self._events.emit(
                type="tool_start",
                id=call_id,
                name=str(event.name),
                arguments=_text(event.arguments),
                synthetic=bool((event.metadata or {}).get("prefill")),
            )
        elif kind == "PythonOutput":
            call_id = str(event.tool_call_id)
            self._open.pop(call_id, None)
            parts = [event.stdout, event.stderr, event.error]
            outcome = str(getattr(event.execution_status, "value", event.execution_status))
            self._events.emit(
                type="tool_end",
                id=call_id,
                status="completed" if outcome == "complete" else "failed",
                output=_text("".join(part for part in parts if part)),
            )
        elif kind == "AfterTurn":
            self.close_open(failed=not bool(getattr(event, "success", False)) and not event.is_final)

    def close_open(self, *, failed: bool) -> None:
        """End the calls that produce no PythonOutput (return_result): with NOOA's result, if it set one."""
        for call_id, event in list(self._open.items()):
            result = getattr(event, "result", None)
            content = getattr(result, "content", None) if result is not None else None
            self._events.emit(
                type="tool_end",
                id=call_id,
                status="failed" if failed else "completed",
                output=_text(content if content is not None else ""),
            )
        self._open.clear()


async def _episode(task: dict[str, Any], events: _Events) -> int:
    agent = _build_agent(task)
    relay = _Relay(events)
    agent.event_manager.on("*", relay)
    solving = asyncio.ensure_future(agent.solve(str(task.get("task", ""))))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, solving.cancel)
    loop.add_signal_handler(signal.SIGINT, solving.cancel)
    try:
        answer = await solving
    except asyncio.CancelledError:
        relay.close_open(failed=True)
        events.emit(type="error", message="cancelled by SIGTERM: NOOA's episode stopped where it was")
        return 128 + signal.SIGTERM
    except Exception as exc:  # NOOA's GenerationError and anything it lets through
        relay.close_open(failed=True)
        events.emit(type="error", message=f"{type(exc).__name__}: {exc}"[:2000])
        print(f"rollcage nooa adapter: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    relay.close_open(failed=False)
    if answer is not None:
        events.emit(type="answer", text=_text(answer))
    return 0


def main() -> int:
    """Read the task from stdin, run it, report; the exit code."""
    events = _Events()
    try:
        task = json.loads(sys.stdin.read())
        if not isinstance(task, dict) or not task.get("model"):
            raise ValueError("the task must be a JSON object with 'model'")
    except ValueError as exc:
        events.emit(type="error", message=f"bad task input: {exc}")
        return 2
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return asyncio.run(_episode(task, events))


if __name__ == "__main__":
    sys.exit(main())
