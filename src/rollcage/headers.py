"""Values that others supply, made into HTTP header bytes: the one place that does it.

Every value that ends up in a header of a request rollcage sends comes from someone
else: a cookie an environment set (``/seed_session``, a tool's answer, the model
endpoint), a task id from a dataset row, a credential from the environment. Each
is turned into header bytes here, or refused with a :class:`HeaderValueError`
naming what is wrong, before any HTTP library sees it (httpx encodes a ``str``
header as ASCII and raises ``UnicodeEncodeError`` on anything else; h11 refuses a
control character). Callers decide whose fault a refusal is: an environment's
cookie is the environment's (``ResourceUnavailableError``, infrastructure), a
tampered result's cookie makes a ``grader_error``, a bad credential is the user's
configuration.

Three kinds of value, three rules:

* **Header text** (:func:`header_value`): HTTP's own convention, the one of h11,
  WSGI, ASGI and Starlette: a header's octets are ISO-8859-1 text. A ``str`` of code
  points up to U+00FF becomes those octets, so every value read from a header
  (:func:`parse_set_cookie` decodes the same way) goes back out byte for byte,
  whatever its charset. Control characters (but the tab) and anything beyond
  U+00FF cannot be sent, and are refused.
* **Cookies** (:func:`cookie_header`, :func:`update_cookies`): a ``Set-Cookie``
  is read from the raw header bytes; its name must be visible octets without ``,;=`` and its
  value header text without ``;``; a jar holds at most ``MAX_COOKIES`` cookies of
  at most ``MAX_COOKIE_BYTES`` each. What :func:`update_cookies` keeps,
  :func:`cookie_header` can always send.
* **Ids** (:func:`encode_id`, :func:`decode_id`): a task id is any printable
  Unicode text (``café``, ``日本-1``); in ``X-Task-Id`` and ``X-Rollout-Id`` it is
  percent-encoded UTF-8 (``caf%C3%A9``), reversibly: ``%``, spaces and every
  non-ASCII or control character are encoded, so an id of plain printable ASCII
  without ``%`` is sent unchanged. :func:`id_problem` says why an id is refused
  at dataset validation (control characters, NUL, line and paragraph separators,
  bidirectional overrides, lone surrogates).
"""

from __future__ import annotations

import email.utils
import re
import time
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rollcage.errors import HeaderValueError

__all__ = [
    "MAX_COOKIES",
    "MAX_COOKIE_BYTES",
    "SetCookie",
    "cookie_header",
    "cookie_problem",
    "decode_id",
    "encode_id",
    "header_value",
    "id_problem",
    "parse_cookie_header",
    "parse_set_cookie",
    "set_cookies",
    "update_cookies",
]

MAX_COOKIES = 64
"""The most cookies one jar keeps (a server setting more is refused or ignored, by the caller's choice)."""
MAX_COOKIE_BYTES = 4096
"""The largest cookie (name and value) kept: the size browsers keep (RFC 6265 6.1)."""
_MAX_HEADER_BYTES = 64 * 1024

