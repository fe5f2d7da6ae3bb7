"""The worker's side of a harness rollout: what runs inside the sandbox, beside the worker.

:class:`HarnessRunner` takes the builtin loop's place in the worker: it serves the
model route on loopback (:class:`~rollcage.harness.Forwarder`), starts the harness
in the executor's cage (NOOA through :data:`NOOA_ADAPTER`, a script its own
interpreter runs; a command as given), reads the events it reports, and builds the
result's trajectory from both. It imports the agent's loop and the tools, so it
lives apart from the rest of :mod:`rollcage.harness`, which the supervisor and the
controller import (see there for how the room is split by the sandbox's wall).
"""

from rollcage.harness.worker._runner import NOOA_ADAPTER, HarnessRunner, HarnessSink, task_text

__all__ = ["NOOA_ADAPTER", "HarnessRunner", "HarnessSink", "task_text"]
