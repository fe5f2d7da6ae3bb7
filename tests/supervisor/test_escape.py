"""The escape suite: agent cells and ``solution.py`` files written to break out, through the real pipeline.

One run of the controller (real supervisor, bubblewrap, worker, Python executor,
scripted policy, the bundled code-fn environment) plays one dataset row per
probe, so the whole suite costs one run. Each probe is the agent's own code: a
codeact cell, or a ``solution.py`` that the grader imports. The run's budgets are
small so the bombs end quickly; victim rows run beside them and must finish
untouched. Every test is named after its probe and says which probe failed. Under
pytest-xdist the first worker to need the run makes it and the others read it (a
file under a lock: ``xdist_group`` does not keep a module on one worker here).

The whole suite runs twice: agent code on the host's system view (``host``), and agent code in a task
image's copy-on-write root (``image``, root only: tests/helpers/task_images.py, with the host's Python,
WorkingDir ``/rollout/workspace`` so that findings land where they always do). In the image run every
row names the image but the ``jupyter`` victim (a task image has no ipykernel).

To check that a probe can fail, disable its defence and watch it go red, e.g.
``ROLLCAGE_ESCAPE_WEAKEN=executor_cage=shared pytest tests/supervisor/test_escape.py``
(fields of :class:`rollcage.supervisor.BwrapSandbox`).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from rollcage.budgets import WEAK_MECHANISMS
from rollcage.controller import Controller, RunConfig
from rollcage.durable import read_journal
from rollcage.errors import ConfigError
from rollcage.images import STORE_ENV
from rollcage.protocol import BudgetName, RolloutRecord
from rollcage.supervisor import BwrapSandbox
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.task_images import TaskImage, make_task_image
from tests.helpers.waiting import processes_mentioning

pytestmark = [
    pytest.mark.bwrap,
    requires_bwrap(),
    pytest.mark.timeout(180),
]

MIB = 1 << 20
BUDGETS: dict[str, Any] = {
    "memory_bytes": 384 * MIB,
    "max_processes": 128,
    "workspace_bytes": 16 * MIB,
    "workspace_inodes": 1000,
    "tmp_size_bytes": 16 * MIB,
    "tmp_inodes": 1000,
    "shm_bytes": 8 * MIB,
    "shm_inodes": 200,
    "budget_poll_s": 0.2,
}
SECRET_VAR = "ROLLCAGE_ESCAPE_SECRET"


@dataclass(frozen=True)
class Probe:
    """One row of the run: the agent's code (cells) and, for grader probes, the hidden tests."""

    cells: list[str]
    tests: list[dict[str, str]] | None = None
    backend: str = "repl"
    expected: str = "done"

    def row(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": name,
            "input": f"probe {name}",
            "agent": {"mode": "codeact", "max_policy_calls": len(self.cells) + 1, "tool_timeout_s": 5},
            "executor": {"backend": self.backend},
            "model": {"max_retries": 0},
        }
        if self.tests is None:
            row["expected"] = self.expected
        else:
            row["environment"] = "code-fn"
            row["expected"] = {"function": "f", "tests": self.tests, "timeout_s": 10}
        return row


def _solution(source: str) -> str:
    """A cell that writes ``source`` as solution.py (for the grader to import)."""
    return f"open('solution.py', 'w').write({textwrap.dedent(source)!r})\nprint('written')"


FINDINGS = "findings = {}\n"
SAVE = "\nimport json\njson.dump(findings, open('findings.json', 'w'))\nprint(findings)"
SUBMIT = 'submit("done")'
WORKER_CMDLINE = textwrap.dedent("""\
    import os
    def _cmd(pid):
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        except OSError:
            return "?"
    """)

