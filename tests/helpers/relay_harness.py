"""A command harness that relays one tool call: the black box the warm-harness tests run.

It asks the model once, reports one tool call on its events descriptor (which the worker
relays to the supervisor as a boundary), asks again and answers. With the second call
hanging (the policy's doing), the rollout stands still until it is stopped.
"""

from __future__ import annotations

import textwrap

__all__ = ["relay_harness_code"]

_HARNESS = """
import json, os, urllib.request
# MARKER
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def ask():
    body = {"model": os.environ["ROLLCAGE_MODEL"], "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        },
        method="POST",
    )
    with OPENER.open(request, timeout=300) as response:
        response.read()
events = int(os.environ["ROLLCAGE_EVENTS_FD"])
def report(**event):
    os.write(events, (json.dumps(event) + "\\n").encode())
ask()
report(type="tool_start", id="probe-1", name="probe", arguments="{}")
report(type="tool_end", id="probe-1", status="completed", output="probed")
ask()
report(type="answer", text="done")
"""


def relay_harness_code(marker: str) -> str:
    """The harness's ``python -c`` program, carrying ``marker`` (to find its process by)."""
    return textwrap.dedent(_HARNESS).replace("MARKER", marker)
