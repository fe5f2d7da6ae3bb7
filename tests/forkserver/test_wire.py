"""The fork servers' codec against a hostile peer: every datagram is a whole message or a clear error.

Real ``SOCK_SEQPACKET`` socket pairs, real descriptors: what one side sends, the other takes with
:func:`rollcage.forkserver.receive_now`, the one place that parses. A malformed, cut, padded or
oversized frame, or one whose descriptors do not add up, is a :class:`WireError` in words that
name the problem, its descriptors closed; nothing else escapes, and nothing leaks.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcage.forkserver import (
    MAX_PASS_FDS,
    MESSAGES,
    CommandStart,
    Entered,
    EnterFailed,
    ExecutorClient,
    ExecutorStart,
    Exited,
    Forked,
    Message,
    Refused,
    Unforked,
    WireError,
    WorkerStart,
    decode,
    encode,
    pass_fds_problem,
    receive_now,
    send,
)
from rollcage.forkserver._wire import HEADER

ALL = tuple(MESSAGES.values())


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _frame(kind: type[Message], body: bytes, *, length: int | None = None) -> bytes:
    return HEADER.pack(b"rc", 1, kind.KIND, len(body) if length is None else length) + body


def _sent_with(theirs: socket.socket, data: bytes, count: int) -> None:
    files = [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]
    try:
        socket.send_fds(theirs, [data], files)
    finally:
        for fd in files:
            os.close(fd)


def _error(ours: socket.socket, expect: tuple[type[Message], ...] = ALL) -> str:
    got = receive_now(ours, expect)
    assert got.message is None and got.fds == [] and got.error is not None, got
    return str(got.error)


_TEXT = st.text(max_size=40)
_INTS = st.integers(min_value=-(2**40), max_value=2**40)

worker_starts = st.builds(
    WorkerStart,
    argv=st.lists(_TEXT, max_size=5),
    env=st.dictionaries(_TEXT, _TEXT, max_size=5),
    cwd=_TEXT,
    uid=_INTS,
    gid=_INTS,
    limits=st.dictionaries(_TEXT, st.none() | _INTS, max_size=4),
    umask=_INTS,
    cgroups=st.lists(_TEXT, max_size=3),
    clear_groups=st.booleans(),
    mounts=st.lists(
        st.fixed_dictionaries({"path": _TEXT, "size": _INTS, "inodes": _INTS, "uid": _INTS, "gid": _INTS}),
        max_size=2,
    ),
    keep=st.lists(_TEXT, max_size=3),
    pass_fds=st.lists(st.integers(min_value=3, max_value=1 << 16), max_size=MAX_PASS_FDS, unique=True),
    caged=st.booleans(),
    userns=st.booleans(),
)
executor_starts = st.builds(
    ExecutorStart,
    cwd=_TEXT,
    env=st.dictionaries(_TEXT, _TEXT, max_size=5),
    boot=_TEXT,
    argv=st.lists(_TEXT, max_size=5),
)

command_starts = st.builds(
    CommandStart,
    argv=st.lists(_TEXT, max_size=5),
    env=st.dictionaries(_TEXT, _TEXT, max_size=5),
    cwd=_TEXT,
    uid=_INTS,
    gid=_INTS,
    cgroups=st.lists(_TEXT, max_size=3),
    tty=st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(message=worker_starts | executor_starts | command_starts)
def test_a_start_comes_back_as_it_was_sent(message: Message) -> None:
    fds = {WorkerStart: 3, ExecutorStart: 4, CommandStart: 5}[type(message)]
    if isinstance(message, WorkerStart):
        fds += len(message.pass_fds)
    assert decode(encode(message), list(range(fds)), expect=[type(message)]) == message


@pytest.mark.parametrize(
    ("message", "fds"),
    [
        (Forked(pid=7), 1),
        (Forked(pid=7, go_between=True), 1),
        (Unforked(reason="no"), 0),
        (Unforked(reason="cannot join the sandbox's namespaces: EPERM", refused=True), 0),
    ],
)
def test_a_non_root_starts_reports_come_back_as_they_were_sent(message: Message, fds: int) -> None:
    """A go-between is named apart from the worker, and a kernel's refusal apart from other failures."""
    assert decode(encode(message), list(range(fds)), expect=[Forked, Unforked]) == message


