"""Inspect AI's prompt and scoring rules for plain samples, reproduced (Inspect AI 0.3.285).

An Inspect sample says nothing of its solver or scorer: its task does. What rollcage
reproduces, and how a sample gets it (see ``rollcage.controller._formats.from_inspect``):

* a sample without ``choices`` runs as ``generate()`` runs it: its messages as they are,
  no tools, no system prompt, and is scored by ``match()`` (``location="end"``,
  ``ignore_case=True``), the scorer Inspect's documentation starts with;
* a sample with ``choices`` runs as ``multiple_choice()`` runs it: the last user message
  becomes Inspect's template (``ANSWER: $LETTER``, the letters named, ``A) ...`` options),
  the multiple-answer template when the target names more than one letter, and is scored
  by ``choice()``.

``match()`` with ``numeric=True`` is not reproduced (its number parsing reads every Unicode
numeral); rollcage's own ``numeric`` grader is the nearest. Pure functions: no I/O.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "MatchLocation",
    "answer_character",
    "choice_positions",
    "choice_prompt",
    "includes",
    "match_str",
    "parse_answers",
    "selected_positions",
]

MatchLocation = Literal["begin", "end", "any", "exact"]
"""Where ``match()`` looks for the target in the answer."""

_PUNCTUATION = string.whitespace + string.punctuation

_SINGLE_ANSWER = (
    "Answer the following multiple choice question. The entire content of your response should be of the "
    "following format: 'ANSWER: $LETTER' (without quotes) where LETTER is one of {letters}.\n\n"
    "{question}\n\n{choices}"
)
_MULTIPLE_ANSWER = (
    "Answer the following multiple choice question where multiple answers may be correct. The entire "
    "content of your response should be of the following format: 'ANSWER: $LETTERS' (without quotes) where "
    "LETTERS is one or more of {letters}.\n\n{question}\n\n{choices}"
)


def match_str(value: str, target: str, location: MatchLocation = "end", *, ignore_case: bool = True) -> bool:
    """Whether ``match()`` finds ``target`` in the answer ``value`` (its non-numeric rule).

    Both are stripped of whitespace, case-folded (``ignore_case``), then stripped of
    leading and trailing whitespace and ASCII punctuation before the comparison.
    """
    v, t = value.strip(), target.strip()
    if ignore_case:
        v, t = v.casefold(), t.casefold()
    v, t = v.strip(_PUNCTUATION), t.strip(_PUNCTUATION)
    if location == "begin":
        return v.startswith(t)
    if location == "end":
        return v.endswith(t)
    if location == "exact":
        return v == t
    return t in v


def includes(value: str, target: str, *, ignore_case: bool = True) -> bool:
    """Whether ``includes()`` finds ``target`` in the answer ``value`` (no stripping at all)."""
    if ignore_case:
        value, target = value.casefold(), target.casefold()
    return target in value


def answer_character(index: int) -> str:
    """Inspect's option label: ``A``..``Z``, then ``1``, ``2``..."""
    return chr(ord("A") + index) if index < 26 else str(index - 25)


def _answer_index(char: str) -> int:
    if len(char) == 1 and char.isalpha():
        return ord(char.upper()) - ord("A")
    if char.isnumeric():
        if int(char) == 0:
            raise ValueError(f"unexpected multiple choice answer {char!r} (numeric choices start at 1)")
        return 25 + int(char)
    raise ValueError(f"unexpected multiple choice answer {char!r} (must be a letter or number)")


def choice_positions(target: str | Sequence[str], choices: int) -> list[int]:
    """The option positions a multiple-choice target names, as ``choice()`` reads it.

    ``"A"``, ``"A, C"``, ``"AC"`` and ``["A", "C"]`` all name options; a number names
    option 26 onwards (Inspect's labels past ``Z``).

    Raises:
        ValueError: A letter names no option (Inspect refuses such a target too).
    """
    values = [target] if isinstance(target, str) else list(target)
    answers: list[str] = []
    for value in values:
        for token in value.replace(",", " ").split():
            answers.extend([token] if token.isnumeric() else list(token))
    positions = [_answer_index(answer) for answer in answers]
    beyond = [answer for answer, position in zip(answers, positions, strict=True) if position >= choices]
    if beyond:
        raise ValueError(f"the target names answer(s) beyond the {choices} choices: {', '.join(beyond)}")
    return positions


def choice_prompt(question: str, choices: Sequence[str], *, multiple_correct: bool) -> str:
    """The user message ``multiple_choice()`` sends in place of ``question`` (its default templates)."""
    options = "\n".join(f"{answer_character(i)}) {choice}" for i, choice in enumerate(choices))
    letters = ",".join(answer_character(i) for i in range(len(choices)))
    template = _MULTIPLE_ANSWER if multiple_correct else _SINGLE_ANSWER
    return template.format(choices=options, letters=letters, question=question)


def parse_answers(completion: str, choices: int, *, multiple_correct: bool) -> set[str]:
    """The option letters an answer selects, read as ``multiple_choice()`` reads them (empty: none)."""
    completion = re.sub(r"\x24\s*([A-Za-z\d][A-Za-z\d ,]*?)\s*\x24", r"\1", completion)
    completion = re.sub(r"\*\*\s*([A-Za-z\d][A-Za-z\d ,]*?)\s*\*\*", r"\1", completion)
    completion = re.sub(
        r"(?i)(^|[:,])(\s*)\(([A-Za-z\d])\)(?=\s*(?:,|\.|\n|\Z))",
        r"\1\2\3",
        completion,
    )
    matches = re.findall(r"(?i)^ANSWER\s*:\s*([A-Za-z\d ,]+)\s*(?:$|\n|\.)", completion, flags=re.MULTILINE)
    if not matches:
        matches = re.findall(r"(?i)ANSWER\s*:\s*([A-Za-z\d ,]+)(?:[^\w]|\n|$|\.)", completion)
    if not matches:
        return set()
    matched = matches[-1].strip().rstrip(".").upper()
    allowed = {answer_character(i) for i in range(choices)}
    if multiple_correct:
        matched = matched.replace(" AND ", ",").replace(" ", "")
        split_comma = {x for x in matched.split(",") if x}
        if split_comma <= allowed:
            return split_comma
        if set(matched) <= allowed:
            return set(matched)
        return set()
    tokens = [token for token in matched.split(",") if token]
    if len(tokens) == 1 and tokens[0] in allowed:
        return {tokens[0]}
    return set()


def selected_positions(completion: str, choices: int, *, multiple_correct: bool) -> list[int]:
    """The option positions an answer selects, in order (what ``choice()`` compares with the target)."""
    letters = parse_answers(completion, choices, multiple_correct=multiple_correct)
    marked: set[int] = set()
    for letter in letters:
        try:
            marked.add(_answer_index(letter))
        except ValueError:
            continue
    return [i for i in range(choices) if i in marked]
