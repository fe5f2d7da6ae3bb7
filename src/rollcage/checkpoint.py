"""Folding a checkpoint journal into a ``Checkpoint``: evidence of an interrupted rollout.

A checkpoint is never a result and never graded (``partial`` is always true). It
holds every boundary that reached the disk: turns started (an in-flight model call
leaves its turn ``pending``), finished model calls, the tool calls they requested
(pending until a later record ends them), and the latest cookies.

Every model call repeats the conversation so far (its request's ``messages`` or
``input``, a chat call's Responses-shaped ``input``) and the prompt's token ids;
``CallCompactor`` journals each such list as a ``ListDelta`` against the same list
of the previous call, so a boundary stays O(new content), and ``fold_records``
rebuilds them.

:class:`BoundaryJournal` is the one writer of ``checkpoint.jsonl``, whichever
process writes it:

* a builtin rollout's journal is written by the worker, inside the sandbox: the loop
  waits for each boundary's fsync before its next action, so nothing it did after a
  crash is missing and nothing is recorded that it did not do;
* a harness rollout's journal is written by the supervisor, outside the sandbox
  (:class:`rollcage.harness.CaptureJournal`): a black box's own account cannot be
  trusted, so every model call is journaled from the egress proxy's capture, where
  nothing in the sandbox can forge or remove it, and the tool calls the harness
  reported are relayed to it by the worker;
* a harness rollout without the proxy (no sandbox, or a journal the supervisor could
  not open) has no capture to journal from, so the worker writes it, as for the
  builtin loop, from what its forwarder saw.

In each case the lines are the same: a model call's repeated lists as deltas, one
self-checking line a boundary, synced before the writer goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Self

from rollcage.durable import CheckpointJournal, read_journal
from rollcage.errors import JournalCorruptError, RollcageError
from rollcage.procs import AsyncClosing
from rollcage.protocol import (
    SCHEMA_VERSION,
    BoundaryRecord,
    CallTokens,
    Checkpoint,
    DeltaField,
    ListDelta,
    ModelCall,
)
from rollcage.trajectory import TrajectoryRecorder, project_output

__all__ = ["BoundaryJournal", "CallCompactor", "fold_records", "load_checkpoint"]

logger = logging.getLogger("rollcage.checkpoint")

_FIELDS: tuple[DeltaField, ...] = (
    "request.messages",
    "request.input",
    "input",
    "tokens.prompt_token_ids",
    "tokens.prompt_log_probs",
)


def _get(call: ModelCall, field: DeltaField) -> list[Any] | None:
    """The list ``field`` names in ``call``, if it is one."""
    owner, _, key = field.rpartition(".")
    if owner == "request":
        value: Any = call.request.get(key)
    elif owner == "tokens":
        value = getattr(call.tokens, key)
    else:
        value = getattr(call, key)
    return value if isinstance(value, list) else None


def _without(call: ModelCall, fields: list[DeltaField]) -> ModelCall:
    """``call`` with the lists ``fields`` name left out (empty request keys dropped, others None)."""
    update: dict[str, Any] = {}
    request_keys = {f.partition(".")[2] for f in fields if f.startswith("request.")}
    if request_keys:
        update["request"] = {k: v for k, v in call.request.items() if k not in request_keys}
    token_keys = {f.partition(".")[2]: None for f in fields if f.startswith("tokens.")}
    if token_keys:
        update["tokens"] = call.tokens.model_copy(update=token_keys)
    if "input" in fields:
        update["input"] = None
    return call.model_copy(update=update)


def _with(call: ModelCall, lists: dict[DeltaField, list[Any]]) -> ModelCall:
    """``call`` with the rebuilt lists put back."""
    update: dict[str, Any] = {}
    request = {key.partition(".")[2]: value for key, value in lists.items() if key.startswith("request.")}
    if request:
        update["request"] = {**call.request, **request}
    tokens = {key.partition(".")[2]: value for key, value in lists.items() if key.startswith("tokens.")}
    if tokens:
        # Validated, not copied: the tokens' status follows from the arrays, which are whole again.
        update["tokens"] = CallTokens.model_validate({**call.tokens.model_dump(), **tokens})
    if "input" in lists:
        update["input"] = lists["input"]
    return call.model_copy(update=update)


class CallCompactor:
    """Turns each model call's repeated lists into deltas against the previous call's.

    Every request repeats the whole conversation so far, and every prompt's token
    ids repeat the previous prompt's; journaling them whole would make each
    boundary O(transcript). The deltas keep a boundary O(new items).
    """

    def __init__(self) -> None:
        """Start with no earlier call."""
        self._previous: dict[DeltaField, tuple[int, list[Any]]] = {}

    def compact(self, call: ModelCall) -> tuple[ModelCall, list[ListDelta]]:
        """Return the call without its repeated lists, and the deltas that rebuild them."""
        deltas: list[ListDelta] = []
        for field in _FIELDS:
            items = _get(call, field)
            if items is None:
                continue
            previous = self._previous.get(field)
            self._previous[field] = (call.index, items)
            if previous is None:
                continue
            base, before = previous
            keep = _common_prefix(before, items)
            deltas.append(ListDelta(field=field, base=base, keep=keep, append=list(items[keep:])))
        if not deltas:
            return call, []
        return _without(call, [delta.field for delta in deltas]), deltas


def _common_prefix(before: list[Any], items: list[Any]) -> int:
    """How many leading items the two lists share.

    The usual case, a list that extends the previous one, is one list comparison in
    C (which tries identity first: the client builds each request from the same item
    objects); only a list that diverges is walked item by item.
    """
    if len(items) >= len(before) and items[: len(before)] == before:
        return len(before)
    keep = 0
    for old, new in zip(before, items, strict=False):
        if old is not new and old != new:
            break
        keep += 1
    return keep


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a ``checkpoint.jsonl`` journal and fold it into a partial ``Checkpoint``.

    A missing or empty journal gives an empty checkpoint (``seq is None``); a torn
    last line is ignored.

    Raises:
        JournalCorruptError: a line other than the last is damaged, a record does
            not have the shape of a boundary record, or the journal was written with
            another artifact schema version.
    """
    return fold_records(read_journal(path), source=str(path))


