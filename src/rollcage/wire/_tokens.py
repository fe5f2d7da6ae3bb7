"""Token data read strictly off the wire: ids and log probabilities a trainer can trust, or none.

Servers send token data in several shapes: vLLM's ``prompt_token_ids`` and
``token_ids``, its ``logprobs`` entries (whose tokens read ``token_id:N`` with
``return_tokens_as_token_ids``) and ``prompt_logprobs``; NeMo Gym's arrays on a
message or output item. Whatever the shape, a value is kept only when it is what
it claims to be:

* a token id is a JSON integer (not a boolean, a string or a float) in
  ``0 .. 2**63 - 1`` (int64, what every tokenizer and trainer stores); in the
  ``token_id:N`` form, ``N`` is written in ASCII digits and lies in that range;
* a log probability is a finite JSON number ``<= 0``.

An array holding one value that is not is dropped whole, with a note naming the
field, the position and the value (the notes become ``CallTokens.note``); the
model call itself stands, so its status says what was kept (``partial`` or
``unobserved``, never ``observed``). Each reader appends its notes to the list it
is given and returns the array, or ``None`` when there is none to keep.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rollcage.protocol import MAX_TOKEN_ID

__all__ = [
    "read_entries",
    "read_log_probs",
    "read_prompt_log_probs",
    "read_token_ids",
]

_TOKEN_ID_PREFIX = "token_id:"
_DIGITS = re.compile(r"[0-9]{1,19}")
_SHOWN = 60


def read_token_ids(value: Any, where: str, notes: list[str]) -> list[int] | None:
    """``value`` as token ids, or ``None`` (with a note unless it is absent)."""
    if value is None:
        return None
    if not isinstance(value, list):
        notes.append(f"{where} is {_shown(value)}, not an array; it was dropped")
        return None
    for position, item in enumerate(value):
        problem = _id_problem(item)
        if problem is not None:
            notes.append(f"{where}[{position}] is {problem}; {where} was dropped")
            return None
    return list(value)


def read_log_probs(value: Any, where: str, notes: list[str]) -> list[float] | None:
    """``value`` as log probabilities, or ``None`` (with a note unless it is absent)."""
    if value is None:
        return None
    if not isinstance(value, list):
        notes.append(f"{where} is {_shown(value)}, not an array; it was dropped")
        return None
    probs: list[float] = []
    for position, item in enumerate(value):
        prob = _log_prob(item)
        if isinstance(prob, str):
            notes.append(f"{where}[{position}] is {prob}; {where} was dropped")
            return None
        probs.append(prob)
    return probs


def read_entries(
    entries: Any, where: str, notes: list[str], *, ids: bool = True, probs: bool = True
) -> tuple[list[int] | None, list[float] | None]:
    """Token ids and log probabilities of OpenAI-style logprob entries (``{"token", "logprob", ...}``).

    The ids come only from tokens written ``token_id:N`` (all of them: text tokens give no ids);
    the log probabilities only when every entry has one. ``ids``/``probs`` ``False``: that half is
    taken from elsewhere, so it is neither read nor noted here.
    """
    if entries is None:
        return None, None
    if not isinstance(entries, list):
        notes.append(f"{where} is {_shown(entries)}, not an array; it was dropped")
        return None, None
    tokens: list[Any] = []
    raw_probs: list[Any] = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            notes.append(f"{where}[{position}] is {_shown(entry)}, not an object; {where} was dropped")
            return None, None
        tokens.append(entry.get("token"))
        raw_probs.append(entry.get("logprob"))
    values: list[float] | None = None
    if probs and all(prob is not None for prob in raw_probs):
        values = []
        for position, prob in enumerate(raw_probs):
            value = _log_prob(prob)
            if isinstance(value, str):
                notes.append(f"{where}[{position}].logprob is {value}; the log probabilities were dropped")
                values = None
                break
            values.append(value)
    return (_entry_ids(tokens, where, notes) if ids else None), values


def read_prompt_log_probs(
    entries: Any, prompt: list[int] | None, where: str, notes: list[str]
) -> list[float | None] | None:
    """Each prompt token's log probability from vLLM's ``prompt_logprobs`` (``None`` where there is none).

    Each position is ``None`` or ``{token id: {"logprob": ...}, ...}``; the prompt's own token is
    the one read (the only one, when the prompt's ids are unknown).
    """
    if entries is None:
        return None
    if not isinstance(entries, list):
        notes.append(f"{where} is {_shown(entries)}, not an array; it was dropped")
        return None
    values: list[float | None] = []
    for position, entry in enumerate(entries):
        if entry is None:
            values.append(None)
            continue
        if not isinstance(entry, dict):
            notes.append(f"{where}[{position}] is {_shown(entry)}, not an object; {where} was dropped")
            return None
        if prompt is not None and position < len(prompt):
            chosen = entry.get(str(prompt[position]))
        elif len(entry) == 1:
            chosen = next(iter(entry.values()))
        else:
            return None  # which of the alternatives was the prompt's token cannot be told
        raw = chosen.get("logprob") if isinstance(chosen, dict) else None
        if raw is None:
            values.append(None)
            continue
        value = _log_prob(raw)
        if isinstance(value, str):
            notes.append(f"{where}[{position}] logprob is {value}; {where} was dropped")
            return None
        values.append(value)
    return values


def _entry_ids(tokens: list[Any], where: str, notes: list[str]) -> list[int] | None:
    spelled = [isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX) for token in tokens]
    if tokens and not any(spelled):
        return None  # text tokens: the server was not asked for ids in this form
    ids: list[int] = []
    for position, token in enumerate(tokens):
        digits = token[len(_TOKEN_ID_PREFIX) :] if spelled[position] else None
        value = int(digits) if digits is not None and _DIGITS.fullmatch(digits) else None
        if value is None or value > MAX_TOKEN_ID:
            notes.append(
                f"{where}[{position}].token is {_shown(token)}, not 'token_id:N' with N in 0..2^63-1; "
                "the token ids were dropped"
            )
            return None
        ids.append(value)
    return ids


def _id_problem(item: Any) -> str | None:
    if type(item) is not int:  # a bool is an int to Python, never a token id
        return f"{_shown(item)}, not an integer token id"
    if not 0 <= item <= MAX_TOKEN_ID:
        return f"{_shown(item)}, outside the int64 token id range 0..2^63-1"
    return None


def _log_prob(item: Any) -> float | str:
    """The log probability ``item`` is, or what is wrong with it."""
    if isinstance(item, bool) or not isinstance(item, int | float):
        return f"{_shown(item)}, not a number"
    if item > 0:
        return f"{_shown(item)}, above 0 (a probability over 1)"
    try:
        value = float(item)
    except OverflowError:
        value = -math.inf
    if not math.isfinite(value):
        return f"{_shown(item)}, not a finite number"
    return value


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
