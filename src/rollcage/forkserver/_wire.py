"""The fork servers' messages and their one codec.

Every message between a fork server (the warm worker template, the executor template), its
clients and the children it forks is one datagram of a ``SOCK_SEQPACKET`` socket: an 8-byte
header (``b"rc"``, the codec's version, the message's kind, the body's length), then the body, a
JSON object holding exactly the message's fields, and beside it the descriptors the kind carries
(``SCM_RIGHTS``). :func:`decode` is the one place that parses one: a frame cut short or padded, a
body over its kind's bound, a kind nobody sends, a field missing, unknown or of the wrong type,
descriptors lost (``MSG_CTRUNC``) or not as many as the kind carries: each is a :class:`WireError`
that says which, never a half-read message.

Standard library only, and nothing that imports :mod:`inspect` (no :mod:`dataclasses` at run time):
the executor template, which imports nothing of ``rollcage`` (its heap is every executor's),
loads this file by path.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Sequence

TYPE_CHECKING = False
if TYPE_CHECKING:
    from dataclasses import dataclass, field
    from typing import Any, ClassVar
else:
    _NO_DEFAULT = object()

    def field(*, default_factory: Callable[[], object]) -> object:
        """A field whose default is made afresh for each message (as ``dataclasses.field``)."""
        return _Factory(default_factory)

    class _Factory:
        def __init__(self, make: Callable[[], object]) -> None:
            self.make = make

    def dataclass(*, frozen: bool = True) -> Callable[[type], type]:
        """A light stand-in for ``dataclasses.dataclass``: keyword construction, equality, a repr."""

        def make(cls: type) -> type:
            names = [name for name, kind in cls.__annotations__.items() if not kind.startswith("ClassVar")]
            defaults = {name: cls.__dict__[name] for name in names if name in cls.__dict__}

            def __init__(self: object, *args: object, **values: object) -> None:
                if len(args) > len(names):
                    raise TypeError(f"{cls.__name__} takes {len(names)} fields")
                values.update(zip(names, args, strict=False))
                for name in names:
                    if name in values:
                        value = values.pop(name)
                    elif name in defaults:
                        default = defaults[name]
                        value = default.make() if isinstance(default, _Factory) else default
                    else:
                        raise TypeError(f"{cls.__name__} needs its field {name!r}")
                    object.__setattr__(self, f"_v_{name}", value)
                if values:
                    raise TypeError(f"{cls.__name__} has no field {sorted(values)[0]!r}")

            def __eq__(self: object, other: object) -> bool:
                return type(other) is type(self) and all(
                    getattr(self, name) == getattr(other, name) for name in names
                )

            def __repr__(self: object) -> str:
                shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
                return f"{cls.__name__}({shown})"

            def __setattr__(self: object, name: str, value: object) -> None:
                raise AttributeError(f"{cls.__name__} is frozen")

            namespace = {"__init__": __init__, "__eq__": __eq__, "__repr__": __repr__, "__hash__": None}
            if frozen:
                namespace["__setattr__"] = __setattr__
            for name in names:
                namespace[name] = property(lambda self, key=f"_v_{name}": object.__getattribute__(self, key))
            slots = tuple(f"_v_{name}" for name in names)
            kept = {k: v for k, v in _plain(cls.__dict__).items() if k not in defaults}
            return type(cls.__name__, cls.__bases__, {**kept, **namespace, "__slots__": slots})

        return make

    def _plain(namespace: object) -> dict[str, object]:
        return {k: v for k, v in dict(namespace).items() if k not in ("__dict__", "__weakref__", "__slots__")}


__all__ = [
    "HEADER",
    "MAX_FDS",
    "MAX_PASS_FDS",
    "MESSAGES",
    "CommandStart",
    "EnterFailed",
    "Entered",
    "ExecutorClient",
    "ExecutorStart",
    "ExecutorStarted",
    "Exited",
    "Forked",
    "Message",
    "Refused",
    "Unforked",
    "WireError",
    "WorkerStart",
    "decode",
    "descriptors_problem",
    "encode",
    "kind_of",
    "pass_fds_problem",
    "room",
    "send",
]

MAGIC = b"rc"
VERSION = 1
HEADER = struct.Struct("!2sBBI")
"""``b"rc"``, the codec's version, the message's kind, the body's length in bytes."""
MAX_FDS = 64
"""The most descriptors any message carries (an executor client and its rollout's cgroups)."""
MAX_PASS_FDS = 8
"""The most descriptors a worker start passes on to the worker (:attr:`WorkerStart.pass_fds`): a
harness rollout's relay to the supervisor is one."""
_HIGHEST_FD = 1 << 20
"""Past the highest descriptor number a process may hold (``fs.nr_open``'s default)."""
_SMALL = 4096
"""The bound of a reply's body (its words are cut to fit when it is made)."""
_LARGE = 1 << 20
"""The bound of a start's body (a worker's or an executor's command line and environment)."""
_WORDS = 1000
"""The most characters of a reason sent (what a peer's exception said, say)."""