_HEADER_TEXT = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
"""What a header value may hold (RFC 9110 5.5: visible ASCII, space, tab, obs-text)."""
_COOKIE_NAME = re.compile(r"[\x21-\x2b\x2d-\x3a\x3c\x3e-\x7e\x80-\xff]+")
"""A cookie name: visible octets but ``,``, ``;`` and ``=`` (RFC 6265 asks for a token; servers set
``arr[0]`` and the like, which go back as they came)."""
_ID_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
_REFUSED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
"""Control characters (NUL, newline, DEL...), lone surrogates, line and paragraph separators."""
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Embeddings, overrides and isolates: an id holding one reads otherwise than it compares."""


def header_value(value: str | bytes, *, what: str) -> bytes:
    """``value`` as the octets of a header value (ISO-8859-1 text), or refused.

    Args:
        value: The text (code points up to U+00FF) or the octets themselves.
        what: What the value is, for the error (``"cookie 'lat'"``, ``"X-Task-Id"``).

    Raises:
        HeaderValueError: It holds a control character (other than tab), a code point
            beyond U+00FF, leading or trailing whitespace (it would not survive the
            trip: HTTP strips it), or is over 64 KiB.
    """
    if isinstance(value, bytes):
        try:
            text = value.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            raise HeaderValueError(f"{what} cannot be sent in an HTTP header") from None
    else:
        text = value
    problem = _header_text_problem(text)
    if problem is not None:
        raise HeaderValueError(f"{what} cannot be sent in an HTTP header: {problem}")
    return text.encode("latin-1")


def _header_text_problem(text: str) -> str | None:
    if len(text) > _MAX_HEADER_BYTES:
        return f"it is {len(text)} characters long, over {_MAX_HEADER_BYTES}"
    if _HEADER_TEXT.fullmatch(text):
        if text != text.strip(" \t"):
            return "it starts or ends with whitespace, which HTTP strips"
        return None
    bad = next(ch for ch in text if not _HEADER_TEXT.fullmatch(ch))
    if ord(bad) > 0xFF:
        return f"it holds {_name(bad)}, beyond ISO-8859-1 (header text is octets)"
    return f"it holds the control character {_name(bad)}"


def _name(ch: str) -> str:
    fallback = "a lone surrogate" if unicodedata.category(ch) == "Cs" else "a control character"
    return f"U+{ord(ch):04X} ({unicodedata.name(ch, fallback)})"


# --------------------------------------------------------------------------- cookies


@dataclass(frozen=True, slots=True)
class SetCookie:
    """One ``Set-Cookie`` as rollcage keeps it: a flat name and value, and whether it expires the cookie.

    Domain and path are ignored on purpose: the protocol keeps one flat cookie map per
    rollout and endpoint kind, as the resource servers expect.

    Attributes:
        name: The cookie's name.
        value: Its value as header text (octets as ISO-8859-1), surrounding quotes removed.
        expired: ``Max-Age`` <= 0 or an ``Expires`` in the past: the cookie is to be dropped.
    """

    name: str
    value: str
    expired: bool


def cookie_problem(name: str, value: str) -> str | None:
    """Why the cookie ``name=value`` cannot be kept and sent back in a ``Cookie`` header; ``None``: it can."""
    if not _COOKIE_NAME.fullmatch(name):
        shown = name[:60].encode("unicode_escape").decode("ascii")
        return (
            f"its name {shown!r} is empty or holds a space, a control character, ',', ';', '=' or a "
            "character beyond ISO-8859-1"
        )
    if len(name) + len(value) > MAX_COOKIE_BYTES:
        return f"it is {len(name) + len(value)} bytes long, over {MAX_COOKIE_BYTES}"
    if ";" in value:
        return "its value holds ';', which would split the Cookie header"
    problem = _header_text_problem(value)
    return f"its value cannot be sent: {problem}" if problem is not None else None


def cookie_header(cookies: Mapping[str, str]) -> bytes:
    """The ``Cookie`` header value (octets) for ``cookies``.

    Raises:
        HeaderValueError: A cookie cannot be sent (see :func:`cookie_problem`); the message names it.
    """
    parts: list[bytes] = []
    for name, value in cookies.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise HeaderValueError(f"cookie {name!r} cannot be sent: its name and value must be text")
        problem = cookie_problem(name, value)
        if problem is not None:
            shown = name[:60].encode("unicode_escape").decode("ascii")
            raise HeaderValueError(f"cookie {shown!r} cannot be sent in an HTTP header: {problem}")
        parts.append(f"{name}={value}".encode("latin-1"))
    return b"; ".join(parts)


def parse_set_cookie(header: str | bytes) -> SetCookie | None:
    """One ``Set-Cookie`` header (octets, or their ISO-8859-1 text); ``None`` if it names no cookie."""
    text = header.decode("latin-1") if isinstance(header, bytes) else header
    first, _, attributes = text.partition(";")
    name, sep, value = first.partition("=")
    name = name.strip(" \t")
    if not sep or not name:
        return None
    value = value.strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return SetCookie(name, value, _expired(attributes))


def _expired(attributes: str) -> bool:
    expired = False
    for attribute in attributes.split(";"):
        key, _, arg = attribute.partition("=")
        key = key.strip().lower()
        arg = arg.strip()
        if key == "max-age":
            try:
                return int(arg) <= 0  # Max-Age wins over Expires (RFC 6265 5.3)
            except ValueError:
                continue
        if key == "expires":
            try:
                when = email.utils.parsedate_to_datetime(arg)
            except (TypeError, ValueError, OverflowError, IndexError):
                continue
            try:
                expired = when.timestamp() <= time.time()
            except (OverflowError, ValueError, OSError):
                continue
    return expired


def set_cookies(headers: Iterable[tuple[bytes, bytes]]) -> list[SetCookie]:
    """Every ``Set-Cookie`` of raw header pairs (``httpx.Response.headers.raw``), read from their octets."""
    found: list[SetCookie] = []
    for key, raw in headers:
        if key.lower() == b"set-cookie":
            parsed = parse_set_cookie(raw)
            if parsed is not None:
                found.append(parsed)
    return found


def update_cookies(jar: dict[str, str], headers: Iterable[tuple[bytes, bytes]], *, strict: bool) -> list[str]:
    """Apply every ``Set-Cookie`` of ``headers`` to ``jar``; a cookie that cannot be kept is left out.

    Args:
        jar: The cookies, updated in place (every one in it can be sent by :func:`cookie_header`).
        headers: The answer's raw header pairs.
        strict: Raise on the first cookie that cannot be kept (an environment's session must be
            whole, or the rollout is not the policy's to fail); else leave it out and report it.

    Returns:
        Why each cookie left out was left out (``[]`` when every one was kept).

    Raises:
        HeaderValueError: With ``strict``, a cookie cannot be kept (the jar is then unchanged).
    """
    updated = dict(jar)
    problems: list[str] = []
    for cookie in set_cookies(headers):
        if cookie.expired:
            updated.pop(cookie.name, None)
            continue
        problem = cookie_problem(cookie.name, cookie.value)
        if problem is None and cookie.name not in updated and len(updated) >= MAX_COOKIES:
            problem = f"the jar already holds {MAX_COOKIES} cookies"
        if problem is None:
            updated[cookie.name] = cookie.value
            continue
        shown = cookie.name[:60].encode("unicode_escape").decode("ascii")
        message = f"cookie {shown!r} cannot be kept: {problem}"
        if strict:
            raise HeaderValueError(message)
        problems.append(message)
    jar.clear()
    jar.update(updated)
    return problems


def parse_cookie_header(value: bytes) -> dict[str, str]:
    """The cookies of a ``Cookie`` request header (octets); pairs that could not be sent back are left out."""
    cookies: dict[str, str] = {}
    for pair in value.decode("latin-1").split(";"):
        name, sep, val = pair.partition("=")
        name, val = name.strip(" \t"), val.strip(" \t")
        if sep and cookie_problem(name, val) is None:
            cookies[name] = val
    return cookies


# --------------------------------------------------------------------------- ids


def id_problem(text: str) -> str | None:
    """Why ``text`` cannot be a task id; ``None`` when it can (any printable Unicode text can).

    Refused: control characters (NUL, newline, tab, DEL, C1), lone surrogates, the line and
    paragraph separators (U+2028, U+2029) and bidirectional embeddings, overrides and isolates.
    """
    for position, ch in enumerate(text):
        if unicodedata.category(ch) in _REFUSED_CATEGORIES or ch in _BIDI_CONTROLS:
            return f"character {position} is {_name(ch)}, which an id may not hold"
    return None


def encode_id(text: str) -> bytes:
    """An id as a header value: percent-encoded UTF-8, printable ASCII but ``%`` as it is.

    Raises:
        HeaderValueError: The id holds a lone surrogate (no UTF-8 exists for it).
    """
    try:
        return urllib.parse.quote(text, safe=_ID_SAFE, encoding="utf-8", errors="strict").encode("ascii")
    except UnicodeEncodeError as exc:
        raise HeaderValueError(f"id {text[:60]!r} cannot be sent in an HTTP header: {exc.reason}") from None


def decode_id(value: str | bytes) -> str:
    """An id read back from its header value (:func:`encode_id`'s inverse); bad escapes stay as they are."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return urllib.parse.unquote(text, encoding="utf-8", errors="replace")
