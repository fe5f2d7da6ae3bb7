"""The one cancellation dialect: finish what must finish, wait without cancelling what is shared.

asyncio offers ``asyncio.shield`` and leaves the rest to each caller, which is
how a codebase ends up with three dialects and a bug: ``await
asyncio.shield(close())`` protects ``close`` but not its caller, so a second
cancellation makes the caller leave at once while ``close`` runs on unobserved,
and whatever the caller meant to do next (stop the next server) never starts.
Here there are three words, each with one meaning:

* :func:`shielded` -- *shield and finish*: the work always runs to its end; the
  caller waits for it however many cancellations arrive, and re-raises the
  cancellation afterwards (trio's ``CancelScope(shield=True)`` around clean-up).
* :func:`wait_shared` -- wait for a future that others share without cancelling
  it: the caller leaves at once when cancelled, the future runs on.
* :func:`within` -- wait at most some seconds and carry on quietly (trio's
  ``move_on_after``); ``asyncio.timeout`` is the raising half of the pair;
* :func:`first_of` -- race several waits: the first to finish ends the others,
  which are cancelled and awaited (no task outlives the call);
* :func:`cancel_and_wait` -- end tasks this code started: cancel, wait for each, and leave
  no reference cycle behind (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["AsyncClosing", "cancel_and_wait", "first_of", "shielded", "wait_shared", "within"]

_T = TypeVar("_T")


async def shielded(work: Awaitable[_T], *, on_cancel: Callable[[], object] | None = None) -> _T:
    """Run ``work`` to its end even if the caller is cancelled meanwhile, then re-raise the cancellation.

    For clean-up that must finish once started (stopping a process tree, closing a
    server, writing a receipt). ``work`` must bound itself: this waits for it as
    long as it takes.

    Args:
        work: A coroutine or future.
        on_cancel: Called once for each cancellation that arrives while ``work``
            runs, e.g. to tell it to hurry (skip the rest of a grace period).

    Returns:
        What ``work`` returned.

    Raises:
        asyncio.CancelledError: A cancellation arrived while ``work`` ran; raised once
            it has finished (chained to ``work``'s exception, if it failed), so the
            cancellation is never lost.
        BaseException: Whatever ``work`` raised, when no cancellation arrived.

    **Cancellation:** remembered, not obeyed: ``work`` runs to its end, then
    ``CancelledError`` propagates. ``work`` itself is never cancelled from here.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise  # the work itself was cancelled, or ended as we were: nothing left to wait for
            cancelled = True
            if on_cancel is not None:
                on_cancel()
            continue
        except BaseException as exc:
            if cancelled:
                # The work failed, but the caller was cancelled: that must not be lost.
                raise asyncio.CancelledError from exc
            raise
        break
    if cancelled:
        raise asyncio.CancelledError
    return result


async def wait_shared(future: Awaitable[_T]) -> _T:
    """Wait for ``future``, which others also wait for, without cancelling it if the caller is cancelled.

    Returns:
        What ``future`` returned.

    Raises:
        BaseException: Whatever ``future`` raised.

    **Cancellation:** the caller stops waiting at once; ``future`` runs on for its other waiters.
    """
    return await asyncio.shield(future)


async def within(work: Awaitable[_T], seconds: float) -> _T | None:
    """``await work`` for at most ``seconds`` (negative: none at all); ``None`` if the time ran out.

    Returns:
        What ``work`` returned, or ``None`` when it was cut short (it is then cancelled).

    **Cancellation:** ``work`` is cancelled with the caller.
    """
    try:
        async with asyncio.timeout(max(seconds, 0.0)):
            return await work
    except TimeoutError:
        return None


async def first_of(*works: Awaitable[Any], seconds: float | None = None) -> list[asyncio.Future[Any]]:
    """Run ``works`` concurrently until the first finishes (or ``seconds`` pass); cancel the rest.

    Returns:
        One finished task per work, in order: ``task.cancelled()`` tells the ones that were
        cut short from the one(s) that finished on their own (whose result or exception
        the task holds; an exception is not raised here).

    **Cancellation:** every work is cancelled and awaited, then ``CancelledError`` propagates.
    """
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(work) for work in works]
    try:
        bound = None if seconds is None else max(seconds, 0.0)
        await asyncio.wait(tasks, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*tasks)
    return tasks


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (``None``: skipped; one already done stays as it ended) and wait until each has ended.

    As ``task.cancel()`` then ``asyncio.gather(*tasks, return_exceptions=True)``, and one thing
    more: a task that ended cancelled keeps the ``CancelledError`` raised in its coroutine until
    someone asks for its result, which that ``gather`` never does; the error's traceback holds the
    coroutine's frame, and so its ``self``, which holds the task: a reference cycle that only the
    garbage collector's full collection frees. Asked for here, the error goes, and what the task's
    coroutine held is freed at once (at C=256 every rollout's supervision and model proxy, with
    their sockets, were left to the collector before).

    **Cancellation:** as ``gather``'s: the tasks are cancelled (again) and the caller's
    ``CancelledError`` propagates.
    """
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    if not running:
        return
    await asyncio.gather(*running, return_exceptions=True)
    for task in running:
        if task.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                task.result()  # takes the stored error out of the task (``_make_cancelled_error``)


class AsyncClosing:
    """Base of everything closed by ``aclose()``: ``async with`` leaves through it.

    A subclass defines ``aclose`` (and its own ``__aenter__``); leaving the block,
    by an exception or a cancellation too, awaits it. One ``__aexit__`` for every
    such class, so none can forget the close or swallow an exception.
    """

    async def aclose(self) -> None:
        """Release what the object holds; idempotent.

        **Cancellation:** as the subclass says.
        """
        raise NotImplementedError

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close (see :meth:`aclose`); an exception from the block propagates.

        **Cancellation:** as for :meth:`aclose`.
        """
        await self.aclose()
