#!/usr/bin/env python3
"""cli-agent: a small command-line agent on the official openai SDK, run by rollcage as a ``command`` harness.

It knows nothing of rollcage but the environment every command harness gets:

* the task on stdin (instructions, a blank line, the input);
* the model at ``OPENAI_BASE_URL`` with ``OPENAI_API_KEY`` (the worker's loopback forwarder and the
  rollout's token: the real credential never enters the sandbox), its name in ``ROLLCAGE_MODEL``;
* the task's tools in ``ROLLCAGE_TOOLS`` (JSON: name, description, parameters), each called by
  POSTing its JSON arguments to ``$ROLLCAGE_TOOLS_URL/<name>``;
* optionally, ``ROLLCAGE_EVENTS_FD``: where it reports each tool call as a rollcage harness event,
  so the trajectory shows its tool calls and their outputs (marked as reported by the harness).

It also offers the model a ``python`` tool (the code runs in a subprocess, in the sandbox), loops
until the model answers without a tool call, and prints that answer on stdout. Install it into the
environment you run it with (``--harness-env``)::

    python3 -m venv ~/agent-env && ~/agent-env/bin/pip install openai
    install -m 755 examples/command-agent/agent.py ~/agent-env/bin/cli-agent
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from openai import OpenAI

MAX_TURNS = 16
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code; returns its stdout and stderr.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def report(event: dict[str, object]) -> None:
    """One rollcage harness event (nothing when the harness has no events descriptor)."""
    fd = os.environ.get("ROLLCAGE_EVENTS_FD")
    if fd:
        os.write(int(fd), (json.dumps(event) + "\n").encode())


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr)[-8000:]


def call_tool(name: str, arguments: dict[str, object]) -> str:
    request = urllib.request.Request(
        f"{os.environ['ROLLCAGE_TOOLS_URL']}/{name}",
        data=json.dumps(arguments).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
        },
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.read(1 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return f"error: HTTP {exc.code}: {exc.read(2000).decode('utf-8', 'replace')}"


def main() -> int:
    task = sys.stdin.read()
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    model = os.environ.get("ROLLCAGE_MODEL", "default")
    tools = [PYTHON_TOOL] + [
        {"type": "function", "function": {k: spec[k] for k in ("name", "description", "parameters")}}
        for spec in json.loads(os.environ.get("ROLLCAGE_TOOLS", "[]"))
    ]
    messages: list[dict[str, object]] = [{"role": "user", "content": task}]
    for _ in range(MAX_TURNS):
        # Token ids and log probabilities (vLLM's fields) are what a trainer needs: rollcage reads them
        # off the wire into each model call's evidence, whatever the agent does with them.
        reply = (
            client.chat.completions.create(
                model=model,
                messages=messages,
                tools=tools,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            .choices[0]
            .message
        )
        if not reply.tool_calls:
            print(reply.content or "")
            return 0
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            name, raw = call.function.name, call.function.arguments
            report({"type": "tool_start", "id": call.id, "name": name, "arguments": raw})
            arguments = json.loads(raw or "{}")
            output = (
                run_python(str(arguments.get("code", ""))) if name == "python" else call_tool(name, arguments)
            )
            report({"type": "tool_end", "id": call.id, "status": "completed", "output": output})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    print("cli-agent: no answer within the turn limit", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
