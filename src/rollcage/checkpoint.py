"""Folding a checkpoint journal into a ``Checkpoint``: evidence of an interrupted rollout.

A checkpoint is never a result and never graded (``partial`` is always true). It
holds every boundary that reached the disk: finished model calls, the tool calls
they requested (pending until a later record ends them), and the latest cookies.
"""

from __future__ import annotations

import os

from rollcage.durable import read_journal
from rollcage.errors import JournalCorruptError
from rollcage.protocol import BoundaryRecord, Checkpoint, ModelCall, RequestDelta
from rollcage.trajectory import TrajectoryRecorder, project_output

__all__ = ["RequestCompactor", "fold_records", "load_checkpoint"]

_LIST_KEYS = ("messages", "input")


class RequestCompactor:
    """Turns each model call's full request into a delta against the previous one.

    Every request repeats the whole conversation so far; journaling it whole would
    make each boundary O(transcript). The delta keeps a boundary O(new items).
    """

    def __init__(self) -> None:
        """Start with no earlier request."""
        self._previous: tuple[int, str, list[object]] | None = None

    def compact(self, call: ModelCall) -> tuple[ModelCall, RequestDelta | None]:
        """Return the call with its conversation list removed, and the delta that rebuilds it."""
        key = next((k for k in _LIST_KEYS if isinstance(call.request.get(k), list)), None)
        if key is None:
            return call, None
        items: list[object] = call.request[key]
        previous, self._previous = self._previous, (call.index, key, items)
        if previous is None or previous[1] != key:
            return call, None
        base, _, before = previous
        keep = 0
        # Identity first: the client builds each request from the same item objects,
        # so most of the prefix compares in O(1) per item.
        for old, new in zip(before, items, strict=False):
            if old is not new and old != new:
                break
            keep += 1
        request = {k: v for k, v in call.request.items() if k != key}
        delta = RequestDelta(key=key, base=base, keep=keep, append=list(items[keep:]))
        return call.model_copy(update={"request": request}), delta


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a ``checkpoint.jsonl`` journal and fold it into a partial ``Checkpoint``.

    A missing or empty journal gives an empty checkpoint (``seq is None``); a torn
    last line is ignored.

    Raises:
        JournalCorruptError: a line other than the last is damaged, or a record
            does not have the shape of a boundary record.
    """
    return fold_records(read_journal(path), source=str(path))


def fold_records(records: list[dict[str, object]], *, source: str = "journal") -> Checkpoint:
    """Fold journal records (each with ``seq``) into a ``Checkpoint``."""
    recorder = TrajectoryRecorder()
    checkpoint = Checkpoint()
    lists: dict[int, list[object]] = {}
    seq: int | None = None
    for raw in records:
        body = {k: v for k, v in raw.items() if k != "seq"}
        try:
            record = BoundaryRecord.model_validate(body)
        except ValueError as exc:
            raise JournalCorruptError(
                f"{source}: record seq={raw.get('seq')} is not a boundary record: {exc}"
            ) from exc
        seq = int(str(raw["seq"]))
        if record.kind == "start":
            checkpoint.rollout_id = record.rollout_id
        elif record.kind == "model_call" and record.model_call is not None:
            recorder.add_model_call(_expand(record, lists, source))
        for tool in record.tool_calls:
            recorder.apply(tool)
        if record.model_cookies is not None:
            checkpoint.model_cookies = dict(record.model_cookies)
        if record.resource_cookies is not None:
            checkpoint.resource_cookies = dict(record.resource_cookies)
    trajectory = recorder.snapshot()
    checkpoint.seq = seq
    checkpoint.trajectory = trajectory
    checkpoint.output = project_output(trajectory, partial=True)
    return checkpoint


def _expand(record: BoundaryRecord, lists: dict[int, list[object]], source: str) -> ModelCall:
    """Rebuild a journaled model call's full request from its delta."""
    call = record.model_call
    assert call is not None
    delta = record.request_delta
    if delta is not None:
        if delta.base not in lists:
            raise JournalCorruptError(f"{source}: model call {call.index} extends unknown call {delta.base}")
        items = lists[delta.base][: delta.keep] + list(delta.append)
        call = call.model_copy(update={"request": {**call.request, delta.key: items}})
    key = next((k for k in _LIST_KEYS if isinstance(call.request.get(k), list)), None)
    if key is not None:
        lists[call.index] = call.request[key]
    return call