class WireError(ValueError):
    """A message that is not one of the codec's, in words that say what is wrong with it."""


class Message:
    """A message of the fork servers (a frozen record; its class says its kind and descriptors)."""

    KIND: ClassVar[int]
    FDS: ClassVar[tuple[int, int]] = (0, 0)
    """How many descriptors come with it: at least, at most."""
    MAX_BODY: ClassVar[int] = _SMALL
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {}
    """Each field's type, as a check of a decoded JSON value (a field missing here is refused)."""

    def descriptors_ok(self, count: int) -> bool:
        """Whether ``count`` descriptors fit this message (past its kind's :attr:`FDS` bounds)."""
        return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_strs(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_env(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _is_pass_fds(value: object) -> bool:
    # Below 3 it would take a standard descriptor's place; two at one number, one of them is lost.
    return (
        isinstance(value, list)
        and len(value) <= MAX_PASS_FDS
        and all(_is_int(fd) and 3 <= fd < _HIGHEST_FD for fd in value)
        and len(set(value)) == len(value)
    )


def pass_fds_problem(numbers: Sequence[int]) -> str | None:
    """Why a worker start cannot pass descriptors on at ``numbers`` (:attr:`WorkerStart.pass_fds`);
    ``None``: it can."""
    if _is_pass_fds(list(numbers)):
        return None
    return f"descriptors at {list(numbers)}: not {_TYPE_WORDS[_is_pass_fds]}"


def _is_limits(value: object) -> bool:
    return isinstance(value, dict) and all(v is None or _is_int(v) for v in value.values())


def _is_rlimits(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair)) for pair in value
    )


_MOUNT = {"path": _is_str, "size": _is_int, "inodes": _is_int, "uid": _is_int, "gid": _is_int}


def _is_mounts(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and set(m) == set(_MOUNT) and all(check(m[k]) for k, check in _MOUNT.items())
        for m in value
    )


_TYPE_WORDS: dict[Callable[[object], bool], str] = {
    _is_int: "an integer",
    _is_str: "a string",
    _is_bool: "true or false",
    _is_strs: "a list of strings",
    _is_env: "an object of strings",
    _is_limits: "an object of integers or nulls",
    _is_pass_fds: f"a list of at most {MAX_PASS_FDS} distinct descriptor numbers, each 3 or more",
    _is_rlimits: "a list of [resource, value] pairs",
    _is_mounts: 'a list of {"path", "size", "inodes", "uid", "gid"}',
}


@dataclass(frozen=True)
class WorkerStart(Message):
    """Supervisor -> warm template: fork one worker into its cage (see :mod:`rollcage.warm`).

    Descriptors: a pidfd of the cage's holder, the start's report socket (the template and the
    worker answer there), ``worker.log``, then one for each of :attr:`pass_fds`, in its order.

    Attributes:
        argv: The worker's arguments (``INPUT RESULT --checkpoint PATH``, paths as the cage sees them).
        env: Its entire environment.
        cwd: Its working directory in the cage.
        uid: The uid it runs as, in the cage's user namespace.
        gid: Likewise, the gid.
        limits: The cage's :class:`~rollcage.cage.Limits`, by field name (soft = hard).
        umask: Its file-mode creation mask.
        cgroups: The rollout's ``cgroup.procs`` files it is moved into before it runs.
        clear_groups: Clear the supplementary groups first (the template is root).
        mounts: Bounded tmpfs to mount in the cage before the worker starts, each
            ``{"path", "size", "inodes", "uid", "gid"}`` (``/tmp``, ``/dev/shm``: mode 1777,
            owned by the host's ``uid``); :class:`Entered` sends their roots back, in this order.
        keep: Paths the cage shows under those places (a Python environment in ``/tmp``): their
            mounts are copied before the tmpfs goes over them and put back on top of it.
        pass_fds: The numbers the descriptors after the first three take in the worker, as a cold
            start's worker inherits them (a harness rollout's relay to the supervisor); each 3 or
            more, none twice, at most :data:`MAX_PASS_FDS`. The worker holds these and no other.
        caged: The worker enters the holder's cage; ``False`` (``--sandbox none``): it is forked as
            a plain process beside the holder, with no namespace, mount or uid of its own, the
            supervisor's limits and ``uid``/``gid``/``cgroups``/``mounts``/``keep`` unused.
        userns: The template is not root (a non-root supervisor): it owns the cage's user namespace
            but may not join its PID namespace itself, so a go-between it forks joins all of the
            holder's namespaces at once and forks the worker there (:class:`Forked` ``go_between``).
            ``mounts`` must then be empty.
    """

    KIND: ClassVar[int] = 1
    FDS: ClassVar[tuple[int, int]] = (3, 3 + MAX_PASS_FDS)
    MAX_BODY: ClassVar[int] = _LARGE
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {
        "argv": _is_strs,
        "env": _is_env,
        "cwd": _is_str,
        "uid": _is_int,
        "gid": _is_int,
        "limits": _is_limits,
        "umask": _is_int,
        "cgroups": _is_strs,
        "clear_groups": _is_bool,
        "mounts": _is_mounts,
        "keep": _is_strs,
        "pass_fds": _is_pass_fds,
        "caged": _is_bool,
        "userns": _is_bool,
    }

    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    limits: dict[str, int | None] = field(default_factory=dict)
    umask: int = 0o022
    cgroups: list[str] = field(default_factory=list)
    clear_groups: bool = True
    mounts: list[dict[str, Any]] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    caged: bool = True
    pass_fds: list[int] = field(default_factory=list)
    userns: bool = False

    def descriptors_ok(self, count: int) -> bool:
        return count == 3 + len(self.pass_fds)


