"""The executor template's program (``rollcage/tools/_executor_template.py``) against hostile requests.

A real template process, served by this test as the warm template would serve it, and asked
by a socket as a worker would ask: every malformed or refused request gets a ``Refused``
answer saying why (and the worker then starts its executor itself); a registration whose
descriptors do not add up closes the worker's socket. No cage is needed for any of this.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.forkserver import ExecutorClient, ExecutorStart, Refused, encode, receive_now
from rollcage.forkserver._wire import HEADER
from rollcage.procs import PidfdChild
from rollcage.tools import _forked
from tests.helpers.waiting import wait_for

BOOT = "import os\nos._exit(0)\n"


@pytest.fixture
def template() -> Iterator[socket.socket]:
    """A live executor template and its control socket (closed, and the template reaped, after)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    argv = [sys.executable, "-I", "-u", str(_forked.PROGRAM), str(theirs.fileno()), str(os.getpid())]
    pid = os.posix_spawn(sys.executable, argv, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TZ": "UTC"})
    theirs.close()
    child = PidfdChild.of_child(pid)
    assert child is not None
    try:
        yield ours
    finally:
        ours.close()
        child.kill()
        child.reap()


def _worker(control: socket.socket, *, cgroups: int = 0, sent: int | None = None) -> socket.socket:
    """Register a worker as the warm template does; its end of the socket (with a 10 s timeout)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    files = [os.open("/dev/null", os.O_WRONLY) for _ in range(cgroups if sent is None else sent)]
    meta = ExecutorClient(uid=65534, gid=65534, umask=0o022, limits=[], cgroups=cgroups)
    socket.send_fds(control, [encode(meta)], [theirs.fileno(), *files])
    theirs.close()
    for fd in files:
        os.close(fd)
    mine.settimeout(10)
    return mine


def _ask(worker: socket.socket, message: bytes, fds: int = 4) -> str:
    """Send ``message`` (a frame, or bytes that are not one) with ``fds`` descriptors; the refusal's words."""
    files = [os.open("/dev/null", os.O_RDONLY) for _ in range(fds)]
    try:
        socket.send_fds(worker, [message], files)
    finally:
        for fd in files:
            os.close(fd)
    answer = receive_now(worker, [Refused])
    for fd in answer.fds:
        os.close(fd)
    assert isinstance(answer.message, Refused), answer
    return answer.message.reason


def _request(**changes: object) -> bytes:
    """A start's frame, its body changed as asked (well-formed or not: the template is to judge)."""
    request: dict[str, object] = {"cwd": "/", "env": {"TZ": "UTC"}, "boot": BOOT, "argv": ["python", "3"]}
    request.update(changes)
    body = json.dumps(request).encode()
    return HEADER.pack(b"rc", 1, ExecutorStart.KIND, len(body)) + body


def _frame(body: bytes) -> bytes:
    return HEADER.pack(b"rc", 1, ExecutorStart.KIND, len(body)) + body


@pytest.mark.parametrize(
    ("message", "fds", "answer"),
    [
        (b"\x80not a frame at all", 4, "not a fork server's frame"),
        (_frame(b"\x80not json"), 4, "ExecutorStart: its body is not JSON"),
        (_frame(b"[1, 2, 3]"), 4, "ExecutorStart: its body is not a JSON object"),
        (_request(), 1, "ExecutorStart: came with 1 descriptors, it carries 4"),
        (_request(), 9, "descriptors were lost on the way"),  # more than the template peeks at
        (_request(env={"TZ": 3}), 4, "ExecutorStart: its field 'env' is not an object of strings"),
        (_request(env=["TZ"]), 4, "ExecutorStart: its field 'env' is not an object of strings"),
        (_request(cwd=None), 4, "ExecutorStart: its field 'cwd' is not a string"),
        (_request(argv="python"), 4, "ExecutorStart: its field 'argv' is not a list of strings"),
        (_request(env={"TZ": "Europe/Paris"}), 4, "TZ differs from the template's"),
        (_request(env={"TZ": "UTC", "LANG": "C.UTF-8"}), 4, "LANG differs from the template's"),
    ],
)
def test_a_malformed_or_different_request_is_refused_and_says_why(
    template: socket.socket, message: bytes, fds: int, answer: str
) -> None:
    worker = _worker(template)
    assert _ask(worker, message, fds).startswith(answer)
    # The template goes on serving the same worker.
    assert _ask(worker, _frame(b"{}"), 4) == "ExecutorStart: its field 'cwd' is missing"


def test_a_holder_that_is_not_a_process_cannot_be_joined(template: socket.socket) -> None:
    # /dev/null where the holder's pidfd should be: the fork that would join it says why.
    answer = _ask(_worker(template), _request())
    assert answer.startswith("cannot join the cage: OSError"), answer


def test_a_registration_whose_descriptors_were_lost_closes_the_workers_socket(
    template: socket.socket,
) -> None:
    # Without every cgroup an executor would escape its rollout's budgets: the worker is told nothing
    # but an end of file, and starts its executors itself.
    worker = _worker(template, cgroups=3, sent=1)
    socket.send_fds(worker, [_request()], [])
    try:
        answer = worker.recv(4096)
    except ConnectionResetError:  # closed with the request unread
        answer = b""
    assert answer == b""


def _template_pid() -> int:
    """The executor template this test started (a child of this process)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                ppid = int(file.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and any(word.endswith(b"_executor_template.py") for word in words):
            return int(name)
    raise AssertionError("no executor template among this process's children")


def _idle_descriptors(pid: int) -> list[str]:
    """The template's descriptors once it is idle: back in its wait for work, with no child left."""

    def idle() -> list[str] | None:
        waiting = Path(f"/proc/{pid}/wchan").read_text() == "do_epoll_wait"
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return sorted(os.listdir(f"/proc/{pid}/fd")) if waiting and not children else None

    return wait_for(idle, timeout=30, what="the executor template to be idle")


def test_refused_requests_leave_the_template_no_descriptor_and_no_child(template: socket.socket) -> None:
    # The template peeks at each request's descriptors (copies of them), and forks a child to read
    # one it cannot join: whatever the request, it keeps neither.
    worker = _worker(template)
    assert _ask(worker, _frame(b"{}"), 4).endswith("is missing")  # the template is up and serving
    pid = _template_pid()
    before = _idle_descriptors(pid)
    hostile = [(_frame(b"[]"), 4), (_request(), 9), (_request(), 1), (_request(), 4), (b"\x80", 4)]
    for message, fds in hostile * 4:
        assert _ask(worker, message, fds), (message, fds)
    assert _idle_descriptors(pid) == before


@pytest.mark.parametrize(
    "request_frame",
    [_request(), _request(env={"TZ": "Europe/Paris"}), _frame(b"[]")],
    ids=["unjoinable", "refused", "malformed"],
)
def test_a_worker_gone_in_the_middle_of_its_request_costs_the_template_nothing(
    template: socket.socket, request_frame: bytes
) -> None:
    # Its request is taken off the socket and forked for (or refused) after the worker is gone: the
    # answer finds no one. The template goes on serving the others, with no child and no descriptor
    # of the gone worker's left.
    other = _worker(template)
    assert _ask(other, _frame(b"{}"), 4).endswith("is missing")  # the template is up and serving
    pid = _template_pid()
    before = _idle_descriptors(pid)
    gone = _worker(template, cgroups=2)
    files = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]
    try:
        socket.send_fds(gone, [request_frame], files)
    finally:
        for fd in files:
            os.close(fd)
    gone.close()
    assert _ask(other, _request(env={"TZ": "Europe/Paris"}), 4) == "TZ differs from the template's"
    assert _idle_descriptors(pid) == before
