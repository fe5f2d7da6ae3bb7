"""CPU meters for ``bench/profile.py``: exclusive per-phase CPU time inside one Python process.

Two uses:

* imported by the profiled controller (``profile.py --controller-child``), which
  wraps the supervisor's, proxy's and grader's functions before a run;
* run **as the worker** inside the sandbox: ``profile.py`` makes the supervisor start
  ``python -I -B -c <this file's source> INPUT RESULT --checkpoint ...`` instead of
  ``python -I -B -m rollcage worker ...``. It meters every import (by package, and
  the compiling of source where no bytecode exists), pydantic's model building and
  the worker's phases, runs the real worker exactly as ``-m rollcage`` does, and
  writes one line ``ROLLCAGE-PROFILE {json}`` to stderr (``worker.log``) at the end.

A meter is **exclusive**: a wrapped call inside another wrapped call is charged to
the inner meter only. Time is ``time.thread_time()`` (the calling thread's CPU), so
work done in worker threads (``asyncio.to_thread``) is charged where it runs. A
coroutine is metered step by step (each ``send``/``throw``), so its time waiting on
the event loop is not counted, and what other tasks do meanwhile is not charged to
it. Only the standard library is imported here, and only modules the interpreter
has loaded at start-up anyway, so the probe itself costs the worker next to nothing.
"""

from __future__ import annotations

import os
import sys
import time

# CPU spent by the interpreter before this line: start-up, site, the -c source's compilation.
STARTED_CPU = time.process_time()

import _thread  # noqa: E402

# ``typing`` and ``functools`` would be imported for the probe alone (the worker imports them later, and
# they would be charged to nothing): the annotations are strings, read by type checkers only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

_CO_COROUTINE = 0x80

__all__ = ["MARKER", "STARTED_CPU", "Meters", "package_of", "worker_probe"]

MARKER = "ROLLCAGE-PROFILE "
"""Prefix of the probe's report line in ``worker.log``."""

