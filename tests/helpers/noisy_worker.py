"""A worker that talks too much: ``noisy_worker.py COUNT BYTES INPUT RESULT --checkpoint PATH``.

It sends COUNT model requests of about BYTES bytes each through the egress proxy
(whatever the answers), then waits to be stopped; on SIGTERM it publishes a
cancelled result. Standard library only (it reuses ``fake_worker``'s pieces), so it
starts fast, also inside the sandbox.
"""

from __future__ import annotations

import os
import sys
import time

from fake_worker import http_post, journal_append, mark, on_sigterm_publish_cancelled

if __name__ == "__main__":
    count, size, input_path, result_path, checkpoint = sys.argv[1], sys.argv[2], *sys.argv[3:5], sys.argv[-1]
    import json

    with open(input_path, "rb") as file:
        spec = json.load(file)
    journal_append(checkpoint, 1, {"kind": "start", "at": 1, "rollout_id": spec["rollout_id"]})
    on_sigterm_publish_cancelled(spec, result_path)
    model = spec["model"]
    for n in range(int(count)):
        payload = {
            "model": model["model"],
            "messages": [{"role": "user", "content": "x" * int(size)}],
            "n": n,
        }
        try:
            http_post(model["base_url"], model.get("uds"), "/chat/completions", payload, timeout=10)
        except OSError:
            pass  # refused once the budget is spent: keep talking, as a runaway agent would
    mark(os.path.join(os.path.dirname(os.path.abspath(result_path)), "workspace", "started"), "talked")
    time.sleep(600)
