"""The one entry point, ``rollcage``.

``rollcage worker`` runs once per rollout inside the sandbox, so it is dispatched
before typer (and rich, which typer pulls in) is imported: every millisecond of
the worker's start is paid by every rollout. All other verbs go through typer.

Every error a user can cause on the command line ends the same way: one line on
stderr, ``rollcage VERB: what is wrong``, and exit code 2 (1 where the
environment, not the command, failed: a disk that refuses a write), never a
traceback and never a usage panel. Help (``--help``, or no arguments) is shown
as usual.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

__all__ = ["app", "main"]

EXIT_USAGE = 2
EXIT_ENVIRONMENT = 1


def main() -> None:
    """Console-script entry point."""
    argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        from rollcage.procs import hold_cancel_signals

        # First: a SIGTERM before the worker's handlers are in place would kill it with no result.
        # Held, it cancels the rollout once they are (rollcage.worker lets it go then).
        hold_cancel_signals()
        from rollcage.worker import run_worker

        run_worker(argv[1:])
    if argv[:1] == ["template"]:
        from rollcage.warm import template_main

        raise SystemExit(template_main(argv[1:]))
    raise SystemExit(_dispatch(argv))


def _dispatch(argv: list[str]) -> int:
    import typer
    import typer.main

    from rollcage.commands import one_line
    from rollcage.errors import ConfigError, RollcageError

    usage_error, click_exception, no_args_is_help = _click_errors()
    verb = next((word for word in argv if not word.startswith("-")), "")
    command = typer.main.get_command(_build_app(verb))
    where = f"rollcage {verb}".rstrip()

    def say(message: str) -> None:
        typer.echo(f"{where}: {one_line(message)}", err=True)

    try:
        code = command.main(args=argv, prog_name="rollcage", standalone_mode=False)
    except no_args_is_help as exc:
        exc.show()  # the help text, as asked for by giving no arguments
        return int(exc.exit_code)
    except usage_error as exc:
        say(f"{exc.format_message()} (see --help)")
        return EXIT_USAGE
    except click_exception as exc:
        say(exc.format_message())
        return int(exc.exit_code)
    except typer.Abort:
        say("aborted")
        return 130
    except ConfigError as exc:
        say(str(exc))
        return EXIT_USAGE
    except (RollcageError, OSError) as exc:
        say(str(exc))
        return EXIT_ENVIRONMENT
    return code if isinstance(code, int) else 0


def _click_errors() -> tuple[type[Any], type[Any], type[Any]]:
    """click's UsageError, ClickException and NoArgsIsHelpError, wherever this typer takes click from.

    typer 0.12 uses click itself, recent versions a vendored copy: the classes are
    found through ``typer.BadParameter``'s bases, which both share.
    """
    import typer

    bases = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
    usage, base = bases["UsageError"], bases["ClickException"]
    no_args = getattr(sys.modules[usage.__module__], "NoArgsIsHelpError", None)

    class _Never(Exception):
        pass

    return usage, base, no_args or _Never


def _build_app(verb: str | None = None) -> typer.Typer:
    """The application; ``verb``, where known, lets the others leave out what it does not need."""
    import typer

    from rollcage.commands import register

    app = typer.Typer(
        name="rollcage",
        help="Crash-safe, sandboxed agent rollouts for RL and evaluation.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    register(app, verb=verb)
    return app


def app() -> None:
    """Run the typer application (for ``python -m rollcage``)."""
    main()