PROBES: dict[str, Probe] = {
    # ------------------------------------------------------------------ the network and the host
    "network": Probe(
        [
            FINDINGS
            + textwrap.dedent("""\
            import os, socket
            for name, address in {"loopback": ("127.0.0.1", @PORT@), "external": ("1.1.1.1", 53)}.items():
                try:
                    socket.create_connection(address, timeout=2).close()
                    findings[name] = "connected"
                except OSError as exc:
                    findings[name] = f"refused: {exc}"
            try:
                socket.getaddrinfo("example.com", 80)
                findings["dns"] = "resolved"
            except OSError as exc:
                findings["dns"] = f"refused: {exc}"
            findings["proxy_socket_visible"] = os.path.exists("/run/rollcage/proxy.sock")
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    "secrets": Probe(
        [
            FINDINGS
            + textwrap.dedent("""\
            import os
            findings["env"] = dict(os.environ)
            environs = []
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        environs.append(open(f"/proc/{pid}/environ", "rb").read().decode("latin-1"))
                    except OSError:
                        pass
            findings["proc_environ"] = environs
            targets = {"host_file": "@SECRET_FILE@", "dataset": "@DATASET@", "shadow": "/etc/shadow"}
            for name, path in targets.items():
                try:
                    findings[name] = open(path).read()
                except OSError as exc:
                    findings[name] = f"refused: {exc}"
            for directory in ("/root", "/home", "@HOST_DIR@"):
                try:
                    findings[directory] = os.listdir(directory)
                except OSError as exc:
                    findings[directory] = f"refused: {exc}"
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    "setuid": Probe(
        [
            FINDINGS
            + textwrap.dedent("""\
            import subprocess
            lines = open("/proc/self/status").read().splitlines()
            status = dict(line.split(":\\t", 1) for line in lines if ":\\t" in line)
            findings["no_new_privs"] = status.get("NoNewPrivs", "").strip()
            findings["cap_eff"] = status.get("CapEff", "").strip()
            run = subprocess.run(
                ["/usr/bin/su", "-c", "id -u > /tmp/su-ran", "root"],
                capture_output=True, text=True, stdin=subprocess.DEVNULL,
            )
            findings["su"] = run.returncode
            try:
                findings["su_ran"] = open("/tmp/su-ran").read()
            except OSError:
                findings["su_ran"] = None
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    # ------------------------------------------------------------------ the worker and its evidence
    "journal-forgery": Probe(
        [
            FINDINGS
            + textwrap.dedent("""\
            import os
            forged = '{"seq": 99, "kind": "model_call", "forged": true}\\n'
            for path in ("/rollout/checkpoint.jsonl", "/rollout/result.json", "/rollout/input.json",
                         "/rollout/.result.json.forged.tmp"):
                try:
                    with open(path, "a") as file:
                        file.write(forged)
                    findings[path] = "wrote"
                except OSError as exc:
                    findings[path] = f"refused: {exc}"
            try:
                findings["listing"] = os.listdir("/rollout")
            except OSError as exc:
                findings["listing"] = f"refused: {exc}"
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    "ptrace": Probe(
        [
            FINDINGS
            + WORKER_CMDLINE
            + textwrap.dedent("""\
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
                seen = {"cmd": _cmd(pid)}
                if libc.ptrace(16, int(pid), 0, 0) == 0:  # PTRACE_ATTACH
                    seen["attach"] = "attached"
                    libc.ptrace(17, int(pid), 0, 0)  # PTRACE_DETACH
                else:
                    seen["attach"] = f"refused: errno {ctypes.get_errno()}"
                try:
                    open(f"/proc/{pid}/mem", "rb").close()
                    seen["mem"] = "opened"
                except OSError as exc:
                    seen["mem"] = f"refused: {exc}"
                try:
                    seen["fd"] = os.listdir(f"/proc/{pid}/fd")
                except OSError as exc:
                    seen["fd"] = f"refused: {exc}"
                findings[pid] = seen
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    "kill-worker": Probe(
        [
            FINDINGS
            + WORKER_CMDLINE
            + textwrap.dedent("""\
            import signal
            for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
                findings[pid] = _cmd(pid)
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.kill(int(pid), sig)
                    except OSError:
                        pass
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    "kill-1": Probe(["import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')", SUBMIT]),
    "daemon": Probe(
        [
            textwrap.dedent("""\
            import subprocess, sys
            code = "import os, time\\nif os.fork():\\n    os._exit(0)\\nos.setsid()\\n"
            code += "time.sleep(600)  # @MARKER@"
            subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            print("left a daemon")
            """),
            SUBMIT,
        ]
    ),
    "writable-places": Probe(
        [
            FINDINGS
            + textwrap.dedent("""\
            import os
            # Every mount point, its parent, and the directories a cage's tree is made of.
            places = {"/", "/run", "/run/rollcage", "/rollout", "/dev", "/var/tmp", "/home", "/etc", "/usr"}
            for line in open("/proc/self/mountinfo"):
                point = line.split()[4]
                places.update({point, os.path.dirname(point)})
            writable = []
            for place in sorted(places):
                if place.startswith(("/proc", "/sys")) or not os.path.isdir(place):
                    continue
                made = os.path.join(place, ".rollcage-probe")
                try:
                    os.mkdir(made)
                except OSError:
                    continue
                os.rmdir(made)
                writable.append(place)
            findings["writable"] = writable
            """)
            + SAVE,
            SUBMIT,
        ]
    ),
    # ------------------------------------------------------------------ budgets
    "fork-bomb": Probe(
        [
            textwrap.dedent("""\
            import os, time
            forks = 0
            try:
                while forks < 5000:
                    if os.fork() == 0:
                        time.sleep(15)
                        os._exit(0)
                    forks += 1
            except OSError as exc:
                print("refused after", forks, exc)
            """),
            SUBMIT,
        ]
    ),
    "memory": Probe(
        [
            textwrap.dedent("""\
            import subprocess, sys
            hog = "b = bytearray(200 << 20)\\nfor i in range(0, len(b), 4096):\\n    b[i] = 1\\n"
            hog += "import time\\ntime.sleep(15)"
            procs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(3)]
            print([p.wait() for p in procs])
            """),
            SUBMIT,
        ]
    ),
    "disk-fill": Probe(
        [
            textwrap.dedent("""\
            written = 0
            try:
                with open("fill.bin", "wb") as file:
                    for _ in range(64):
                        file.write(b"x" * (1 << 20))
                        file.flush()
                        written += 1
            except OSError as exc:
                print("stopped after", written, "MiB:", exc)
            """),
            SUBMIT,
        ]
    ),
    "inode-fill": Probe(
        [
            textwrap.dedent("""\
            import os
            os.makedirs("many", exist_ok=True)
            made = 0
            try:
                for i in range(5000):
                    open(f"many/{i}", "w").close()
                    made += 1
            except OSError as exc:
                print("stopped after", made, exc)
            """),
            SUBMIT,
        ]
    ),
    "tmp-fill": Probe(
        [
            "try:\n    open('/tmp/fill', 'wb').write(b'x' * (64 << 20))\nexcept OSError as e:\n    print(e)",
            SUBMIT,
        ]
    ),
    "shm-fill": Probe(
        [
            "try:\n    open('/dev/shm/fill', 'wb').write(b'x' * (32 << 20))\n"
            "except OSError as e:\n    print(e)",
            SUBMIT,
        ]
    ),
    # ------------------------------------------------------------------ the grader imports solution.py
    "grader-remount": Probe(
        [
            _solution("""\
            import os, subprocess
            for command in (["mount", "-o", "remount,bind,rw", "/"], ["mount", "-o", "remount,rw", "/var"]):
                subprocess.run(command, capture_output=True)
            for path in ("@HOST_FILE@", "/var/tmp/@TOKEN@"):
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    open(path, "w").write("pwned")
                except OSError:
                    pass
            def f():
                return 1
            """),
            SUBMIT,
        ],
        tests=[{"call": "f()", "expect": "1"}],
    ),
    "grader-host-read": Probe(
        [
            _solution("""\
            import os
            def shadow():
                try:
                    return open("/etc/shadow").read()[:150]
                except OSError as exc:
                    return str(exc)
            def listing(path):
                try:
                    return sorted(os.listdir(path))
                except OSError as exc:
                    return str(exc)
            def f():
                return 0
            """),
            SUBMIT,
        ],
        tests=[
            {"call": "shadow()", "expect": "''"},
            {"call": "listing('/')", "expect": "[]"},
            {"call": "listing('/root')", "expect": "[]"},
            {"call": "listing('@HOST_DIR@')", "expect": "[]"},
        ],
    ),
    "grader-reward-hack": Probe(
        [
            _solution("""\
            import ast, json, os
            answers = {}
            for path in ("@DATASET@", "../dataset.jsonl", "/work/dataset.jsonl"):
                try:
                    lines = open(path).read().splitlines()
                except OSError:
                    continue
                for line in lines:
                    expected = json.loads(line).get("expected")
                    for test in expected.get("tests", []) if isinstance(expected, dict) else []:
                        answers[test["call"]] = ast.literal_eval(test["expect"])
            def secret_answer():
                return answers.get("secret_answer()")
            """),
            SUBMIT,
        ],
        tests=[{"call": "secret_answer()", "expect": "'@TOKEN@'"}],
    ),
    # ------------------------------------------------------------------ victims: honest work beside them
    "victim": Probe(["print(6 * 7)", SUBMIT]),
    # A cell past its timeout is interrupted (SIGINT to the cage's group) and the session survives it.
    "victim-interrupt": Probe(["x = 41", "while True:\n    pass", "submit(str(x + 1))"], expected="42"),
    "victim-jupyter": Probe(
        ["x = 41\nimport os\nprint(os.listdir('/rollout'))", "while True:\n    pass", "submit(str(x + 1))"],
        backend="jupyter",
        expected="42",
    ),
    "victim-2": Probe(["import time\ntime.sleep(1)\nprint('slow but fine')", SUBMIT]),
    "grader-victim": Probe(
        [_solution("def f():\n    return 1\n"), SUBMIT], tests=[{"call": "f()", "expect": "1"}]
    ),
}


@dataclass
class EscapeRun:
    """What the one run left: records by probe, and what the host looked like."""

    records: dict[str, RolloutRecord]
    host_dir: Path
    host_file: Path
    secret: str
    secret_file_text: str
    marker: str
    token: str
    mounts_before: set[str]
    mounts_after: set[str]
    refused: str | None
    """What the same run said when its budgets were required (``require_budgets``); ``None``: it ran."""
    view: str = "host"
    """Where agent code ran: the host's system view, or a task image's root (``image``)."""

    def record(self, probe: str) -> RolloutRecord:
        assert probe in self.records, f"probe {probe}: no record (the run lost it)"
        return self.records[probe]

    def to_json(self) -> str:
        return json.dumps(
            {
                "records": [r.model_dump_json() for r in self.records.values()],
                "host_dir": str(self.host_dir),
                "host_file": str(self.host_file),
                "secret": self.secret,
                "secret_file_text": self.secret_file_text,
                "marker": self.marker,
                "token": self.token,
                "mounts_before": sorted(self.mounts_before),
                "mounts_after": sorted(self.mounts_after),
                "refused": self.refused,
                "view": self.view,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> EscapeRun:
        data = json.loads(text)
        records = [RolloutRecord.model_validate_json(r) for r in data.pop("records")]
        return cls(
            records={r.task_id: r for r in records},
            host_dir=Path(data.pop("host_dir")),
            host_file=Path(data.pop("host_file")),
            mounts_before=set(data.pop("mounts_before")),
            mounts_after=set(data.pop("mounts_after")),
            **data,
        )

    def findings(self, probe: str) -> dict[str, Any]:
        path = Path(self.record(probe).rollout_dir) / "workspace" / "findings.json"
        assert path.exists(), (
            f"probe {probe}: the probe wrote no findings ({self.record(probe).receipt.outcome_reason})"
        )
        found: dict[str, Any] = json.loads(path.read_text())
        return found


def _weakened() -> dict[str, Any]:
    """Defences to switch off (ROLLCAGE_ESCAPE_WEAKEN=field=value,...), to see the probes go red."""
    fields: dict[str, Any] = {}
    for pair in filter(None, os.environ.get("ROLLCAGE_ESCAPE_WEAKEN", "").split(",")):
        name, _, value = pair.partition("=")
        fields[name.strip()] = value.strip()
    return fields


def _mounts(base: Path) -> set[str]:
    """Mount points the supervisor may have made for this run: the rollouts' private directories (named
    for the rollout) and workspaces. Other tests' rollouts may mount theirs meanwhile."""
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        points = {line.split()[4] for line in file}
    ours = tuple(f"/rollcage-{name}-s0-t0-" for name in PROBES)
    return {p for p in points if any(tag in p for tag in ours) or p.startswith(str(base))}


@pytest.fixture(scope="session", params=["host", "image"])
def escape(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> EscapeRun:
    """The one run per view, once per test session: pytest-xdist workers share it through a file, under a
    lock."""
    view: str = request.param
    if view == "image" and os.geteuid() != 0:
        pytest.skip("optional: agent code in a task image needs root (the supervisor mounts its root)")
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, above every worker's
    result = shared / f"escape-run-{view}.json"
    with open(shared / f"escape-run-{view}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if result.exists():
                return EscapeRun.from_json(result.read_text())
            base = tmp_path_factory.mktemp(f"escape-{view}")
            if view == "image":
                with _image_store(base / "store"):
                    run = _run_escape(base, _escape_image(base / "image"))
            else:
                run = _run_escape(base, None)
            result.write_text(run.to_json())
            return run
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _escape_image(directory: Path) -> TaskImage:
    """The host's Python in an image, working in the rollout's workspace, with the host's su (inert)."""
    programs = [path for path in ("/usr/bin/su",) if os.path.exists(path)]
    return make_task_image(directory, python=True, working_dir="/rollout/workspace", programs=programs)


@contextlib.contextmanager
def _image_store(path: Path) -> Iterator[None]:
    before = os.environ.get(STORE_ENV)
    os.environ[STORE_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ[STORE_ENV]
        else:
            os.environ[STORE_ENV] = before


def _run_escape(base: Path, image: TaskImage | None) -> EscapeRun:
    token = f"rollcage-escape-{secrets.token_hex(6)}"
    host_file = Path("/var/tmp") / token
    marker = f"rollcage-daemon-{secrets.token_hex(6)}"
    secret_file = base / "host-secret.txt"
    secret_file.write_text(f"host-secret-{secrets.token_hex(8)}")
    secret_file.chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    # Outside /tmp, where a dataset usually lives (a checkout, a data volume): the grader's old view of the
    # host hid /tmp but showed the rest, and a solution that found its dataset read its answers there.
    data_dir = Path(
        tempfile.mkdtemp(
            prefix="rollcage-escape-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None
        )
    )
    data_dir.chmod(0o755)
    dataset = data_dir / "dataset.jsonl"
    substitutions = {
        "@PORT@": str(listener.getsockname()[1]),
        "@SECRET_FILE@": str(secret_file),
        "@DATASET@": str(dataset),
        "@HOST_DIR@": str(base),
        "@HOST_FILE@": str(host_file),
        "@MARKER@": marker,
        "@TOKEN@": token,
    }

    def fill(text: str) -> str:
        for key, value in substitutions.items():
            text = text.replace(key, value)
        return text

    rows = [json.loads(fill(json.dumps(probe.row(name)))) for name, probe in PROBES.items()]
    if image is not None:
        for row, probe in zip(rows, PROBES.values(), strict=True):
            if probe.backend != "jupyter":
                row["sandbox"] = {"image": image.ref}
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = {
        "tasks": {name: [{"code": fill(cell)} for cell in probe.cells] for name, probe in PROBES.items()}
    }
    (data_dir / "policy.yaml").write_text(yaml.safe_dump(script, sort_keys=False))
    secret = f"sk-escape-{secrets.token_hex(8)}"
    os.environ[SECRET_VAR] = secret
    mounts_before = _mounts(base)
    try:
        config = RunConfig(
            dataset=dataset,
            out=base / "out",
            deadline_s=60,
            grace_s=2,
            concurrency=6,
            max_infra_retries=0,
            bwrap=BwrapSandbox(**{**BUDGETS, **_weakened()}),
        )
        asyncio.run(Controller(config).run())
        refused = _required(base, dataset, config.bwrap)
        lines = (config.out / "rollouts.jsonl").read_bytes().splitlines()
        records = {r.task_id: r for r in (RolloutRecord.model_validate_json(line) for line in lines)}
        return EscapeRun(
            records=records,
            host_dir=base,
            host_file=host_file,
            secret=secret,
            secret_file_text=secret_file.read_text(),
            marker=marker,
            token=token,
            mounts_before=mounts_before,
            mounts_after=_mounts(base),
            refused=refused,
            view="host" if image is None else "image",
        )
    finally:
        del os.environ[SECRET_VAR]
        listener.close()
        shutil.rmtree(data_dir, ignore_errors=True)
        for leftover in (host_file, Path("/var/tmp") / token):
            if leftover.exists():  # only if the grader's cage failed: leave no litter
                leftover.unlink()


def _required(base: Path, dataset: Path, bwrap: BwrapSandbox) -> str | None:
    """The run's refusal when its budgets are required; ``None`` if it ran (one victim row, then)."""
    victim = next(line for line in dataset.read_text().splitlines() if json.loads(line)["id"] == "victim")
    required = dataset.with_name("required.jsonl")  # beside the policy script
    required.write_text(victim + "\n")
    config = RunConfig(
        dataset=required,
        out=base / "required",
        deadline_s=60,
        grace_s=2,
        max_infra_retries=0,
        bwrap=bwrap.model_copy(update={"require_budgets": True}),
    )
    try:
        asyncio.run(Controller(config).run())
    except ConfigError as exc:
        assert not (base / "required" / "rollouts.jsonl").exists(), "refused, but after a rollout was run"
        return str(exc)
    return None


# --------------------------------------------------------------------------- checks, one per probe


def _completed(run: EscapeRun, probe: str) -> None:
    record = run.record(probe)
    assert record.outcome == "completed", f"probe {probe}: {record.outcome}: {record.receipt.outcome_reason}"
    assert record.receipt.cleanup_confirmed, f"probe {probe}: something of the sandbox survived"


def _budget(run: EscapeRun, probe: str, budget: str) -> None:
    record = run.record(probe)
    receipt = record.receipt
    mechanisms = {use.budget: use.mechanism for use in receipt.budgets}
    if mechanisms.get(budget) in WEAK_MECHANISMS:
        # Not a hard bound here (a per-process rlimit, a poll: the receipt says which). Then the run
        # must refuse up front when its budgets are required, naming this one.
        assert run.refused is not None and f"{budget} (" in run.refused, (
            f"probe {probe}: {budget} is only {mechanisms[budget]} here, yet require_budgets did not "
            f"refuse for it: {run.refused!r}"
        )
        return
    assert record.outcome == "agent_error", (
        f"probe {probe}: {record.outcome}: {record.receipt.outcome_reason}"
    )
    assert receipt.budget_exceeded == budget, (
        f"probe {probe}: ended by {receipt.budget_exceeded!r}, not {budget}"
    )
    assert budget in record.receipt.outcome_reason, f"probe {probe}: the reason does not name {budget}"
    assert receipt.cleanup_confirmed, f"probe {probe}: something of the sandbox survived"
    assert record.reward == 0.0, f"probe {probe}: going over a budget must earn 0, not {record.reward}"


def _no_worker(probe: str, cmdlines: list[str]) -> None:
    worker = [cmd for cmd in cmdlines if "rollcage worker" in cmd]
    assert worker == [], f"probe {probe}: the agent's code can see the worker: {worker}"


def check_network(run: EscapeRun) -> None:
    found = run.findings("network")
    for name in ("loopback", "external", "dns"):
        assert found[name].startswith("refused"), f"probe network: {name} {found[name]}"
    assert found["proxy_socket_visible"] is False, "probe network: the agent's code sees the proxy socket"
    _completed(run, "network")


def check_secrets(run: EscapeRun) -> None:
    found = run.findings("secrets")
    text = json.dumps(found)
    assert run.secret not in text, "probe secrets: the controller's secret reached the agent's code"
    assert SECRET_VAR not in text, "probe secrets: the controller's variable reached the agent's code"
    assert run.secret_file_text not in text, "probe secrets: a host file outside the sandbox was read"
    for name in ("host_file", "dataset", "shadow"):
        assert found[name].startswith("refused"), f"probe secrets: read {name}"
    assert str(found[str(run.host_dir)]).startswith("refused"), "probe secrets: the host's tree is visible"
    _completed(run, "secrets")


def check_setuid(run: EscapeRun) -> None:
    found = run.findings("setuid")
    assert found["no_new_privs"] == "1", f"probe setuid: NoNewPrivs is {found['no_new_privs']!r}"
    assert int(found["cap_eff"], 16) == 0, f"probe setuid: capabilities {found['cap_eff']}"
    assert found["su_ran"] is None, f"probe setuid: su ran a command as {found['su_ran']!r}"
    _completed(run, "setuid")


def check_journal_forgery(run: EscapeRun) -> None:
    found = run.findings("journal-forgery")
    for path, what in found.items():
        if path.startswith("/rollout/"):
            assert what.startswith("refused"), f"probe journal-forgery: {path} {what}"
    root = Path(run.record("journal-forgery").rollout_dir)
    # The cell's own source (which mentions the forgery) is journaled as evidence; a forged record is not.
    records = read_journal(root / "checkpoint.jsonl")
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1)), "probe journal-forgery: seq"
    assert not [r for r in records if "forged" in r], "probe journal-forgery: a forged record was accepted"
    result = json.loads((root / "result.json").read_bytes())
    assert "forged" not in result and '"forged": true' not in json.dumps(result), "probe journal-forgery"
    _completed(run, "journal-forgery")


def check_ptrace(run: EscapeRun) -> None:
    found = run.findings("ptrace")
    # What the agent's code may attach to is its own cage (its init, its children), never the worker.
    _no_worker("ptrace", [seen["cmd"] for seen in found.values()])
    _completed(run, "ptrace")


def check_kill_worker(run: EscapeRun) -> None:
    found = run.findings("kill-worker")
    _no_worker("kill-worker", list(found.values()))
    _completed(run, "kill-worker")


def check_kill_1(run: EscapeRun) -> None:
    _completed(run, "kill-1")


def check_daemon(run: EscapeRun) -> None:
    _completed(run, "daemon")
    assert processes_mentioning(run.marker) == [], "probe daemon: a daemon outlived its rollout"


def check_fork_bomb(run: EscapeRun) -> None:
    _budget(run, "fork-bomb", "processes")


def check_memory(run: EscapeRun) -> None:
    _budget(run, "memory", "memory_bytes")


def _held(run: EscapeRun, probe: str, budget: str) -> bool:
    """The budget is a hard bound in this run (otherwise :func:`_budget` checked the refusal)."""
    uses = {use.budget: use.mechanism for use in run.record(probe).receipt.budgets}
    return uses.get(budget) not in WEAK_MECHANISMS


def check_disk_fill(run: EscapeRun) -> None:
    _budget(run, "disk-fill", "workspace_bytes")
    if not _held(run, "disk-fill", "workspace_bytes"):
        return
    fill = Path(run.record("disk-fill").rollout_dir) / "workspace" / "fill.bin"
    assert fill.exists(), "probe disk-fill: the workspace was not kept as evidence"
    assert fill.stat().st_size <= BUDGETS["workspace_bytes"], (
        "probe disk-fill: more than the budget on the host"
    )


def check_inode_fill(run: EscapeRun) -> None:
    _budget(run, "inode-fill", "workspace_inodes")
    if not _held(run, "inode-fill", "workspace_inodes"):
        return
    made = len(list((Path(run.record("inode-fill").rollout_dir) / "workspace" / "many").iterdir()))
    assert 0 < made <= BUDGETS["workspace_inodes"], f"probe inode-fill: {made} files on the host"


def check_tmp_fill(run: EscapeRun) -> None:
    _budget(run, "tmp-fill", "tmp_bytes")


def check_shm_fill(run: EscapeRun) -> None:
    _budget(run, "shm-fill", "shm_bytes")


def check_grader_remount(run: EscapeRun) -> None:
    assert not run.host_file.exists(), "probe grader-remount: the solution wrote the host"
    assert not (Path("/var/tmp") / run.token).exists(), "probe grader-remount: the solution wrote the host"
    record = run.record("grader-remount")
    assert record.outcome == "completed" and record.reward == 1.0, f"probe grader-remount: {record.grader}"


def check_grader_host_read(run: EscapeRun) -> None:
    record = run.record("grader-host-read")
    detail = json.dumps(record.grader)
    try:
        shadow = Path("/etc/shadow").read_text()[:30]
    except OSError:
        shadow = None
    if shadow:
        assert shadow not in detail, "probe grader-host-read: /etc/shadow reached the grader's detail"
    failures = {f["call"]: f["got"] for f in (record.grader or {}).get("failures", [])}
    slash = set(ast.literal_eval(failures["listing('/')"]))
    cage = {"bin", "dev", "lib", "lib32", "lib64", "proc", "root", "sbin", "tmp", "usr", "work", "opt"}
    assert slash <= cage, f"probe grader-host-read: the grader's cage shows the host's {sorted(slash - cage)}"
    assert "No such file" in failures[f"listing({str(run.host_dir)!r})"], "probe grader-host-read: host dir"
    assert record.reward is not None and record.reward < 1.0, f"probe grader-host-read: {record.grader}"


def check_grader_reward_hack(run: EscapeRun) -> None:
    record = run.record("grader-reward-hack")
    assert record.reward == 0.0, f"probe grader-reward-hack: the solution read its answers: {record.grader}"


def check_victims(run: EscapeRun) -> None:
    for probe in ("victim", "victim-2", "victim-interrupt", "victim-jupyter"):
        _completed(run, probe)
        assert run.record(probe).reward == 1.0, f"probe {probe}: {run.record(probe).grader}"
        assert run.record(probe).receipt.budget_exceeded is None, f"probe {probe}: a victim hit a budget"
    grader = run.record("grader-victim")
    assert grader.reward == 1.0, f"probe grader-victim: the grader's cage broke honest code: {grader.grader}"


def check_writable_places(run: EscapeRun) -> None:
    # Every place the agent's code can write has a budget; everything else is read-only (as an
    # unprivileged user, /dev, / and /run were writable tmpfs with no bound: issue 36). Directories
    # inside a budgeted place (mount points of host paths under /tmp) count as that place.
    budgeted = ("/rollout/workspace", "/tmp", "/dev/shm")
    writable = set(run.findings("writable-places")["writable"])
    outside = sorted(p for p in writable if not any(p == b or p.startswith(b + "/") for b in budgeted))
    assert outside == [], f"probe writable-places: writable without a budget: {outside}"
    assert set(budgeted) <= writable, f"probe writable-places: {sorted(writable)}"
    _completed(run, "writable-places")


def check_require_budgets(run: EscapeRun) -> None:
    # The refusal names exactly the budgets that were weak in the run, each of them.
    weak = {
        use.budget
        for record in run.records.values()
        for use in record.receipt.budgets
        if use.mechanism in WEAK_MECHANISMS and use.limit is not None
    }
    if not weak:
        assert run.refused is None, f"require_budgets refused although every budget held: {run.refused}"
        return
    assert run.refused is not None, f"require_budgets ran although {sorted(weak)} were weak"
    named = {budget for budget in get_args(BudgetName) if f"{budget} (" in run.refused}
    assert named == weak, f"require_budgets named {sorted(named)}, the receipts {sorted(weak)}"


def check_nothing_left(run: EscapeRun) -> None:
    leaked = run.mounts_after - run.mounts_before
    assert leaked == set(), f"probe host: mounts outlived their rollouts: {leaked}"


CHECKS: dict[str, Callable[[EscapeRun], None]] = {
    name.removeprefix("check_").replace("_", "-"): check
    for name, check in list(globals().items())
    if name.startswith("check_") and callable(check)
}


BY_DESIGN_IN_AN_IMAGE = {
    "writable-places": (
        "writable without a budget",
        "a task image's root is writable by design, as a container's is: its writes go to the rollout's "
        "copy-on-write layer, bounded like its workspace (tests/images/test_image_rollouts.py)",
    ),
}
"""Checks whose finding is the point of a task image: there they must find what they refuse elsewhere."""


@pytest.mark.parametrize("probe", sorted(CHECKS))
def test_probe_is_blocked(escape: EscapeRun, probe: str) -> None:
    if escape.view == "image" and probe in BY_DESIGN_IN_AN_IMAGE:
        finding, _why = BY_DESIGN_IN_AN_IMAGE[probe]
        with pytest.raises(AssertionError, match=finding):
            CHECKS[probe](escape)
        return
    CHECKS[probe](escape)


def test_every_probe_has_a_check() -> None:
    checked = set(CHECKS) | {"victim", "victim-2", "victim-interrupt", "victim-jupyter", "grader-victim"}
    assert set(PROBES) <= checked, sorted(set(PROBES) - checked)
