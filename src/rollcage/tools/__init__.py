"""Tools of the agent: a persistent Python executor, bash, a file editor and HTTP resource tools.

Every call has a timeout and a bounded output. The executor has one interface
(:class:`Executor`) and two backends built by :func:`make_executor`: ``repl``
(a lean child process, the default) and ``jupyter`` (an ipykernel, imported only
when chosen). :class:`ResourceTools` posts tool calls to resource endpoints.

Importing this package is cheap: no ``jupyter_client``, ``starlette`` or other
heavy dependency is loaded until a backend that needs it is built.
"""

from rollcage.tools._editor import FileEditor
from rollcage.tools._executor import (
    BridgedTools,
    CellResult,
    CellStatus,
    Executor,
    ExecutorState,
    ToolBridge,
    bound_middle,
    make_executor,
)
from rollcage.tools._forked import TemplateLink as ExecutorTemplateLink
from rollcage.tools._forked import adopt as adopt_executor_template
from rollcage.tools._resources import ResourceTools, tool_parameters
from rollcage.tools._shell import ShellResult, ShellSession

__all__ = [
    "BridgedTools",
    "CellResult",
    "CellStatus",
    "Executor",
    "ExecutorState",
    "ExecutorTemplateLink",
    "FileEditor",
    "ResourceTools",
    "ShellResult",
    "ShellSession",
    "ToolBridge",
    "adopt_executor_template",
    "bound_middle",
    "make_executor",
    "prepare_repl",
    "tool_parameters",
]


def prepare_repl() -> None:
    """Compile the ``repl`` backend's child once, now (a warm template does it for all its workers)."""
    from rollcage.tools._repl import child_code

    child_code()
