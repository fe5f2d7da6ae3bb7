"""One rollout floods its egress proxy; the controller and the other rollouts do not notice.

Real pipeline: the controller (in a subprocess whose ``RLIMIT_NOFILE`` is lowered
to 256, so that exhausting it is cheap), the embedded scripted policy, the real
worker and executor under bubblewrap, the real egress proxy. The flooding agent's
cell forks five processes that open connections to the proxy socket as fast as
they can, each leaving a half-sent request, then sleeps past the deadline; two
victims run beside it. Before the proxy capped connections per rollout, this
exhausted the controller's descriptors and every rollout in flight failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.protocol import RolloutRecord, WorkerResult
from tests.helpers.paths import HELPERS
from tests.helpers.supervisor_env import requires_bwrap

pytestmark = [pytest.mark.bwrap, requires_bwrap(), pytest.mark.timeout(180)]

DEADLINE_S = 15.0

FLOOD = r"""
import json, os, socket, time
counts = {"connected": 0, "blocked": 0, "failed": 0}
pids = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        mine, held = dict(counts), []
        end = time.time() + 5
        while time.time() < end:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(0.2)
            try:
                s.connect("/run/rollcage/proxy.sock")
                s.sendall(b"POST /model/v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{")
            except socket.timeout:
                mine["blocked"] += 1
                s.close()
                continue
            except OSError:
                mine["failed"] += 1
                s.close()
                continue
            mine["connected"] += 1
            held.append(s)
        with open(f"/tmp/flood-{os.getpid()}.json", "w") as f:
            json.dump(mine, f)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
    with open(f"/tmp/flood-{pid}.json") as f:
        for key, value in json.load(f).items():
            counts[key] += value
print(json.dumps(counts))
"""

VICTIM = "import time\ntime.sleep(3)\nprint(6 * 7)"


def write_run(tmp_path: Path) -> tuple[Path, Path]:
    dataset = tmp_path / "dataset.jsonl"
    rows = [
        {"id": name, "input": "Compute 6*7 with Python.", "expected": "42", "agent": {"max_policy_calls": 4}}
        for name in ("victim-1", "flooder", "victim-2")
    ]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    victim = [{"tool_calls": [{"name": "python", "arguments": {"code": VICTIM}}]}, {"text": "42"}]
    policy = {
        "tasks": {
            "victim-1": victim,
            "victim-2": victim,
            "flooder": [
                {"tool_calls": [{"name": "python", "arguments": {"code": FLOOD}}]},
                {"tool_calls": [{"name": "python", "arguments": {"code": "import time\ntime.sleep(3600)"}}]},
                {"text": "42"},
            ],
        }
    }
    script = tmp_path / "policy.json"
    script.write_text(json.dumps(policy))
    return dataset, script


def test_a_rollout_flooding_the_proxy_starves_neither_the_controller_nor_its_neighbours(
    tmp_path: Path,
) -> None:
    dataset, policy = write_run(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(HELPERS / "flood_run.py"),
            "256",
            str(dataset),
            str(out),
            str(policy),
            str(DEADLINE_S),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["nofile"] == 256 and report["exit_code"] == 0, report
    assert "Traceback" not in done.stderr and "Invalid file descriptor" not in done.stderr, done.stderr[
        -3000:
    ]
    assert report["fds_after"] <= report["fds_before"], report  # nothing leaked in the controller

    records = {
        r.task_id: r
        for r in map(RolloutRecord.model_validate_json, (out / "rollouts.jsonl").read_bytes().splitlines())
    }
    assert set(records) == {"victim-1", "flooder", "victim-2"}  # one record (and receipt) each
    for name in ("victim-1", "victim-2"):
        victim = records[name]
        assert (victim.outcome, victim.reward) == ("completed", 1.0), victim.receipt.outcome_reason
        assert victim.receipt.proxy_connections_refused == 0
    flooder = records["flooder"]
    receipt = flooder.receipt
    assert flooder.outcome == "timeout" and receipt.deadline_fired and receipt.cleanup_confirmed
    assert (Path(flooder.rollout_dir) / "receipt.json").exists()
    # The deadline held: its first signal went out at once, however busy the proxy was.
    assert receipt.signals_sent[0].at - (receipt.started_at + DEADLINE_S) < 5.0
    assert receipt.proxy_connections_refused is not None and receipt.proxy_connections_refused > 0
    calls = WorkerResult.model_validate_json((Path(flooder.rollout_dir) / "result.json").read_bytes())
    (flood,) = [
        json.loads(c.output) for c in calls.trajectory.tool_calls if c.output and "connected" in c.output
    ]
    # More connections than the controller has descriptors: each was refused at accept (or held
    # within the rollout's share) and closed, never piled up in the controller.
    assert flood["connected"] > 256, flood
