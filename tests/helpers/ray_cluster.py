"""Real Ray clusters for tests: ``ray start`` processes on this machine, one temp dir per node.

Each node is a ``ray start --block`` process in its own session, with its own
``--temp-dir`` (Ray's logs, sockets, spill), its own ``$TMPDIR`` (where rollcage's
node scratch lives) and free ports, so the suite's clusters never meet another
Ray on the machine. Every process of a cluster carries a marker variable in its
environment; ``stop`` kills each node's process group, then any process still
carrying the marker, and waits until none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollcage.budgets._mechanisms import unmount
from tests.helpers.waiting import alive, wait_for

__all__ = ["NodeGate", "RayCluster", "RayNode", "free_port", "free_ports", "peer_process"]

MARKER_ENV = "ROLLCAGE_TEST_RAY_CLUSTER"
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 180.0
"""A node start takes ~5 s on a quiet machine and ~35 s on a loaded one."""


def free_port() -> int:
    """One loopback port free right now."""
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now.

    Every socket stays bound until all are chosen: ports asked for one at a time may
    come back equal (the kernel hands a just-closed port out again), and Ray refuses
    to start when two of its components are given the same port.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def marked_processes(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


@dataclass
class RayNode:
    """One ``ray start --block`` process and its directories.

    Attributes:
        name: "head" or "worker-N".
        temp_dir: Ray's ``--temp-dir`` for this node.
        scratch_tmp: The ``$TMPDIR`` of its processes (rollcage's node scratch is under it).
        proc: The ``ray start`` process (its own session and process group).
    """

    name: str
    temp_dir: Path
    scratch_tmp: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def running(self) -> bool:
        return self.proc.poll() is None

    def raylet_pid(self) -> int:
        """The pid of this node's raylet."""

        def find() -> int | None:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if argv and argv[0].endswith(b"/raylet") and str(self.temp_dir).encode() in b" ".join(argv):
                    return int(entry.name)
            return None

        return wait_for(find, timeout=30, what=f"the raylet of {self.name}")

    def owns(self, node_info: dict[str, object]) -> bool:
        """Whether a ``ray.nodes()`` entry is this node (its sockets live in its temp dir)."""
        return str(node_info.get("RayletSocketName", "")).startswith(f"{self.temp_dir}/")


@dataclass
class RayCluster:
    """A head and worker nodes on this machine, 1 CPU each (see the module docstring).

    Args:
        root: Where the nodes' directories go.
        env: Extra variables of every node (e.g. ``RAY_AUTH_MODE=token``).
    """

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    nodes: list[RayNode] = field(default_factory=list)
    address: str = ""

    def _environment(self, scratch_tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            {
                "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0",
                # A lost node is declared dead within a few seconds, not ~30.
                "RAY_health_check_period_ms": "1000",
                "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3",
                "TMPDIR": str(scratch_tmp),
                MARKER_ENV: self.marker,
            }
        )
        env.update(self.env)
        return env

    def _start(self, name: str, *args: str, agent_port: int | None = None) -> RayNode:
        temp_dir = self.root / name / "ray"
        scratch_tmp = self.root / name / "tmp"
        temp_dir.mkdir(parents=True, exist_ok=True)
        scratch_tmp.mkdir(parents=True, exist_ok=True)
        log = self.root / name / "ray-start.log"
        command = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        command += [
            "--temp-dir",
            str(temp_dir),
            "--dashboard-agent-listen-port",
            str(agent_port or free_port()),
        ]
        command += ["--disable-usage-stats", *args]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._environment(scratch_tmp),
                start_new_session=True,
            )
        node = RayNode(name, temp_dir, scratch_tmp, proc, log)
        self.nodes.append(node)

        def started() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"ray start of {name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            return b"Ray runtime started" in log.read_bytes()

        wait_for(started, timeout=START_TIMEOUT_S, what=f"Ray node {name} to start", interval=0.1)
        return node

    def start_head(self) -> RayNode:
        port, dashboard, agent = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        return self._start(
            "head",
            "--head",
            "--port",
            str(port),
            "--include-dashboard",
            "false",
            "--dashboard-port",
            str(dashboard),
            agent_port=agent,
        )

    def add_worker(self) -> RayNode:
        """Start one more worker node (a fresh name: a node's directories are never reused)."""
        return self._start(f"worker-{len(self.nodes)}", "--address", self.address)

    def node(self, name: str) -> RayNode:
        return next(n for n in self.nodes if n.name == name)

    def stop(self) -> list[int]:
        """Kill every node and every process left with the marker; returns survivors (none, we hope).

        SIGKILL at once: a ``ray start`` given SIGTERM drains its node for up to 30 s first.
        """
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
        for node in self.nodes:
            node.proc.wait()
        for pid in marked_processes(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            wait_for(
                lambda: not marked_processes(self.marker), timeout=30, what="the cluster's processes to end"
            )
        except AssertionError:
            return marked_processes(self.marker)
        self._release_mounts()
        return []

    def _release_mounts(self) -> None:
        """Unmount what the nodes' killed supervisors left under the cluster's root (as root).

        A supervisor killed with its node leaves its rollout's bounded tmpfs mounted, for the
        next supervisor on the machine to release (``sweep_orphans``); the cluster's root is
        removed now, so its own are released here, deepest first, and no later run meets them.
        """
        prefix = str(self.root.resolve()) + "/"
        with open("/proc/self/mountinfo", encoding="utf-8") as file:
            points = [line.split()[4] for line in file]
        for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
            unmount(Path(point.encode().decode("unicode_escape")))


def peer_process(port: int) -> int | None:
    """The process holding this machine's TCP socket bound to loopback port ``port`` (a connection's
    other end, seen from the accepting side); ``None`` if none is found."""
    wanted = f"0100007F:{port:04X}"
    inode = None
    for table in ("/proc/net/tcp",):
        with open(table) as file:
            for line in file.read().splitlines()[1:]:
                fields = line.split()
                if fields[1] == wanted:
                    inode = fields[9]
                    break
    if inode is None or inode == "0":
        return None
    needle = f"socket:[{inode}]"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == needle:
                        return int(entry.name)
    return None


def environ_of(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
        return dict(entry.decode(errors="replace").partition("=")[::2] for entry in raw.split(b"\0") if entry)
    return {}


class NodeGate:
    """A loopback TCP gate in front of a server: connections from the processes of the ``refused``
    nodes (known by their ``$TMPDIR``) are closed unanswered, the others forwarded. So a server on
    this machine is "unreachable from that node" although every node is this machine.

    Use as an async context manager; :attr:`url` is the gate's ``http://127.0.0.1:PORT``.
    """

    def __init__(self, target_port: int, refused: list[RayNode]) -> None:
        self._target = target_port
        self._refused = {str(node.scratch_tmp) for node in refused}
        self._server: asyncio.Server | None = None
        self.refused_connections = 0
        self.refused = asyncio.Event()
        """Set at the first connection closed unanswered."""
        self.seen: list[tuple[int | None, str | None]] = []
        """Each connection's process and its ``$TMPDIR`` (for a failing test's message)."""
        self.url = ""

    async def __aenter__(self) -> NodeGate:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("peername")[1]
        pid = await asyncio.to_thread(peer_process, port)
        tmpdir = environ_of(pid).get("TMPDIR") if pid is not None else None
        self.seen.append((pid, tmpdir))
        if tmpdir in self._refused:
            self.refused_connections += 1
            self.refused.set()
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            with contextlib.suppress(OSError):
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