@dataclass(frozen=True)
class Forked(Message):
    """Warm template -> supervisor: the worker is forked, its PID here; a pidfd of it beside.

    Attributes:
        pid: The forked process's PID (the supervisor's PID namespace).
        go_between: The process is not the worker but a go-between (a :attr:`WorkerStart.userns`
            start): it joins the cage, forks the worker there and says :class:`Forked` (the worker's)
            or :class:`Unforked` itself on the same report socket, then exits. Both are the
            supervisor's children, which reaps them.
    """

    KIND: ClassVar[int] = 2
    FDS: ClassVar[tuple[int, int]] = (1, 1)
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {"pid": _is_int, "go_between": _is_bool}

    pid: int
    go_between: bool = False


@dataclass(frozen=True)
class Unforked(Message):
    """Warm template (or its go-between) -> supervisor: no worker was forked, and why.

    Attributes:
        reason: Why, in words.
        refused: The kernel refused a go-between's entry into the cage (``setns``, ``chroot`` or the
            fork there: no user namespace to join, a seccomp filter): later non-root starts are cold.
    """

    KIND: ClassVar[int] = 3
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {"reason": _is_str, "refused": _is_bool}

    reason: str
    refused: bool = False


@dataclass(frozen=True)
class Entered(Message):
    """Worker -> supervisor: it stands in its cage; the roots of the tmpfs it mounted beside (``O_PATH``)."""

    KIND: ClassVar[int] = 4
    FDS: ClassVar[tuple[int, int]] = (0, 4)


@dataclass(frozen=True)
class EnterFailed(Message):
    """Worker -> supervisor: it could not enter its cage, and why; ``mount``: a tmpfs was refused."""

    KIND: ClassVar[int] = 5
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {"reason": _is_str, "mount": _is_bool}

    reason: str
    mount: bool = False


@dataclass(frozen=True)
class ExecutorClient(Message):
    """Warm template -> executor template: one warm worker's ids, limits and cgroups.

    Descriptors: the executor template's end of a socket pair whose other end the worker keeps,
    then the rollout's ``cgroup.procs`` files opened for writing (``cgroups`` of them).

    Attributes:
        userns: The templates are not root (a :attr:`WorkerStart.userns` worker): the executor
            template may not join an executor's PID namespace itself, so a go-between it forks joins
            every namespace of the holder at once (user namespace included) and forks the executor
            there, the executor template's child; no supplementary groups are cleared (not root,
            it may not, and a started executor keeps them too).
    """

    KIND: ClassVar[int] = 6
    FDS: ClassVar[tuple[int, int]] = (1, MAX_FDS)
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {
        "uid": _is_int,
        "gid": _is_int,
        "umask": _is_int,
        "limits": _is_rlimits,
        "cgroups": _is_int,
        "userns": _is_bool,
    }

    uid: int
    gid: int
    umask: int
    limits: list[list[int]]
    """``[[RLIMIT_*, value], ...]`` (soft = hard)."""
    cgroups: int
    userns: bool = False

    def descriptors_ok(self, count: int) -> bool:
        return count == 1 + self.cgroups


