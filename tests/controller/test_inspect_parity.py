"""Plain Inspect samples run through Inspect AI itself and through ``rollcage run --format inspect``.

Inspect runs in its side environment (``tests/helpers/upstream.py``), on a model provider the side
script registers: it records the messages and tools Inspect hands the provider (what Inspect's
``generate()`` and ``multiple_choice()`` build) and asks rollcage's scripted policy server for the
answer over real HTTP on loopback. rollcage runs the same samples as users run it, against the same
server, which keeps every request body. Sample by sample, the prompt messages, the tools offered and
the scores must agree, for both API shapes rollcage speaks. A second test puts a corpus of tricky
answers through Inspect's own ``match()``, ``includes()`` and ``choice()`` and through rollcage's
graders of the same names.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller._graders import ChoiceGrader, IncludesGrader, MatchGrader, grade_builtin
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord
from tests.helpers.upstream import run_upstream

pytestmark = pytest.mark.timeout(600)

# Plain samples (no sandbox, files or setup), each with the answer the scripted policy gives.
SAMPLES: list[tuple[dict[str, Any], str]] = [
    ({"id": "capital", "input": "Capital of France?", "target": "Paris"}, "The capital is Paris."),
    ({"id": "capital-first", "input": "Capital of France?", "target": "Paris"}, "Paris is the capital."),
    ({"id": "punctuated", "input": "6*7?", "target": "42."}, "The answer is 42!"),
    (
        {
            "id": "chat",
            "input": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "Colour of the sky?"}]},
            ],
            "target": ["blue", "azure"],
        },
        "It is AZURE",
    ),
    (
        {"id": "mc", "input": "Which is blue?", "choices": ["grass", "sky", "blood"], "target": "B"},
        "ANSWER: B",
    ),
    (
        {"id": "mc-lower", "input": "Which is red?", "choices": ["grass", "sky", "blood"], "target": "C"},
        "Blood is red.\nANSWER: c",
    ),
    # A bare letter is no answer in Inspect's format: choice() scores it incorrect.
    ({"id": "mc-bare", "input": "Which is green?", "choices": ["grass", "sky"], "target": "A"}, "A"),
    (
        {
            "id": "mc-multi",
            "input": [
                {"role": "system", "content": "Be careful."},
                {"role": "user", "content": "Which are even?"},
            ],
            "choices": ["2", "3", "4"],
            "target": ["A", "C"],
        },
        "ANSWER: A, C",
    ),
]

# Inspect's side: one task per solver/scorer pair rollcage picks for a sample (see _inspect_scoring).
INSPECT_SIDE = r"""
import asyncio, json, sys, tempfile
import httpx
from inspect_ai import Task, eval
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.log._samples import sample_active
from inspect_ai.model import ModelAPI, ModelOutput, modelapi
from inspect_ai.scorer import choice, match
from inspect_ai.solver import generate, multiple_choice

given = json.loads(sys.stdin.read())
seen = {}

@modelapi(name="rollcagepolicy")
def _provider():
    class Policy(ModelAPI):
        async def generate(self, input, tools, tool_choice, config):
            sample_id = str(sample_active().sample.id)
            messages = [{"role": m.role, "content": m.text} for m in input]
            seen[sample_id] = {"messages": messages, "tools": [t.name for t in tools]}
            async with httpx.AsyncClient() as client:
                answer = await client.post(
                    given["base_url"] + "/chat/completions",
                    json={"model": self.model_name, "messages": messages},
                    headers={"X-Task-Id": sample_id},
                    timeout=60,
                )
            answer.raise_for_status()
            text = answer.json()["choices"][0]["message"]["content"]
            return ModelOutput.from_content(model=self.model_name, content=text)
    return Policy

def dataset(samples):
    return MemoryDataset([Sample(**s) for s in samples])

def kind(sample):
    if "choices" not in sample:
        return "plain"
    return "multi" if isinstance(sample["target"], list) and len(sample["target"]) > 1 else "single"

solvers = {
    "plain": (generate(), match()),
    "single": (multiple_choice(), choice()),
    "multi": (multiple_choice(multiple_correct=True), choice()),
}
tasks = []
for name, (solver, scorer) in solvers.items():
    samples = [s for s in given["samples"] if kind(s) == name]
    if samples:
        tasks.append(Task(name=name, dataset=dataset(samples), solver=solver, scorer=scorer))
out = {}
with tempfile.TemporaryDirectory() as logs:
    results = eval(tasks, model="rollcagepolicy/scripted-policy", log_dir=logs, display="none", max_retries=0)
    for log in results:  # read while the log files exist: samples may be read from them
        assert log.status == "success", (log.status, log.error)
        for sample in log.samples:
            (score,) = sample.scores.values()
            out[str(sample.id)] = {**seen[str(sample.id)], "score": score.value}
