"""Making untrusted text safe and short enough to look at.

Everything the viewer shows comes from the agent, the model or the environment,
so none of it is trusted: control characters could drive the user's terminal
(an ESC sequence in a tool output can recolour, hide or rewrite the screen), and
one runaway output can be megabytes long.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

__all__ = ["clean_text", "clip", "format_duration", "format_tokens", "format_utc", "pretty_arguments"]

# C0 controls (but tab and newline), DEL and the C1 block become visible symbols
# rather than being passed to a terminal or silently dropped in a browser.
_CONTROL_MAP: dict[int, str] = {code: chr(0x2400 + code) for code in range(0x20) if code not in (9, 10)}
_CONTROL_MAP[0x7F] = "\u2421"
_CONTROL_MAP.update({code: "\ufffd" for code in range(0x80, 0xA0)})


def clean_text(text: str) -> str:
    """Return ``text`` with terminal-control characters replaced by visible symbols.

    ``\\r\\n`` becomes ``\\n`` first, so Windows line ends are not shown as symbols.
    """
    return text.replace("\r\n", "\n").translate(_CONTROL_MAP)


def clip(text: str, limit: int) -> str:
    """Return at most ``limit`` characters of ``text``, saying how many were cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit:,} more characters]"


def pretty_arguments(arguments: str) -> tuple[str, bool]:
    """Pretty-print tool arguments if they are a JSON object; return ``(text, is_json)``.

    Code cells (codeact) and malformed JSON come back unchanged, because showing
    exactly what the model wrote is the point.
    """
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments, False
    if not isinstance(value, dict | list):
        return arguments, False
    return json.dumps(value, indent=2, ensure_ascii=False), True


def format_duration(seconds: float | None) -> str:
    """``1.23 s``, ``45 ms``, ``2 m 03 s``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(seconds, 60)
    return f"{minutes:.0f} m {rest:02.0f} s"


def format_tokens(value: int | None) -> str:
    """A token count, or ``?`` when the server did not report it (never a guessed 0)."""
    return "?" if value is None else f"{value:,}"


def format_utc(timestamp: float | None) -> str:
    """A Unix time as an ISO-8601 UTC string to the second; ``?`` when unknown."""
    if timestamp is None:
        return "?"
    try:
        return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return "?"
