"""The bundled resource environments, importable so they work from an installed package.

An *environment* is an HTTP app (the NeMo Gym convention) that offers tools as JSON
endpoints (``POST /<tool>`` with the arguments as the body) and a ``POST /verify``
endpoint that grades a finished rollout. The controller starts a bundled
environment on loopback when a dataset row names it; an external environment is
any URL serving the same endpoints.

The registry is plain data: nothing is registered as a side effect of an import,
and an environment's app module is imported only when it is started.

The controller speaks NeMo Gym's resource-server protocol to every environment
(see ``rollcage.controller._nemo_gym``): ``POST /seed_session`` before the rollout
(404: not offered), the agent's tool calls with the session cookies, ``POST /verify``
after it, ``POST /close_session`` last (404: not offered); cookies travel as a
``Cookie`` header. ``/verify`` request body (JSON)::

    {"responses_create_params": {...},          # the task's Responses request (NeMo Gym's)
     "response": {...},                         # the rollout as a complete NeMo Gym response object
     <the row's verifier fields>,               # NeMo Gym rows' extra fields; 'expected' for rollcage rows
     "task_id": str, "rollout_id": str, "outcome": str, "output_text": str,
     "workspace_files": {relative path: text}}  # only when the grader asks for files

and its answer: ``{"reward": float, "mask_sample": bool?, "failure_kind": str?,
"detail": {...}?}`` plus any other fields (NeMo Gym's ``BaseVerifyResponse`` echoes
the request; the echo is not kept). Bundled environments require
``Authorization: Bearer <token>`` on ``/seed_session``, ``/verify`` and
``/close_session`` with a token only the controller knows, because the sandbox can
reach the tool endpoints (through the egress proxy) and must not be able to probe
its own grader or reset its session.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollcage.errors import ConfigError

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["EnvironmentInfo", "ToolInfo", "bundled_environments", "create_app", "get_environment"]


@dataclass(frozen=True)
class ToolInfo:
    """One tool an environment serves.

    Attributes:
        name: Tool name the model sees (and the Python function name in codeact mode).
        description: Tool description the model sees.
        parameters: JSON Schema of the arguments.
        path: Endpoint path; ``None`` means ``/<name>``.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    path: str | None = None


@dataclass(frozen=True)
class EnvironmentInfo:
    """A bundled environment, described without importing its app.

    Attributes:
        name: The name dataset rows use in ``environment``.
        description: One line for listings and errors.
        app: ``module:function`` of the app factory, called as ``factory(verify_token=...)``.
        tools: The tools it serves.
        default_tools: Tools offered when a row names none (``python`` is the executor).
        verify_files: Workspace files (relative paths) sent to ``/verify`` by default.
    """

    name: str
    description: str
    app: str
    tools: tuple[ToolInfo, ...] = ()
    default_tools: tuple[str, ...] = ("python",)
    verify_files: tuple[str, ...] = field(default=())


_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

_BUNDLED: dict[str, EnvironmentInfo] = {
    "calc-weather": EnvironmentInfo(
        name="calc-weather",
        description="Stateful weather lookups (session by cookie) plus Python calculation.",
        app="rollcage.environments.calc_weather:create_app",
        tools=(
            ToolInfo(
                name="get_weather",
                description="Current weather of a city: temperature and condition (cold, mild, hot).",
                parameters=_CITY,
            ),
            ToolInfo(
                name="set_units",
                description="Choose the temperature units of later get_weather answers in this session.",
                parameters={
                    "type": "object",
                    "properties": {"units": {"type": "string", "enum": ["C", "F"]}},
                    "required": ["units"],
                },
            ),
        ),
        default_tools=("python", "get_weather", "set_units"),
    ),
    "nemo-counter": EnvironmentInfo(
        name="nemo-counter",
        description="A stateful counter written the NeMo Gym way (seed/verify/close sessions by cookie).",
        app="rollcage.environments.counter:create_app",
        tools=(
            ToolInfo(
                name="increment_counter",
                description="Add count to this session's counter.",
                parameters={
                    "type": "object",
                    "properties": {"count": {"type": "integer"}},
                    "required": ["count"],
                },
            ),
            ToolInfo(
                name="get_counter_value",
                description="This session's counter value.",
                parameters={"type": "object", "properties": {}},
            ),
        ),
        default_tools=("increment_counter", "get_counter_value"),
    ),
    "code-fn": EnvironmentInfo(
        name="code-fn",
        description="Write a Python function to solution.py; graded by hidden tests run outside the sandbox.",
        app="rollcage.environments.code_fn:create_app",
        default_tools=("python",),
        verify_files=("solution.py",),
    ),
}


def bundled_environments() -> dict[str, EnvironmentInfo]:
    """The bundled environments by name."""
    return dict(_BUNDLED)


def get_environment(name: str) -> EnvironmentInfo:
    """The bundled environment called ``name``.

    Raises:
        ConfigError: No bundled environment has that name.
    """
    try:
        return _BUNDLED[name]
    except KeyError:
        raise ConfigError(
            f"unknown environment {name!r}: use one of {', '.join(sorted(_BUNDLED))} "
            "or the http(s) URL of a resource server"
        ) from None


def create_app(name: str, *, verify_token: str | None = None) -> Starlette:
    """Build the app of a bundled environment (importing its module now).

    Args:
        name: A bundled environment's name.
        verify_token: Bearer token ``/verify`` requires; ``None`` leaves it open (tests only).

    Raises:
        ConfigError: No bundled environment has that name.
    """
    info = get_environment(name)
    module_name, _, attr = info.app.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    app: Starlette = factory(verify_token=verify_token)
    return app
