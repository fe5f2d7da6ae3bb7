"""Child processes for tests/core/test_durable.py: writers that are killed, and concurrent publishers.

``forker`` imports rollcage once and then forks one writer per command, so a kill
campaign of hundreds of SIGKILLs pays for one interpreter start. It reads commands
on stdin, one per line, and answers on stdout:

* ``journal PATH``  fork a child that appends to the journal at PATH forever;
  answers ``pid PID``. The child prints ``ack PID SEQ`` after every durable append.
* ``publish PATH``  fork a child that publishes ``{"pid", "gen", "pad"}`` to PATH
  forever; answers ``pid PID``. The child prints ``ack PID GEN`` after every publish.
* ``reap PID``      wait for that child; answers ``reaped PID WAITSTATUS``.

``publish PATH WRITER COUNT`` prints ``ready``, waits for a line on stdin, then
publishes COUNT values ``{"writer": WRITER, "i": i, "pad": ...}`` to PATH.

Every line is written with one ``os.write`` of less than PIPE_BUF bytes, so lines
from the forker and its children never interleave inside a line.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from typing import NoReturn

from rollcage.durable import CheckpointJournal, publish_json


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _pad(rng: random.Random) -> str:
    # Mostly small records, sometimes a large one: a SIGKILL that lands inside a
    # large write can leave a short (torn) line, which is what the reader must survive.
    size = rng.choice((0, 10, 200, 2_000, 9_000)) if rng.random() < 0.9 else rng.randrange(64_000, 300_000)
    return "x" * size


async def _append_forever(path: str) -> None:
    pid = os.getpid()
    rng = random.Random(pid)
    async with CheckpointJournal(path) as journal:
        n = 0
        while True:
            # Several appends at once, so batches of more than one line are killed too.
            width = rng.randint(1, 4)
            records = [{"pid": pid, "n": n + i, "pad": _pad(rng)} for i in range(width)]
            n += width
            seqs = await asyncio.gather(*(journal.append(record) for record in records))
            _say(f"ack {pid} {max(seqs)}")


def _publish_forever(path: str) -> NoReturn:
    pid = os.getpid()
    rng = random.Random(pid)
    gen = 0
    while True:
        gen += 1
        pad = _pad(rng)
        publish_json(path, {"pid": pid, "gen": gen, "size": len(pad), "pad": pad})
        _say(f"ack {pid} {gen}")


def _child(kind: str, path: str) -> NoReturn:
    try:
        if kind == "journal":
            asyncio.run(_append_forever(path))
        else:
            _publish_forever(path)
    except BaseException as exc:
        os.write(2, f"child {os.getpid()} failed: {exc!r}\n".encode())
        os._exit(1)
    os._exit(0)


def forker() -> None:
    for line in sys.stdin:
        command, arg = line.split()
        if command in ("journal", "publish"):
            pid = os.fork()
            if pid == 0:
                _child(command, arg)
            _say(f"pid {pid}")
        elif command == "reap":
            _, status = os.waitpid(int(arg), 0)
            _say(f"reaped {arg} {status}")
        else:
            raise SystemExit(f"unknown command {command!r}")


def publisher(path: str, writer: int, count: int) -> None:
    _say("ready")
    sys.stdin.readline()
    for i in range(count):
        pad = "p" * ((writer * 7919 + i * 104_729) % 20_000)
        publish_json(path, {"writer": writer, "i": i, "size": len(pad), "pad": pad})


if __name__ == "__main__":
    if sys.argv[1] == "forker":
        forker()
    elif sys.argv[1] == "publish":
        publisher(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} forker | publish PATH WRITER COUNT")