@dataclass(frozen=True)
class ExecutorStart(Message):
    """Worker -> executor template: fork one executor into the cage made for it.

    Descriptors: a pidfd of the holder the executor joins, its control socket, its stdout, its stderr.
    """

    KIND: ClassVar[int] = 7
    FDS: ClassVar[tuple[int, int]] = (4, 4)
    MAX_BODY: ClassVar[int] = _LARGE
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {
        "cwd": _is_str,
        "env": _is_env,
        "boot": _is_str,
        "argv": _is_strs,
    }

    cwd: str
    env: dict[str, str]
    boot: str
    argv: list[str]


@dataclass(frozen=True)
class ExecutorStarted(Message):
    """Executor template -> worker: the executor stands in its cage; a pidfd of it beside."""

    KIND: ClassVar[int] = 8
    FDS: ClassVar[tuple[int, int]] = (1, 1)


@dataclass(frozen=True)
class Refused(Message):
    """Executor template -> worker: no executor was forked, and why (the worker starts one itself).

    Attributes:
        reason: Why, in words.
        final: Every later start of this worker would be refused too (its environment differs from
            the template's in what an interpreter reads at start-up, or the kernel refused the entry
            into the cage): the worker starts its executors itself from then on, and asks no more.
    """

    KIND: ClassVar[int] = 9
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {"reason": _is_str, "final": _is_bool}

    reason: str
    final: bool = False


@dataclass(frozen=True)
class Exited(Message):
    """Executor template -> worker: an executor it forked was reaped, with this exit code (as
    ``os.waitstatus_to_exitcode``)."""

    KIND: ClassVar[int] = 10
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {"code": _is_int}

    code: int


@dataclass(frozen=True)
class CommandStart(Message):
    """Sandbox provider -> its joiner (:mod:`rollcage.gym_sandbox._joinserver`): fork one command into
    a sandbox's cage.

    Descriptors: a pidfd of the cage's holder, the start's reply socket (the joiner answers there
    with :class:`Forked` or :class:`Unforked`, the command with :class:`EnterFailed` if it cannot take
    its place; its end of file, once the command executes, says it did), the command's stdin, stdout
    and stderr.

    Attributes:
        argv: The command line (``argv[0]`` found on the environment's ``PATH``).
        env: Its entire environment.
        cwd: Its working directory in the cage.
        uid: The uid it runs as, in the cage's user namespace.
        gid: Likewise, the gid.
        cgroups: The sandbox's ``cgroup.procs`` files it is moved into before it joins the cage.
        tty: Its stdin is a terminal's slave, made its controlling terminal (``TIOCSCTTY``) once it
            leads its session: a PTY session's command.
    """

    KIND: ClassVar[int] = 11
    FDS: ClassVar[tuple[int, int]] = (5, 5)
    MAX_BODY: ClassVar[int] = _LARGE
    CHECKS: ClassVar[dict[str, Callable[[object], bool]]] = {
        "argv": _is_strs,
        "env": _is_env,
        "cwd": _is_str,
        "uid": _is_int,
        "gid": _is_int,
        "cgroups": _is_strs,
        "tty": _is_bool,
    }

    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    cgroups: list[str] = field(default_factory=list)
    tty: bool = False


MESSAGES: dict[int, type[Message]] = {
    kind.KIND: kind
    for kind in (
        WorkerStart,
        Forked,
        Unforked,
        Entered,
        EnterFailed,
        ExecutorClient,
        ExecutorStart,
        ExecutorStarted,
        Refused,
        Exited,
        CommandStart,
    )
}
"""Every message, by its kind."""


def _fields(message: Message) -> dict[str, object]:
    return {name: getattr(message, name) for name in type(message).CHECKS}