def fold_records(records: list[dict[str, object]], *, source: str = "journal") -> Checkpoint:
    """Fold journal records (each with ``seq``) into a ``Checkpoint``."""
    recorder = TrajectoryRecorder()
    checkpoint = Checkpoint()
    lists: dict[tuple[int, DeltaField], list[Any]] = {}
    seq: int | None = None
    for raw in records:
        body = {k: v for k, v in raw.items() if k != "seq"}
        version = body.get("schema_version")
        if body.get("kind") == "start" and version is not None and version != SCHEMA_VERSION:
            raise JournalCorruptError(
                f"{source}: written with artifact schema version {version!r}; this rollcage reads version "
                f"{SCHEMA_VERSION} only: read it with the rollcage that wrote it"
            )
        try:
            record = BoundaryRecord.model_validate(body)
        except ValueError as exc:
            raise JournalCorruptError(
                f"{source}: record seq={raw.get('seq')} is not a boundary record: {exc}"
            ) from exc
        seq = int(str(raw["seq"]))
        if record.kind == "start":
            checkpoint.rollout_id = record.rollout_id
        elif record.kind == "turn_start" and record.turn is not None:
            recorder.start_turn(record.turn)
        elif record.kind == "model_call" and record.model_call is not None:
            recorder.add_model_call(_expand(record, lists, source))
        for tool in record.tool_calls:
            recorder.apply(tool)
        if record.kind == "resumed" and record.resumed_from is not None:
            recorder.resumed_from = record.resumed_from
        if record.model_cookies is not None:
            checkpoint.model_cookies = dict(record.model_cookies)
        if record.resource_cookies is not None:
            checkpoint.resource_cookies = dict(record.resource_cookies)
    trajectory = recorder.snapshot()
    checkpoint.seq = seq
    checkpoint.trajectory = trajectory
    checkpoint.output = project_output(trajectory, partial=True)
    return checkpoint