@pytest.mark.parametrize(
    ("message", "fds"),
    [
        (ExecutorClient(uid=1, gid=1, umask=0o22, limits=[], cgroups=2, userns=True), 3),
        (ExecutorClient(uid=1, gid=1, umask=0o22, limits=[], cgroups=0), 1),
        (Refused(reason="LC_CTYPE differs from the template's", final=True), 0),
        (Refused(reason="cannot fork the executor"), 0),
    ],
)
def test_a_non_root_executors_words_come_back_as_they_were_sent(message: Message, fds: int) -> None:
    """A non-root worker's registration says so (its executors come through a go-between), and a refusal
    that every later start would meet says so apart from one for this start alone."""
    assert decode(encode(message), list(range(fds)), expect=[ExecutorClient, Refused]) == message


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200), fds=st.integers(min_value=0, max_value=5))
def test_any_bytes_from_a_hostile_peer_are_a_message_or_a_wire_error_and_leak_nothing(
    data: bytes, fds: int
) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        before = _open_fds()
        _sent_with(theirs, data, fds)
        got = receive_now(ours, ALL)
        for fd in got.fds:
            os.close(fd)
        assert got.message is not None or got.error is not None or (not data and not fds)
        assert _open_fds() == before
    finally:
        ours.close()
        theirs.close()


@settings(max_examples=40, deadline=None)
@given(message=worker_starts, cut=st.integers(min_value=1, max_value=50))
def test_a_truncated_frame_is_refused_as_one(message: WorkerStart, cut: int) -> None:
    frame = encode(message)
    cut = min(cut, len(frame))
    with pytest.raises(WireError, match=r"truncated frame|its header says"):
        decode(frame[:-cut], [3, 4, 5])


def test_a_padded_frame_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.send(encode(Exited(code=1)) + b" ")
    assert _error(ours) == "Exited: a body of 11 bytes, its header says 10"


def test_a_header_that_claims_more_than_a_kind_may_hold_is_refused_before_its_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    theirs.send(_frame(Exited, b"{}", length=1 << 30))
    assert _error(ours) == f"Exited: its header says {1 << 30} bytes, over its bound of 4096"


def test_a_datagram_larger_than_any_message_is_cut_on_receipt_and_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    body = json.dumps({"reason": "x" * 10_000}).encode()
    theirs.send(_frame(Refused, body, length=100))
    # Received with room for the largest reply the receiver expects, and one byte more.
    assert _error(ours, (Refused, Exited)) == "Refused: the frame was cut short on receipt (MSG_TRUNC)"


def test_a_start_larger_than_its_bound_cannot_even_be_sent() -> None:
    start = ExecutorStart(cwd="/", env={"BIG": "x" * (1 << 20)}, boot="", argv=[])
    with pytest.raises(WireError, match="over its bound"):
        encode(start)


def test_a_long_reason_is_cut_to_fit() -> None:
    message = decode(encode(Refused(reason="why " * 10_000)), [])
    assert isinstance(message, Refused) and len(message.reason) == 1000


@pytest.mark.parametrize(
    ("frame", "words"),
    [
        (b"rc", "a truncated frame: 2 bytes, shorter than the 8-byte header"),
        (b"GET / HTTP/1.1\r\n\r\n", "not a fork server's frame (it begins b'GE', not b'rc')"),
        (HEADER.pack(b"rc", 2, Exited.KIND, 2) + b"{}", "a frame of version 2; this side speaks 1"),
        (HEADER.pack(b"rc", 1, 99, 2) + b"{}", "a message of kind 99, where"),
        (_frame(Exited, b"\x80"), "Exited: its body is not JSON"),
        (_frame(Exited, b"[" * 100_0 + b"]" * 100_0), "Exited: its body is not"),
        (_frame(Exited, b'"code"'), "Exited: its body is not a JSON object"),
        (_frame(Exited, b"{}"), "Exited: its field 'code' is missing"),
        (_frame(Exited, b'{"code": "1"}'), "Exited: its field 'code' is not an integer"),
        (_frame(Exited, b'{"code": true}'), "Exited: its field 'code' is not an integer"),
        (_frame(Exited, b'{"code": 1, "more": 2}'), "Exited: no field 'more'"),
        (
            _frame(EnterFailed, b'{"reason": "x", "mount": 1}'),
            "EnterFailed: its field 'mount' is not true or",
        ),
    ],
)
def test_a_malformed_frame_is_refused_in_words_that_name_the_problem(
    pair: tuple[socket.socket, socket.socket], frame: bytes, words: str
) -> None:
    ours, theirs = pair
    theirs.send(frame)
    assert _error(ours).startswith(words)


def test_a_message_of_a_kind_not_expected_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    send(theirs, Exited(code=0))
    assert _error(ours, (Forked, Entered)) == "a message of kind Exited, where Forked or Entered was expected"