def encode(message: Message) -> bytes:
    """The frame of ``message`` (its descriptors travel beside it: :func:`send`).

    A reason too long is cut to fit (it is words for people); any other field that makes the body
    larger than its kind's bound raises :class:`WireError`, as the receiver would.
    """
    kind = type(message)
    values = _fields(message)
    if "reason" in values and isinstance(values["reason"], str):
        values["reason"] = values["reason"][:_WORDS]
    body = json.dumps(values, separators=(",", ":")).encode()
    if len(body) > kind.MAX_BODY:
        raise WireError(f"{kind.__name__}: {len(body)} bytes, over its bound of {kind.MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, kind.KIND, len(body)) + body


def send(sock: socket.socket, message: Message, fds: Sequence[int] = (), flags: int = 0) -> None:
    """Send ``message`` with ``fds`` on ``sock`` (whole or not at all: one datagram).

    Raises:
        WireError: ``fds`` are not as many as the message carries.
        OSError: The socket refused (``BlockingIOError`` with ``MSG_DONTWAIT`` and a full queue).
    """
    problem = descriptors_problem(type(message), len(fds))
    if problem is not None or not message.descriptors_ok(len(fds)):
        raise WireError(
            problem or f"{type(message).__name__}: its fields do not account for {len(fds)} descriptors"
        )
    socket.send_fds(sock, [encode(message)], list(fds), flags)


def room(kinds: Sequence[type[Message]]) -> tuple[int, int]:
    """(bytes, descriptors) to receive any of ``kinds`` with, one more byte than the largest: a datagram
    that fills it is over every bound (``recvmsg`` cuts it and says ``MSG_TRUNC``)."""
    return HEADER.size + max(kind.MAX_BODY for kind in kinds) + 1, max(kind.FDS[1] for kind in kinds)


def kind_of(data: bytes, *, expect: Sequence[type[Message]] | None = None) -> tuple[type[Message], int]:
    """The kind of message a frame (or its first :data:`HEADER` bytes, peeked) holds, and its body's length.

    Raises:
        WireError: No frame of this codec, or not of a kind expected, or a body over its bound.
    """
    if len(data) < HEADER.size:
        raise WireError(f"a truncated frame: {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, code, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"not a fork server's frame (it begins {magic!r}, not {MAGIC!r})")
    if version != VERSION:
        raise WireError(f"a frame of version {version}; this side speaks {VERSION}")
    kind = MESSAGES.get(code)
    if kind is None or (expect is not None and kind not in expect):
        wanted = " or ".join(k.__name__ for k in expect or MESSAGES.values())
        raise WireError(f"a message of kind {kind.__name__ if kind else code}, where {wanted} was expected")
    if length > kind.MAX_BODY:
        raise WireError(f"{kind.__name__}: its header says {length} bytes, over its bound of {kind.MAX_BODY}")
    return kind, length


def descriptors_problem(kind: type[Message], count: int) -> str | None:
    """Why ``count`` descriptors cannot come with a ``kind`` message (by its kind alone); ``None``: can."""
    low, high = kind.FDS
    if low <= count <= high:
        return None
    want = str(low) if low == high else f"{low} to {high}"
    return f"{kind.__name__}: came with {count} descriptors, it carries {want}"


def decode(
    data: bytes, fds: Sequence[int], flags: int = 0, *, expect: Sequence[type[Message]] | None = None
) -> Message:
    """The message of one datagram received with ``fds`` (``recvmsg``'s ``flags`` say what was cut).

    The descriptors stay the caller's, whatever happens: close them when this raises.

    Args:
        expect: The kinds the receiver takes; another is refused. ``None``: any.

    Raises:
        WireError: The datagram is not a whole, well-formed message of an expected kind with its
            descriptors, in words that say what is wrong.
    """
    if flags & socket.MSG_CTRUNC:
        raise WireError(f"descriptors were lost on the way ({len(fds)} arrived; MSG_CTRUNC)")
    kind, length = kind_of(data, expect=expect)
    if flags & socket.MSG_TRUNC:
        raise WireError(f"{kind.__name__}: the frame was cut short on receipt (MSG_TRUNC)")
    if len(data) != HEADER.size + length:
        raise WireError(
            f"{kind.__name__}: a body of {len(data) - HEADER.size} bytes, its header says {length}"
        )
    return _message(kind, data[HEADER.size :], len(fds))


def _message(kind: type[Message], body: bytes, descriptors: int) -> Message:
    """The ``kind`` message of ``body``, each field of its type, with ``descriptors`` checked."""
    name = kind.__name__
    problem = descriptors_problem(kind, descriptors)
    if problem is not None:
        raise WireError(problem)
    try:
        values = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"{name}: its body is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise WireError(f"{name}: its body is not a JSON object")
    unknown = sorted(set(values) - set(kind.CHECKS))
    if unknown:
        raise WireError(f"{name}: no field {unknown[0]!r}")
    for field_name, check in kind.CHECKS.items():
        if field_name not in values:
            raise WireError(f"{name}: its field {field_name!r} is missing")
        if not check(values[field_name]):
            raise WireError(f"{name}: its field {field_name!r} is not {_TYPE_WORDS[check]}")
    make: Callable[..., Message] = kind
    message = make(**values)
    if not message.descriptors_ok(descriptors):
        raise WireError(f"{name}: came with {descriptors} descriptors, which its fields do not account for")
    return message