print(json.dumps(out))
"""

# Inspect's score values, as rollcage rewards (value_to_float: C 1, I 0, N 0).
SCORE = {"C": 1.0, "I": 0.0, "N": 0.0}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def _sent(body: dict[str, Any], api: str) -> tuple[list[dict[str, str]], list[str]]:
    """The messages (role, text) and tool names of one rollcage request body."""
    if api == "chat":
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in body["messages"]]
        tools = [t["function"]["name"] for t in body.get("tools", [])]
        return messages, tools
    messages = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
    for item in body["input"]:
        assert item.get("type", "message") == "message", item
        messages.append({"role": item["role"], "content": _text(item["content"])})
    return messages, [t["name"] for t in body.get("tools", [])]


def _rollcage_run(dataset: Path, out: Path, base_url: str, api: str) -> list[RolloutRecord]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollcage",
            "run",
            str(dataset),
            "--format",
            "inspect",
            "--model",
            base_url,
            "--model-name",
            "scripted-policy",
            "--api",
            api,
            "--quiet",
            "--out",
            str(out),
            "--sandbox",
            os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=out.parent,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Not reproduced" not in done.stdout, done.stdout  # plain samples: nothing left out
    lines = (out / "rollouts.jsonl").read_bytes().splitlines()
    return [RolloutRecord.model_validate_json(line) for line in lines]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
def test_plain_inspect_samples_get_inspects_prompts_tools_and_scores(tmp_path: Path) -> None:
    script = {"tasks": {sample["id"]: [{"text": answer}] for sample, answer in SAMPLES}}
    dataset = tmp_path / "samples.jsonl"
    dataset.write_text("".join(json.dumps(sample) + "\n" for sample, _ in SAMPLES))
    with PolicyServer(script, keep_bodies=True) as server:
        given = json.dumps({"base_url": server.base_url, "samples": [sample for sample, _ in SAMPLES]})
        inspect = run_upstream("inspect-ai", INSPECT_SIDE, stdin=given, timeout=300)
        runs = {
            api: _rollcage_run(dataset, tmp_path / f"out-{api}", server.base_url, api)
            for api in ("chat", "responses")
        }
        log = list(server.request_log)
    assert sorted(inspect) == sorted(sample["id"] for sample, _ in SAMPLES)
    for api, records in runs.items():
        rewards = {record.task_id: record.reward for record in records}
        for sample, _ in SAMPLES:
            sid = sample["id"]
            (request,) = [r for r in log if r.rollout_id and r.task_id == sid and r.api == api]
            assert request.body is not None
            messages, tools = _sent(request.body, api)
            theirs = inspect[sid]
            assert messages == theirs["messages"], (api, sid)
            assert tools == theirs["tools"] == [], (api, sid)
            assert rewards[sid] == SCORE[theirs["score"]], (api, sid, theirs["score"])
    # Both ways of scoring said something: the samples were not all right or all wrong.
    assert {inspect[s["id"]]["score"] for s, _ in SAMPLES} == {"C", "I"}


# Answers that exercise Inspect's normalisation: case, whitespace, punctuation at either end, unicode
# case folding, answers inside words, the ANSWER: line and its wrappers, several letters.
MATCH_CASES: list[tuple[str, str]] = [
    ("The answer is 42.", "42"),
    ("42 is the answer", "42"),
    ("  PARIS!!  ", "paris"),
    ("paris", "PARIS."),
    ("Straße", "STRASSE"),
    ("(yes)", "yes"),
    ("yes, indeed", "Yes"),
    ("...", "."),
    ("", "x"),
    ("the cat sat", "cat"),
    ("concatenate", "cat"),
    ("Answer:\tBlue\n", "blue"),
    ("blue-green", "green"),
    ("'quoted'", "quoted"),
    ("x", ""),
    ("ÉCOLE", "école"),
    ("a b", "a  b"),
]
CHOICE_CASES: list[tuple[str, int, bool, str | list[str]]] = [
    ("ANSWER: B", 3, False, "B"),
    ("answer: b.", 3, False, "B"),
    ("I think A.\nANSWER: C", 3, False, "C"),
    ("**ANSWER: A**", 2, False, "A"),
    ("ANSWER: **B**", 2, False, "B"),
    ("ANSWER: $B$", 2, False, "B"),
    ("ANSWER: (B)", 2, False, "B"),
    ("ANSWER: A,", 2, False, "A"),
    ("ANSWER: A, B", 2, False, "A"),
    ("ANSWER: D", 3, False, "C"),
    ("B", 2, False, "B"),
    ("", 2, False, "A"),
    ("ANSWER: A, C", 3, True, ["A", "C"]),
    ("ANSWER: AC", 3, True, "A, C"),
    ("ANSWER: A and C", 3, True, ["A", "C"]),
    ("ANSWER: A", 3, True, ["A", "C"]),
    ("My answer: C then ANSWER: B", 3, False, "B"),
]


def _random_cases(seed: int, count: int) -> tuple[list[tuple[str, str]], list[tuple[str, int, bool, str]]]:
    """More answers, drawn from the characters the rules treat specially (seeded: the same every run)."""
    rng = random.Random(seed)
    alphabet = "aAbBcC ß.!,()'\n\t42*$:-"

    def text(limit: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, limit)))

    matches = [(text(10), text(4)) for _ in range(count)]
    choices = []
    for _ in range(count):
        letters = rng.choice(["", " ", ", ", " and ", ","]).join(rng.sample("ABCabcD", rng.randint(1, 3)))
        wrap = rng.choice(["{}", "**{}**", "${}$", "({})", "{}.", "{},", " {} "])
        head = rng.choice(["", "I think B.\n", "x ", "**"])
        label = rng.choice(["ANSWER", "answer", "Answer", "ANS", ""]) + rng.choice([":", ": ", " :", ""])
        completion = head + label + wrap.format(letters) + rng.choice(["", "\n", ".", " ok", "!"])
        named = sorted({c for c in letters.upper() if c in "ABC"})
        drawn = rng.sample("ABC", rng.randint(1, 2))
        # Most targets are what the answer names, so both outcomes are drawn often.
        target = ", ".join(named if named and rng.random() < 0.7 else sorted(drawn))
        choices.append((completion, 3, rng.random() < 0.5, target))
    return matches, choices


RANDOM_MATCH, RANDOM_CHOICE = _random_cases(40, 150)

SCORERS_SIDE = r"""
import asyncio, json, sys
from inspect_ai.model import ModelOutput
from inspect_ai.scorer import Target, choice, includes, match
from inspect_ai.solver import TaskState
from inspect_ai.solver._multiple_choice import parse_answers, set_choices_based_on_generated_response

