"""What the agent offers the model on the wire, and the names the calls it gets back go by.

Both sides of the sandbox's wall need these words: the worker's loop offers the
tools and renames the function calls an answer asks for (``call_<turn>_<k>``), the
supervisor names a black-box harness's calls the same way from the egress proxy's
capture, and the controller states the same tools to NeMo Gym and refuses a
dataset tool that takes a reserved name. Pure functions of protocol shapes; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollcage.protocol import (
    BashToolSpec,
    EditorToolSpec,
    ModelCall,
    PythonToolSpec,
    ResourceToolSpec,
    ResponseItem,
    ToolSpec,
)

__all__ = ["SUBMIT", "function_tools", "own_call_ids"]

SUBMIT = "submit"
"""The tool (a Python function in codeact) that ends a rollout with its answer; no dataset tool takes it."""


def function_tools(tools: Sequence[ToolSpec], *, codeact: bool) -> list[dict[str, Any]]:
    """The Responses-style function tools the loop offers the model (none in codeact: tools are functions).

    The Python tool comes first, then the resource tools in the input's order; every
    request of a rollout sends this list, so it can be rebuilt from ``input.json``.
    """
    if codeact:
        return []
    offered: list[dict[str, Any]] = []
    python = next((t for t in tools if isinstance(t, PythonToolSpec)), None)
    if python is not None:
        offered.append(
            {
                "type": "function",
                "name": python.name,
                "description": python.description,
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source to run."}},
                    "required": ["code"],
                },
            }
        )
    for spec in tools:
        if isinstance(spec, BashToolSpec | EditorToolSpec):
            offered.append(
                {
                    "type": "function",
                    "name": spec.name,
                    "description": spec.description,
                    "parameters": _BASH_PARAMETERS if isinstance(spec, BashToolSpec) else _EDITOR_PARAMETERS,
                }
            )
    for spec in tools:
        if isinstance(spec, ResourceToolSpec):
            offered.append(
                {
                    "type": "function",
                    "name": spec.name,
                    "description": spec.description,
                    "parameters": spec.parameters,
                    # Only when the row said: a tool that does not say goes out as it always did.
                    **({"strict": spec.strict} if spec.strict is not None else {}),
                }
            )
    return offered


_BASH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the session (its state is lost)."},
    },
}
"""Anthropic's bash tool's arguments."""

_EDITOR_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
            "description": "The command to run.",
        },
        "path": {"type": "string", "description": "Absolute path to a file or directory."},
        "file_text": {"type": "string", "description": "create: the content of the new file."},
        "old_str": {"type": "string", "description": "str_replace: the text to replace (exactly once)."},
        "new_str": {
            "type": "string",
            "description": "str_replace: the new text; insert: the text to insert.",
        },
        "insert_line": {"type": "integer", "description": "insert: the line after which to insert (0: top)."},
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "view: [start, end] lines, 1-based; end -1 for the rest of the file.",
        },
    },
    "required": ["command", "path"],
}
"""The arguments of Anthropic's and OpenHands' file editors."""


def own_call_ids(call: ModelCall) -> tuple[ModelCall, list[str | None]]:
    """``call`` with its function calls renamed ``call_<turn>_<k>``, and the server's ids in order.

    The model sees these ids from now on (they go back in the conversation); the
    server's own stay in ``call.response`` and in ``ToolCall.server_call_id``.
    """
    server_ids: list[str | None] = []
    items: list[ResponseItem] = []
    for item in call.output:
        if item.get("type") == "function_call":
            server_id = item.get("call_id")
            server_ids.append(server_id if isinstance(server_id, str) and server_id else None)
            item = {**item, "call_id": f"call_{call.index}_{len(server_ids) - 1}"}
        items.append(item)
    if not server_ids:
        return call, server_ids
    return call.model_copy(update={"output": items}), server_ids