_HTTP = frozenset({"httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "h2", "hpack"})
_PYDANTIC = frozenset(
    {"pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions"}
)


def package_of(module: str) -> str:
    """The group an import is charged to: rollcage, pydantic, httpx stack, orjson, stdlib or other."""
    top = module.partition(".")[0]
    if top == "rollcage":
        return "rollcage"
    if top in _PYDANTIC:
        return "pydantic"
    if top in _HTTP:
        return "httpx stack"
    if top in sys.stdlib_module_names or top.startswith("_"):
        return "stdlib"
    return top if top in {"orjson", "typer", "yaml", "regex"} else "other"


class _Bucket:
    __slots__ = ("calls", "cpu_s")

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0


class Meters:
    """Named CPU buckets with exclusive accounting (see the module docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[str, _Bucket] = {}
        self._local = _thread._local()

    def bucket(self, label: str) -> _Bucket:
        """The bucket called ``label`` (made on first use)."""
        found = self.buckets.get(label)
        if found is None:
            found = self.buckets[label] = _Bucket()
        return found

    def _stack(self) -> list[float]:
        stack: list[float] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def run(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its exclusive CPU charged to ``label``."""
        bucket = self.bucket(label)
        stack = self._stack()
        stack.append(0.0)
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.thread_time() - started
            inner = stack.pop()
            bucket.cpu_s += elapsed - inner
            if stack:
                stack[-1] += elapsed

    def sync(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` metered under ``label``."""

        def metered(*args: Any, **kwargs: Any) -> Any:
            self.bucket(label).calls += 1
            return self.run(label, fn, *args, **kwargs)

        return _named(metered, fn)

    def coro(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The coroutine function ``fn`` metered under ``label``, step by step."""
        meters = self

        class _Stepper:
            __slots__ = ("_coro",)

            def __init__(self, coro: Any) -> None:
                self._coro = coro

            def __await__(self) -> Any:
                return self

            def __iter__(self) -> Any:
                return self

            def __next__(self) -> Any:
                return meters.run(label, self._coro.send, None)

            def send(self, value: Any) -> Any:
                return meters.run(label, self._coro.send, value)

            def throw(self, *args: Any) -> Any:
                return meters.run(label, self._coro.throw, *args)

            def close(self) -> Any:
                return self._coro.close()

        async def metered(*args: Any, **kwargs: Any) -> Any:
            self.bucket(label).calls += 1
            return await _Stepper(fn(*args, **kwargs))

        return _named(metered, fn)

    def patch(self, owner: Any, name: str, label: str) -> bool:
        """Replace ``owner.name`` by its metered self (a coroutine function or not); False if absent.

        Module-level functions are also replaced wherever a ``rollcage`` module imported them by name.
        """
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if raw is None:
            return False
        wrap_method: Callable[[Any], Any] | None = None
        fn = raw
        if isinstance(raw, classmethod | staticmethod):
            fn, wrap_method = raw.__func__, type(raw)
        is_coroutine = bool(getattr(getattr(fn, "__code__", None), "co_flags", 0) & _CO_COROUTINE)
        metered = (self.coro if is_coroutine else self.sync)(label, fn)
        setattr(owner, name, wrap_method(metered) if wrap_method is not None else metered)
        if not isinstance(owner, type):
            for module in list(sys.modules.values()):
                if (
                    getattr(module, "__name__", "").startswith("rollcage")
                    and getattr(module, name, None) is raw
                ):
                    setattr(module, name, metered)
        return True

    def report(self) -> dict[str, dict[str, float]]:
        """Every bucket's CPU seconds and call count."""
        return {label: {"cpu_s": b.cpu_s, "calls": b.calls} for label, b in self.buckets.items()}


def _named(metered: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(metered, attribute, getattr(fn, attribute, None))
    metered.__wrapped__ = fn  # type: ignore[attr-defined]
    return metered


def _install_import_meters(meters: Meters, after: dict[str, Callable[[Any], None]]) -> None:
    """Meter every import and every compile from source; call ``after[name](module)`` once it is loaded."""
    import _frozen_importlib as bootstrap
    import _frozen_importlib_external as external

    find_and_load = bootstrap._find_and_load  # type: ignore[attr-defined]

    def metered_find_and_load(name: str, import_: Any) -> Any:
        label = f"import: {package_of(name)}"
        meters.bucket(label).calls += 1
        module = meters.run(label, find_and_load, name, import_)
        hook = after.pop(name, None)
        if hook is not None:
            hook(module)
        return module

    bootstrap._find_and_load = metered_find_and_load  # type: ignore[attr-defined]
    source_to_code = external.SourceLoader.source_to_code

    def metered_source_to_code(self: Any, data: Any, path: Any, *, _optimize: int = -1) -> Any:
        group = "rollcage" if "/rollcage/" in str(path) else "other"
        label = f"compile from source: {group}"
        meters.bucket(label).calls += 1
        return meters.run(label, source_to_code, self, data, path, _optimize=_optimize)

    external.SourceLoader.source_to_code = metered_source_to_code  # type: ignore[method-assign]


def _worker_hooks(meters: Meters) -> dict[str, Callable[[Any], None]]:
    """What to meter in each worker module, applied as soon as that module is loaded."""

    def construction(module: Any) -> None:
        meters.patch(module, "complete_model_class", "pydantic model building")

    def durable(module: Any) -> None:
        meters.patch(module, "publish_json", "publish result.json")
        for name in ("_sync_data", "_write_all", "_pwrite_all"):
            meters.patch(module, name, "checkpoint journal")
        for name in ("__aenter__", "append", "aclose"):
            meters.patch(module.CheckpointJournal, name, "checkpoint journal")

    def client(module: Any) -> None:
        meters.patch(module.ModelClient, "call", "model calls (client side)")
        meters.patch(module.ModelClient, "__aenter__", "model client set-up")
        meters.patch(module.ModelClient, "aclose", "model client set-up")

    def executor(module: Any) -> None:
        meters.patch(module.Executor, "start", "executor start (worker side)")
        meters.patch(module.Executor, "run", "python cells (worker side)")
        meters.patch(module.Executor, "aclose", "executor stop (worker side)")

    def worker(module: Any) -> None:
        meters.patch(module, "load_input", "read and validate input.json")

    return {
        "pydantic._internal._model_construction": construction,
        "rollcage.durable": durable,
        "rollcage.model._client": client,
        "rollcage.tools._executor": executor,
        "rollcage.worker": worker,
    }


def worker_probe() -> None:
    """Run the real worker (as ``python -m rollcage worker ARGS``) under the meters; report on stderr."""
    import runpy

    meters = Meters()
    _install_import_meters(meters, _worker_hooks(meters))
    code: Any = 0
    sys.argv = ["rollcage", "worker", *sys.argv[1:]]
    real_exit = os._exit

    def exit_after_report(status: int) -> NoReturn:
        # The worker ends with os._exit (no interpreter teardown): report first, then exit as it would.
        raise SystemExit(status)

    os._exit = exit_after_report
    try:
        runpy.run_module("rollcage", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        os._exit = real_exit
    import json
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {
        "started_cpu_s": STARTED_CPU,
        "total_cpu_s": time.process_time(),
        "children_cpu_s": children.ru_utime + children.ru_stime,
        "meters": meters.report(),
    }
    sys.stderr.write(MARKER + json.dumps(report) + "\n")
    sys.stderr.flush()
    real_exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    worker_probe()
