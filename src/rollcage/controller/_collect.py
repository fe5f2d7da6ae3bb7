"""``rollcage.collect``: the Python face of a run, for trainers. ``rollcage run`` is a CLI over it.

A ``Collection`` runs tasks exactly as ``rollcage run`` does (the same
``Controller``: sandbox, supervisors, retries of infrastructure failures,
``rollouts.jsonl`` fsynced record by record, resume) and yields each finished
attempt's ``RolloutRecord`` as it lands, holding the parsed result in memory
(``record.result()``: trajectory, turns, token ids and logprobs)::

    async with rollcage.collect(tasks, model=url, model_name="policy", attempts=8) as rollouts:
        async for record in rollouts:
            if record.outcome in ("completed", "agent_error") and record.reward is not None:
                batch.add(record.result(), record.reward)

Records come as fast as the consumer takes them: a sample whose record waits to
be taken holds its concurrency slot (``buffer`` records may wait), so a slow
trainer slows the rollouts rather than filling memory.

Stopping: leaving the ``async with`` (or ``aclose()``, or ``break`` out of a bare
``async for``, which closes it when the iterator is collected) stops the
in-flight rollouts through their supervisors, records them (``cancelled``, rerun
on resume) and waits for the run to end. Cancelling the task that iterates
abandons them at once: their supervisors stop and reap the workers, no record is
written for them, and they rerun on resume.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import ValidationError

from rollcage.controller._backend import Backend
from rollcage.controller._config import EmbeddedPolicyConfig, ModelEndpointConfig, ModelSource, RunConfig
from rollcage.controller._scheduler import Controller, Reporter, RunSummary
from rollcage.errors import ConfigError, RunFailedError
from rollcage.procs import AsyncClosing, first_of, wait_shared
from rollcage.protocol import RolloutRecord, describe_validation_error

__all__ = ["Collection", "collect"]

_STOP_SLACK_S = 120.0
"""Beyond a rollout's deadline and grace, how long a stopped run may take to end (grading, receipts)."""


def collect(
    tasks: Iterable[Mapping[str, Any]] | str | os.PathLike[str],
    *,
    model: str | ModelSource,
    model_name: str | None = None,
    api_key_env: str | None = None,
    concurrency: int = 8,
    attempts: int = 1,
    out: str | os.PathLike[str] | None = None,
    format: Literal["auto", "rollcage", "nemo-gym", "inspect"] = "auto",
    strict: bool = True,
    buffer: int | None = None,
    reporter: Reporter | None = None,
    stop: asyncio.Event | None = None,
    **options: Any,
) -> Collection:
    """Run tasks in sandboxes and yield each finished attempt's record as it completes.

    Args:
        tasks: Dataset rows as parsed JSON objects (rollcage's row format, or NeMo Gym's or
            Inspect's: see ``format``), or the path of a JSONL dataset.
        model: The model: an OpenAI-compatible base URL ending in ``/v1`` (with
            ``model_name``), or a ``ModelEndpointConfig`` / ``EmbeddedPolicyConfig``.
        model_name: The model name sent in requests, with a URL ``model``.
        api_key_env: Environment variable holding the API key (the egress proxy adds it;
            it never enters the sandbox), with a URL ``model``.
        concurrency: Rollouts in flight at most.
        attempts: Samples per task (the k of pass@k; GRPO's group size).
        out: Output directory (``rollouts.jsonl``, ``metrics.json``, ``rollouts/``); a run
            in an existing one resumes it. ``None``: a fresh ``runs/collect-<UTC time>-<hex>``.
        format: How the rows are written; ``auto`` detects it from the first rows.
        strict: Refuse to run anything if a row is malformed (otherwise it is skipped and
            counted in ``metrics.json``).
        buffer: Records that may wait to be taken before samples pause (at least 1); ``None``:
            ``concurrency``.
        reporter: Where progress goes (the CLI's progress bar); default: nowhere.
        stop: Set it to stop gracefully, as leaving the ``async with`` does.
        **options: Any other ``RunConfig`` field: ``deadline_s``, ``grace_s``, ``sandbox``,
            ``max_infra_retries``, ``api``, ``backend``, ``environment``, ``grade_timeouts``...

    Returns:
        A ``Collection``: iterate it (``async for``), preferably inside ``async with``.

    Raises:
        ConfigError: The arguments do not make a valid run (the message names the field): the
            model URL and API key variable are checked as ``rollcage run`` checks them.
    """
    _check_buffer(buffer)
    source = _model_source(model, model_name=model_name, api_key_env=api_key_env)
    dataset: Path | None = None
    rows: list[Mapping[str, Any]] | None = None
    if isinstance(tasks, str | os.PathLike):
        dataset = Path(tasks)
    else:
        rows = list(tasks)
    directory = Path(out) if out is not None else _fresh_out()
    try:
        config = RunConfig(
            dataset=dataset,
            out=directory,
            model=source,
            concurrency=concurrency,
            attempts=attempts,
            dataset_format=format,
            strict=strict,
            **options,
        )
    except ValidationError as exc:
        raise ConfigError(f"collect: {describe_validation_error(exc)}") from exc
    return Collection(config, tasks=rows, reporter=reporter, stop=stop, buffer=buffer)


