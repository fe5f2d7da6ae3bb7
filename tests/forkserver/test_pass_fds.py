"""A warm worker's passed descriptors land at their numbers, whatever stood there, and nothing else stays.

The template receives a start's descriptors at whatever numbers are free in it; the worker it
forks must hold each passed one at the number a cold worker has it (:attr:`WorkerStart.pass_fds`),
even where that number is another received descriptor's, or its socket to the executor template.
Each case runs in a forked child (it rearranges the descriptor table), which reports what it holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from rollcage.warm import _close_all_but, _place


def _in_child(body: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """Run ``body`` in a forked child, given the descriptor it reports on (to keep); what it returned
    (or the child's error, raised here)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            try:
                out = json.dumps({"ok": body(write)})
            except BaseException as exc:
                out = json.dumps({"error": repr(exc)})
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as file:
            data = file.read()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got: dict[str, Any] = json.loads(data)
    if "error" in got:
        raise AssertionError(got["error"])
    result: dict[str, Any] = got["ok"]
    return result


def _pipe_id(fd: int) -> int:
    return os.fstat(fd).st_ino


def _held() -> list[int]:
    return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("channel_at_a_number", [False, True])
def test_passed_descriptors_take_their_numbers_over_received_ones_and_the_rest_are_closed(
    channel_at_a_number: bool,
) -> None:
    def body(report: int) -> dict[str, Any]:
        # Three received descriptors; each passed one's number is another's (a cycle), and the
        # executor template's socket stands at one of them, or apart.
        first, second, third = (os.pipe()[0] for _ in range(3))
        channel = os.pipe()[1]
        ids = {fd: _pipe_id(fd) for fd in (first, second, third, channel)}
        numbers = [second, third, channel if channel_at_a_number else first]
        passed = [first, second, third]
        moved = _place(passed, numbers, channel)
        _close_all_but({*numbers, moved, report})
        return {
            "at": {str(n): _pipe_id(n) for n in numbers},
            "want": {str(n): ids[fd] for n, fd in zip(numbers, passed, strict=True)},
            "channel": _pipe_id(moved) == ids[channel],
            "moved": moved != channel,
            "inheritable": [os.get_inheritable(n) for n in numbers],
            "held": _held(),
            "kept": sorted({0, 1, 2, *numbers, moved, report}),
        }

    got = _in_child(body)
    assert got["at"] == got["want"]
    assert got["channel"] and got["moved"] == channel_at_a_number
    assert got["inheritable"] == [True, True, True]
    # The listing's own descriptor is the one more.
    assert set(got["kept"]) <= set(got["held"]) and len(got["held"]) == len(got["kept"]) + 1


def test_without_passed_descriptors_only_the_channel_stays() -> None:
    def body(report: int) -> dict[str, Any]:
        stray = os.pipe()
        channel = os.pipe()[1]
        moved = _place([], [], channel)
        _close_all_but({moved, report})
        held = _held()
        return {"stayed": moved == channel and channel in held, "others": len(held) - 5, "stray": stray}

    got = _in_child(body)
    # 0, 1, 2, the report and the channel; the one more is the listing's own.
    assert got["stayed"] and got["others"] == 1, got
