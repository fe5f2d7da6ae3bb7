"""A fork server takes its allocator's free blocks before it forks (``fill_free_blocks``).

Each check runs in a fresh interpreter: the allocator's state is the process's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_POOL_BYTES = 16384
"""A pymalloc pool on 64-bit CPython 3.10 and later (its header takes 48 bytes of it)."""


def _run(script: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    result: dict[str, object] = json.loads(out)
    return result


_HOLES = (
    "import gc, json, sys\n"
    "from rollcage.forkserver import fill_free_blocks\n"
    "from rollcage.forkserver._server import _available_blocks\n"
    "# Holes in many pools of the 48-byte class, as a template's imports leave them.\n"
    "objects = [bytes(48 - sys.getsizeof(b'')) for _ in range(80000)]\n"
    "del objects[::8]\n"
    "before = _available_blocks()[48]\n"
)


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="pymalloc is CPython's")
def test_the_holes_of_partly_used_pools_are_taken() -> None:
    # What stays free is at most one pool's blocks: the pool a fork's next objects go to, its own.
    got = _run(
        _HOLES + "taken = fill_free_blocks()\n"
        "print(json.dumps({'before': before, 'taken': taken, 'after': _available_blocks()}))\n"
    )
    assert got["before"] >= 10000  # type: ignore[operator]
    assert got["taken"] >= got["before"]  # type: ignore[operator]
    after = got["after"]
    assert isinstance(after, dict)
    # A few blocks more may be free where reading the statistics again made and dropped its own objects.
    assert after["48"] <= (_POOL_BYTES - 48) // 48 + 8, after


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="pymalloc is CPython's")
def test_a_forks_new_objects_copy_fewer_of_the_servers_pages() -> None:
    # The reason for the filling: a child's allocations land in pages of its own, not scattered over
    # the parent's holes (each hole's page copied on write). Measured as the child's private memory.
    script = (
        _HOLES + "import os\n"
        "if sys.argv[-1] == 'fill':\n"
        "    fill_free_blocks()\n"
        "gc.collect()\n"
        "gc.freeze()\n"
        "def dirty():\n"
        "    with open('/proc/self/smaps_rollup', 'rb') as f:\n"
        "        text = f.read()\n"
        "    return int(text.split(b'Private_Dirty:')[1].split()[0])\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    start = dirty()\n"
        "    made = [bytes(48 - sys.getsizeof(b'')) for _ in range(5000)]\n"
        "    os.write(w, str(dirty() - start).encode())\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "grown = int(os.read(r, 64))\n"
        "os.waitpid(pid, 0)\n"
        "print(json.dumps({'grown': grown}))\n"
    )

    def grown(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-I", "-c", script, mode],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        return int(json.loads(out)["grown"])

    plain, filled = grown("plain"), grown("fill")
    # 5000 objects of 48 bytes: ~240 KB packed, but spread over ~1.9 MB of the parent's pages (a hole
    # every eighth block) unfilled, each page copied on write.
    assert filled * 3 < plain, (plain, filled)


def test_no_statistics_take_nothing() -> None:
    got = _run(
        "import json, sys\n"
        "del sys._debugmallocstats\n"
        "from rollcage.forkserver import fill_free_blocks\n"
        "print(json.dumps({'taken': fill_free_blocks()}))\n"
    )
    assert got == {"taken": 0}
