"""JUnit XML read safely, and pytest ids matched to what pytest's own --junitxml writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.controller._junit import JUNIT_LIMIT, JunitError, junit_key, parse_junit

SUITE = """
import pytest

def test_plain():
    pass

def test_fails():
    assert False

class TestGroup:
    def test_method(self):
        pass

    class TestNested:
        def test_deep(self):
            pass

@pytest.mark.parametrize("value", ["a::b", "x[y]", "with space"])
def test_param(value):
    pass

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_error(broken):
    pass
"""


def test_every_id_pytest_collects_is_found_in_the_junit_it_writes(tmp_path: Path) -> None:
    (tmp_path / "tests/unit").mkdir(parents=True)
    (tmp_path / "tests/unit/test_suite.py").write_text(SUITE)
    (tmp_path / "test_top.py").write_text("def test_top():\n    pass\n")
    common = ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", "-q"]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *common, "--collect-only"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert len(ids) == 11, collected.stdout
    subprocess.run(
        [sys.executable, "-m", "pytest", *common, "--junitxml", str(tmp_path / "junit.xml")],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    report = parse_junit((tmp_path / "junit.xml").read_bytes())
    statuses = {test_id: report.status(test_id) for test_id in ids}
    assert None not in statuses.values(), statuses
    assert statuses["tests/unit/test_suite.py::test_fails"] == "failed"
    assert statuses["tests/unit/test_suite.py::test_error"] == "failed"
    assert statuses["tests/unit/test_suite.py::test_skipped"] == "skipped"
    # An expected failure passes a listed test, as SWE-bench's grading counts XFAIL.
    assert statuses["tests/unit/test_suite.py::test_known_bug"] == "xfailed"
    assert statuses["tests/unit/test_suite.py::TestGroup::TestNested::test_deep"] == "passed"
    assert statuses["tests/unit/test_suite.py::test_param[a::b]"] == "passed"
    assert statuses["test_top.py::test_top"] == "passed"
    assert report.status("tests/unit/test_suite.py::test_never_written") is None


def test_the_junit_key_is_pytest_s_mangling() -> None:
    assert junit_key("tests/test_x.py::test_a") == ("tests.test_x", "test_a")
    assert junit_key("tests/test_x.py::C::test_m[1-a::b]") == ("tests.test_x.C", "test_m[1-a::b]")


@pytest.mark.parametrize(
    "data",
    [
        b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "b">]><testsuite>&a;</testsuite>',
        b'<!DOCTYPE x SYSTEM "file:///etc/passwd"><testsuite/>',
        b"<testsuite>&undefined;</testsuite>",
        b"<testsuite><testcase></testsuite>",
        b"<a>" * 100 + b"</a>" * 100,
    ],
    ids=["internal-entity", "external-dtd", "undefined-entity", "malformed", "deep"],
)
def test_xml_junit_never_needs_is_refused(data: bytes) -> None:
    with pytest.raises(JunitError):
        parse_junit(data)


def test_a_file_over_the_limit_is_refused_before_parsing() -> None:
    with pytest.raises(JunitError, match="byte limit"):
        parse_junit(b" " * (JUNIT_LIMIT + 1))


def test_a_case_reported_twice_keeps_its_worst_status() -> None:
    report = parse_junit(
        b'<testsuite><testcase classname="t" name="a"/>'
        b'<testcase classname="t" name="a"><error message="teardown"/></testcase>'
        b'<testcase classname="t" name="b"><system-out>failure</system-out></testcase></testsuite>'
    )
    assert report.status("t.py::a") == "failed" and report.status("t.py::b") == "passed"


def test_a_listed_expected_failure_passes_the_grade_and_a_skip_does_not() -> None:
    from rollcage.controller._graders import TestsGrader
    from rollcage.controller._image_grade import _junit_grade

    junit = b"""<testsuites><testsuite name="pytest">
      <testcase classname="tests.test_x" name="test_fixed"/>
      <testcase classname="tests.test_x" name="test_known_bug">
        <skipped type="pytest.xfail" message="bug"/></testcase>
      <testcase classname="tests.test_x" name="test_later">
        <skipped type="pytest.skip" message="no"/></testcase>
    </testsuite></testsuites>"""
    spec = TestsGrader(
        type="tests",
        command="true",
        junit_xml="/tmp/junit.xml",
        fail_to_pass=["tests/test_x.py::test_fixed"],
        pass_to_pass=["tests/test_x.py::test_known_bug"],
    )
    assert _junit_grade(spec, 1, junit, {}).reward == 1.0
    skipped = spec.model_copy(update={"pass_to_pass": ["tests/test_x.py::test_later"]})
    graded = _junit_grade(skipped, 1, junit, {})
    assert graded.reward == 0.0 and graded.detail["failed"] == ["tests/test_x.py::test_later"]