@pytest.mark.parametrize(("count", "words"), [(0, "came with 0 descriptors, it carries 1"), (2, "carries 1")])
def test_descriptors_that_do_not_match_the_kind_are_refused_and_closed(
    pair: tuple[socket.socket, socket.socket], count: int, words: str
) -> None:
    ours, theirs = pair
    before = _open_fds()
    _sent_with(theirs, encode(Forked(pid=1)), count)
    assert words in _error(ours)
    assert _open_fds() == before


def test_descriptors_lost_on_the_way_are_refused_and_those_that_came_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    before = _open_fds()
    _sent_with(theirs, encode(Forked(pid=1)), 9)  # more than the receiver has room for: MSG_CTRUNC
    assert _error(ours, (Forked,)).startswith("descriptors were lost on the way")
    assert _open_fds() == before


def test_a_client_whose_cgroups_do_not_add_up_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    client = ExecutorClient(uid=1, gid=1, umask=0o22, limits=[[7, 64]], cgroups=3)
    _sent_with(theirs, encode(client), 2)
    assert _error(ours) == "ExecutorClient: came with 2 descriptors, which its fields do not account for"
    with pytest.raises(WireError, match="do not account for 2"):
        send(theirs, client, [0, 1])


def test_a_peer_gone_is_an_end_of_file_not_an_error(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.close()
    got = receive_now(ours, ALL)
    assert got.ended and got.message is None and got.error is None


_START = {"argv": [], "env": {}, "cwd": "/", "uid": 1, "gid": 1, "limits": {}, "umask": 18, "cgroups": []}
_START_REST = {"clear_groups": True, "mounts": [], "keep": []}


def _start_frame(pass_fds: object) -> bytes:
    return _frame(WorkerStart, json.dumps({**_START, **_START_REST, "pass_fds": pass_fds}).encode())


@pytest.mark.parametrize(
    ("pass_fds", "fds"),
    [
        ([2], 4),  # a standard descriptor's place
        ([7, 7], 5),  # two at one number
        (list(range(3, 4 + MAX_PASS_FDS)), 3),  # more than a start passes on
        ([True], 4),
        ("7", 4),
    ],
)
def test_a_start_that_would_pass_descriptors_where_it_may_not_is_refused_and_closes_them(
    pair: tuple[socket.socket, socket.socket], pass_fds: object, fds: int
) -> None:
    ours, theirs = pair
    before = _open_fds()
    _sent_with(theirs, _start_frame(pass_fds), fds)
    words = f"WorkerStart: its field 'pass_fds' is not a list of at most {MAX_PASS_FDS} distinct descriptor"
    assert _error(ours, (WorkerStart,)).startswith(words)
    assert _open_fds() == before
    assert pass_fds_problem([7]) is None
    if isinstance(pass_fds, list) and all(type(fd) is int for fd in pass_fds):
        assert pass_fds_problem(pass_fds) is not None


@pytest.mark.parametrize("count", [3, 5])
def test_a_start_whose_descriptors_are_not_its_three_and_those_it_passes_is_refused(
    pair: tuple[socket.socket, socket.socket], count: int
) -> None:
    ours, theirs = pair
    start = WorkerStart(argv=[], env={}, cwd="/", uid=1, gid=1, pass_fds=[9])
    _sent_with(theirs, encode(start), count)
    assert _error(ours, (WorkerStart,)) == (
        f"WorkerStart: came with {count} descriptors, which its fields do not account for"
    )
    with pytest.raises(WireError, match="do not account for 3"):
        send(theirs, start, [0, 1, 2])


def test_a_start_that_passes_descriptors_on_comes_with_them_after_its_three(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    start = WorkerStart(argv=[], env={}, cwd="/", uid=1, gid=1, pass_fds=[40, 9])
    _sent_with(theirs, encode(start), 5)
    got = receive_now(ours, (WorkerStart,))
    try:
        assert got.message == start and len(got.fds) == 5
    finally:
        for fd in got.fds:
            os.close(fd)


def test_received_descriptors_are_close_on_exec_from_the_start(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A process spawned while they are held (another rollout's bubblewrap) inherits none of them."""
    ours, theirs = pair
    _sent_with(theirs, encode(Forked(pid=1)), 1)
    got = receive_now(ours, (Forked,))
    try:
        assert len(got.fds) == 1 and not os.get_inheritable(got.fds[0])
    finally:
        for fd in got.fds:
            os.close(fd)