def _expand(record: BoundaryRecord, lists: dict[tuple[int, DeltaField], list[Any]], source: str) -> ModelCall:
    """Rebuild a journaled model call's lists from its deltas; remember its lists for later deltas."""
    call = record.model_call
    assert call is not None
    rebuilt: dict[DeltaField, list[Any]] = {}
    for delta in record.deltas:
        base = lists.get((delta.base, delta.field))
        if base is None:
            raise JournalCorruptError(
                f"{source}: model call {call.index} extends {delta.field} of unknown call {delta.base}"
            )
        rebuilt[delta.field] = base[: delta.keep] + list(delta.append)
    if rebuilt:
        call = _with(call, rebuilt)
    for field in _FIELDS:
        items = _get(call, field)
        if items is not None:
            lists[(call.index, field)] = items
    return call


class BoundaryJournal(AsyncClosing):
    """``checkpoint.jsonl``: the one writer of a rollout's journal (see the module docstring for who runs it).

    Appending is best effort by contract: a boundary that cannot be written (disk full,
    EIO, a record that cannot be serialised) is logged and counted, and the rollout goes
    on. Each append returns once its line is synced (``durable.CheckpointJournal``).

    Example::

        async with BoundaryJournal(path) as journal:
            await journal.append(BoundaryRecord(kind="start", at=time.time(), rollout_id=rid))

    Args:
        path: The journal file.
        inline: Write and sync on the caller's thread (a writer that waits for each
            boundary anyway), not on the journal's writer thread.
    """

    def __init__(self, path: Path, *, inline: bool = False) -> None:
        self._lines = CheckpointJournal(path, inline=inline)
        self._compactor = CallCompactor()
        self._open = False
        self.failures = 0
        """Boundaries that could not be appended."""

    async def __aenter__(self) -> Self:
        """Open the journal file.

        **Cancellation:** the file is closed again.

        Raises:
            DurableWriteError: The journal cannot be opened.
        """
        await self._lines.__aenter__()
        self._open = True
        return self

    async def aclose(self) -> None:
        """Write what is queued and close; a failure to close is logged, not raised.

        **Cancellation:** the file is closed at once; queued lines are still written.
        """
        if self._open:
            self._open = False
            with contextlib.suppress(RollcageError):
                await self._lines.aclose()

    def line(self, record: BoundaryRecord) -> dict[str, Any]:
        """``record`` as its journal line: a model call's repeated lists become deltas against the previous
        call's (so the lines must be written in the order they are made)."""
        if record.model_call is not None:
            call, deltas = self._compactor.compact(record.model_call)
            record = record.model_copy(update={"model_call": call, "deltas": deltas})
        return record.model_dump(mode="json", exclude_none=True)

    def forget_calls(self) -> None:
        """Make the next model call's lists whole again (the lines made since the last write are dropped)."""
        self._compactor = CallCompactor()

    async def write(self, line: dict[str, Any]) -> bool:
        """Append one line made by :meth:`line`; ``False`` (logged and counted) when it could not be.

        **Cancellation:** the line may or may not be on disk.
        """
        try:
            await self._lines.append(line)
        except (RollcageError, TypeError, ValueError) as exc:
            # Evidence is lost for this boundary, the rollout is not. A record the journal cannot
            # serialise (TypeError) is the machinery's failure too, never the policy's.
            self.failures += 1
            logger.error("checkpoint append failed (%d so far), continuing: %s", self.failures, exc)
            return False
        return True

    async def append(self, record: BoundaryRecord) -> bool:
        """Append one boundary (see :meth:`write`).

        **Cancellation:** the boundary may or may not be on disk.
        """
        return await self.write(self.line(record))
