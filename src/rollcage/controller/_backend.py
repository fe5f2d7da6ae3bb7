"""Backends execute the unit of work, ``run_rollout``; the scheduler only sees this interface."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Protocol, Self

from rollcage.controller._unit import (
    PreparedRollout,
    RolloutSettings,
    SuperviseFn,
    build_supervisor_config,
    run_rollout,
)
from rollcage.errors import ConfigError
from rollcage.protocol import RolloutRecord

__all__ = ["Backend", "LocalBackend"]


class Backend(Protocol):
    """Runs prepared rollouts somewhere and returns their records.

    Lifecycle: ``async with backend:`` around every ``run``.
    """

    async def __aenter__(self) -> Self:
        """Acquire what the backend needs (check the supervisor, connect to a cluster).

        **Cancellation:** whatever was acquired is released before the cancellation propagates.
        """
        ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release it.

        **Cancellation:** the release runs to its end (shielded), then the cancellation propagates.
        """
        ...

    async def run(self, prepared: PreparedRollout, *, stop: asyncio.Event) -> RolloutRecord:
        """Run one attempt and return its record (never raises for a failed rollout).

        **Cancellation:** the attempt is stopped and no record is returned.
        """
        ...


class LocalBackend:
    """Each rollout is supervised in this process (``rollcage.supervisor``), on this machine."""

    def __init__(
        self,
        settings: RolloutSettings,
        *,
        supervise: SuperviseFn | None = None,
        supervisor_config: Any = None,
    ) -> None:
        """Prepare; the supervisor is imported on enter, so a missing one fails before any rollout.

        Args:
            settings: How rollouts are supervised and graded.
            supervise: Replacement supervisor entry point (a fake, in tests).
            supervisor_config: Replacement supervisor config (with ``supervise``).
        """
        self._settings = settings
        self._supervise = supervise
        self._config = supervisor_config
        self._state: str = "unopened"

    async def __aenter__(self) -> Self:
        """Resolve the supervisor and its config.

        Raises:
            ConfigError: The supervisor is not available or refuses the settings.

        **Cancellation:** not a suspension point: nothing is acquired.
        """
        if self._state != "unopened":
            raise RuntimeError(f"LocalBackend cannot be entered when {self._state}")
        if self._supervise is None:
            try:
                from rollcage.supervisor import supervise_rollout

                self._supervise = supervise_rollout
                if self._config is None:
                    self._config = build_supervisor_config(self._settings)
            except ImportError as exc:
                raise ConfigError(f"the supervisor is not available: {exc}") from exc
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"the supervisor refused the settings: {exc}") from exc
        self._state = "opened"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Nothing to release locally.

        **Cancellation:** not a suspension point.
        """
        self._state = "closed"

    async def run(self, prepared: PreparedRollout, *, stop: asyncio.Event) -> RolloutRecord:
        """Run ``run_rollout`` here.

        **Cancellation:** propagates into the supervisor, which reaps the worker.
        """
        if self._state != "opened":
            raise RuntimeError("LocalBackend.run outside 'async with backend:'")
        return await run_rollout(
            prepared, self._settings, stop=stop, supervise=self._supervise, supervisor_config=self._config
        )
