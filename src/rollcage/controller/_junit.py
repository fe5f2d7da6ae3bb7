"""JUnit XML, as a test command inside the agent's image wrote it: read safely, matched to pytest ids.

The file was written by code the agent could change, so nothing in it is trusted: it is read
bounded (:data:`JUNIT_LIMIT` bytes), parsed by expat with a document type refused outright (JUnit
needs none; no entity, internal or external, is ever expanded, so an entity bomb or an external
entity is an error, not work), and its element count and depth are bounded.

Ids are pytest's node ids (``tests/test_x.py::test_a``, ``tests/test_x.py::TestC::test_m``,
``tests/test_x.py::test_p[a::b]``). pytest's ``--junitxml`` writes each test as
``classname="tests.test_x.TestC" name="test_m"`` (``_pytest.junitxml.mangle_test_address``: the
file path with ``/`` as ``.`` and no ``.py``, the classes, then the name with its parameters),
which cannot be turned back into a path unambiguously; so each expected id is mangled the same
way and looked up (:func:`junit_key`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final, Literal
from xml.parsers import expat

__all__ = ["JUNIT_LIMIT", "PASSING", "JunitError", "JunitReport", "TestStatus", "junit_key", "parse_junit"]

JUNIT_LIMIT: Final = 32 * 1024 * 1024
"""The largest JUnit file read (bytes)."""
_MAX_ELEMENTS: Final = 2_000_000
_MAX_DEPTH: Final = 64

TestStatus = Literal["passed", "xfailed", "failed", "skipped"]

PASSING: Final[frozenset[TestStatus]] = frozenset({"passed", "xfailed"})
"""What counts as passing a listed test: pytest's expected failures too, as SWE-bench's grading counts
them (``XFAIL`` among its passing statuses)."""


class JunitError(ValueError):
    """The JUnit XML cannot be used: too large, malformed, or carrying a document type."""


@dataclass
class JunitReport:
    """Every test case of a JUnit file, keyed by ``(classname, name)``."""

    cases: dict[tuple[str, str], TestStatus] = field(default_factory=dict)

    def status(self, test_id: str) -> TestStatus | None:
        """The status of the pytest id ``test_id``; ``None`` when the file does not hold it."""
        return self.cases.get(junit_key(test_id))


def junit_key(test_id: str) -> tuple[str, str]:
    """``(classname, name)`` pytest's ``--junitxml`` writes for the node id ``test_id``."""
    path, bracket, params = test_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names = [name for name in names if name != "()"]
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


_RANK: Final[dict[TestStatus, int]] = {"passed": 0, "xfailed": 1, "skipped": 2, "failed": 3}


def parse_junit(data: bytes) -> JunitReport:
    """Parse JUnit XML (a ``<testsuites>`` or ``<testsuite>`` root) into a :class:`JunitReport`.

    A test case holding ``<failure>`` or ``<error>`` failed; one holding ``<skipped>`` was
    skipped, unless pytest marked it an expected failure (``type="pytest.xfail"``: ``xfailed``);
    any other passed. A case reported more than once keeps its worst status.

    Raises:
        JunitError: Over :data:`JUNIT_LIMIT` bytes, not well-formed, a ``<!DOCTYPE``, an
            entity, or over the element or depth bounds.
    """
    if len(data) > JUNIT_LIMIT:
        raise JunitError(f"the JUnit XML is {len(data)} bytes, over the {JUNIT_LIMIT} byte limit")
    report = JunitReport()
    parser = expat.ParserCreate()
    state = _State()

    def refuse_doctype(*_: object) -> None:
        raise JunitError("the JUnit XML declares a document type (<!DOCTYPE>), which JUnit never needs")

    def refuse_entity(*_: object) -> None:
        raise JunitError("the JUnit XML declares or uses an entity, which JUnit never needs")

    def start(tag: str, attrs: dict[str, str]) -> None:
        state.elements += 1
        state.depth += 1
        if state.elements > _MAX_ELEMENTS or state.depth > _MAX_DEPTH:
            raise JunitError("the JUnit XML has too many elements or is nested too deep")
        if tag == "testcase":
            state.case = (attrs.get("classname", ""), attrs.get("name", ""))
            state.case_depth = state.depth
            state.status = "passed"
        elif state.case is not None and state.depth == state.case_depth + 1:
            if tag in ("failure", "error"):
                state.status = "failed"
            elif tag == "skipped" and state.status == "passed":
                state.status = "xfailed" if attrs.get("type") == "pytest.xfail" else "skipped"

    def end(tag: str) -> None:
        if tag == "testcase" and state.case is not None and state.depth == state.case_depth:
            earlier = report.cases.get(state.case)
            if earlier is None or _RANK[state.status] > _RANK[earlier]:
                report.cases[state.case] = state.status
            state.case = None
        state.depth -= 1

    parser.StartDoctypeDeclHandler = refuse_doctype
    parser.EntityDeclHandler = refuse_entity
    parser.SkippedEntityHandler = refuse_entity
    parser.ExternalEntityRefHandler = lambda *_: refuse_entity()  # type: ignore[assignment]
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    try:
        parser.Parse(data, True)
    except expat.ExpatError as exc:
        raise JunitError(f"the JUnit XML is not well-formed: {exc}") from exc
    return report


@dataclass
class _State:
    elements: int = 0
    depth: int = 0
    case: tuple[str, str] | None = None
    case_depth: int = 0
    status: TestStatus = "passed"