given = json.loads(sys.stdin.read())

def state(completion, choices=None):
    return TaskState(
        model="m", sample_id=1, epoch=1, input="q", messages=[], choices=choices,
        output=ModelOutput.from_content(model="m", content=completion),
    )

async def main():
    out = {"match": [], "includes": []}
    for answer, target in given["match"]:
        row = {}
        for location in ("begin", "end", "any", "exact"):
            for ignore_case in (True, False):
                score = await match(location, ignore_case=ignore_case)(state(answer), Target(target))
                row[f"{location}-{ignore_case}"] = score.value
        for ignore_case in (True, False):
            score = await includes(ignore_case=ignore_case)(state(answer), Target(target))
            row[f"includes-{ignore_case}"] = score.value
        out["match"].append(row)
    out["choice"] = []
    for answer, n, multiple, target in given["choice"]:
        s = state(answer, [f"option {i}" for i in range(n)])
        answers = parse_answers(s, multiple)
        if answers:
            set_choices_based_on_generated_response(s, answers)
        out["choice"].append((await choice()(s, Target(target))).value)
    print(json.dumps(out))

asyncio.run(main())
"""


def test_match_includes_and_choice_follow_inspects_own_rules() -> None:
    match_cases = [*MATCH_CASES, *RANDOM_MATCH]
    choice_cases: list[tuple[str, int, bool, str | list[str]]] = [*CHOICE_CASES, *RANDOM_CHOICE]
    given = json.dumps({"match": match_cases, "choice": choice_cases})
    inspect = run_upstream("inspect-ai", SCORERS_SIDE, stdin=given, timeout=300)
    for (answer, target), theirs in zip(match_cases, inspect["match"], strict=True):
        for location in ("begin", "end", "any", "exact"):
            for ignore_case in (True, False):
                spec = MatchGrader(location=location, ignore_case=ignore_case)
                ours = grade_builtin(spec, expected=target, answer=answer).reward
                assert ours == SCORE[theirs[f"{location}-{ignore_case}"]], (
                    answer,
                    target,
                    location,
                    ignore_case,
                )
        for ignore_case in (True, False):
            ours = grade_builtin(
                IncludesGrader(ignore_case=ignore_case), expected=target, answer=answer
            ).reward
            assert ours == SCORE[theirs[f"includes-{ignore_case}"]], (answer, target, ignore_case)
    for (answer, n, multiple, target), theirs in zip(choice_cases, inspect["choice"], strict=True):
        spec = ChoiceGrader(choices=n, multiple_correct=multiple)
        ours = grade_builtin(spec, expected=target, answer=answer).reward
        assert ours == SCORE[theirs], (answer, n, multiple, target, theirs)