def _model_source(
    model: str | ModelSource, *, model_name: str | None, api_key_env: str | None
) -> ModelSource:
    if isinstance(model, EmbeddedPolicyConfig | ModelEndpointConfig):
        if model_name is not None or api_key_env is not None:
            raise ConfigError("collect: model_name and api_key_env go with a URL model, not a model config")
        return model
    if not model_name:
        raise ConfigError(f"collect: model={model!r} needs model_name (the name sent in requests)")
    try:
        return ModelEndpointConfig(base_url=model, model_name=model_name, api_key_env=api_key_env)
    except ValidationError as exc:
        raise ConfigError(f"collect: {describe_validation_error(exc)}") from exc


_MAX_BUFFER = 1_000_000


def _check_buffer(buffer: int | None) -> None:
    if buffer is None:
        return
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 1 <= buffer <= _MAX_BUFFER:
        raise ConfigError(
            f"collect: buffer={buffer!r} is not a number of records between 1 and {_MAX_BUFFER:,} "
            "(None: as many as concurrency)"
        )


def _fresh_out() -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path("runs") / f"collect-{stamp}-{secrets.token_hex(3)}"


class Collection(AsyncClosing):
    """A run whose records are yielded as they land (see ``collect``).

    Lifecycle: it starts on ``async with`` or on the first ``async for``, ends when
    every sample has a final record (the iterator then ends), when stopped
    (``aclose``, ``stop``) or when the iterating task is cancelled. It runs once and
    is iterated once: iterating it again raises ``RuntimeError`` (its records are in
    ``rollouts.jsonl``; a new ``collect`` on the same ``out`` resumes the run).

    Args:
        config: The run.
        tasks: Rows in memory (``config.dataset`` is then ``None``).
        reporter: Where progress goes.
        stop: Set it to stop gracefully.
        buffer: Records that may wait to be taken (at least 1); ``None``: ``config.concurrency``.
        backend: Where rollouts execute; ``None``: ``config.backend`` (a fake in tests).

    Raises:
        ConfigError: ``buffer`` is not a number of records.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        tasks: list[Mapping[str, Any]] | None = None,
        reporter: Reporter | None = None,
        stop: asyncio.Event | None = None,
        buffer: int | None = None,
        backend: Backend | None = None,
    ) -> None:
        _check_buffer(buffer)
        self._iterated = False
        self._stop = stop if stop is not None else asyncio.Event()
        self._controller = Controller(
            config, reporter=reporter, backend=backend, stop=self._stop, tasks=tasks, sink=self._put
        )
        self._queue: asyncio.Queue[RolloutRecord] = asyncio.Queue(maxsize=buffer or config.concurrency)
        self._closing = asyncio.Event()
        self._run: asyncio.Task[RunSummary] | None = None
        # No rollout outlives its deadline plus grace: a stopped run ends well within this.
        self._stop_wait_s = config.deadline_s + config.grace_s + _STOP_SLACK_S

    @property
    def out_dir(self) -> Path:
        """The output directory."""
        return self._controller.out_dir

    def summary(self, *, interrupted: bool | None = None) -> RunSummary:
        """The run as it stands: its metrics, and how it ended once it has (``exit_code``)."""
        return self._controller.summary(interrupted=interrupted)

    async def __aenter__(self) -> Self:
        """Start the run.

        **Cancellation:** nothing to undo: the run is started, not awaited.
        """
        self._start()
        return self

    def __aiter__(self) -> AsyncIterator[RolloutRecord]:
        """The records, in the order they land on disk: every attempt, infrastructure failures included.

        The iterator ends when the run does. It raises ``ConfigError`` when the run could
        not start (bad dataset, model or output directory) and ``RunFailedError`` when the
        run failed (``rollouts.jsonl`` could not be written); the records yielded before
        stay on disk.

        Raises:
            RuntimeError: It was iterated before: a collection yields its records once.
        """
        if self._iterated:
            raise RuntimeError(
                f"this Collection was already iterated: it yields its records once (all of them are in "
                f"{self.out_dir / 'rollouts.jsonl'}); call collect() again with out={str(self.out_dir)!r} "
                "to resume the run"
            )
        self._iterated = True
        return self._records()

    async def aclose(self) -> None:
        """Stop: no new rollouts; in-flight ones are stopped through their supervisors and recorded.

        Returns once the run has ended (every server stopped, ``metrics.json`` published).
        Records not yet taken are dropped from memory (they are in ``rollouts.jsonl``).

        **Cancellation:** the in-flight rollouts are then abandoned at once (their
        supervisors still stop and reap the workers; they rerun on resume), and the
        cancellation propagates once the run has ended.
        """
        run = self._run
        if run is None:
            self._closing.set()
            return
        self._closing.set()
        if not run.done():
            self._stop.set()  # a run that ended by itself was not interrupted
        while not self._queue.empty():  # wakes a sample waiting to hand over its record
            self._queue.get_nowait()
        try:
            async with asyncio.timeout(self._stop_wait_s):
                await asyncio.wait([run])  # the run's own outcome is not raised here
        except asyncio.CancelledError:
            await self._abandon()
            raise
        except TimeoutError:
            await self._abandon()
        if run.done() and not run.cancelled():
            run.exception()  # retrieved: an iterator raises it; one that stopped early chose not to see it

    def _start(self) -> asyncio.Task[RunSummary]:
        if self._run is None:
            if self._closing.is_set():
                raise RuntimeError("this Collection was closed; a collection runs once")
            self._run = asyncio.create_task(self._controller.run(), name="rollcage-collect")
        return self._run

    async def _abandon(self) -> None:
        """Cancel the run and wait until it has unwound (its supervisors reap their workers)."""
        run = self._run
        if run is None or run.done():
            return
        run.cancel()
        while not run.done():
            try:
                await asyncio.wait([run])
            except asyncio.CancelledError:
                continue  # the run is already being cancelled: wait for it to finish unwinding

    async def _records(self) -> AsyncIterator[RolloutRecord]:
        run = self._start()
        finished = False
        try:
            while True:
                record = await self._next(run)
                if record is None:
                    break
                yield record
            finished = True
            summary = run.result()  # a ConfigError the run raised comes out here
            if summary.error is not None:
                raise RunFailedError(summary.error)
        except asyncio.CancelledError:
            await self._abandon()
            raise
        finally:
            if not finished:
                await self.aclose()

    async def _next(self, run: asyncio.Task[RunSummary]) -> RolloutRecord | None:
        """The next record; ``None`` once the run has ended and every record was taken."""
        while True:
            if not self._queue.empty():
                return self._queue.get_nowait()
            if run.done():
                return None
            # Queue.get takes its item only when it resumes: a get cut short loses nothing.
            getter, _ = await first_of(self._queue.get(), wait_shared(run))
            if not getter.cancelled() and getter.exception() is None:
                record: RolloutRecord = getter.result()
                return record

    async def _put(self, record: RolloutRecord) -> None:
        """The controller's sink: hand a record over, waiting for room unless the collection is closing."""
        if self._closing.is_set():
            return
        await first_of(self._queue.put(record), self._closing.wait())
