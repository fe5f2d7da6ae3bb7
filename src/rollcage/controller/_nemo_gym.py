"""NeMo Gym's resource-server protocol, spoken by the controller (outside the sandbox).

For every rollout whose row names an environment, in this order:

1. ``POST /seed_session`` with the task's run request (``responses_create_params``
   plus the row's verifier fields, exactly NeMo Gym's ``BaseRunRequest`` body). The
   cookies it sets become the rollout's initial ``resource_cookies``, so the agent's
   tool calls (made by the worker, through the egress proxy, with a ``Cookie``
   header) belong to that session. A 404/405 means the server offers no
   ``/seed_session``: the rollout starts without a session.
2. The worker calls the tools (``POST /<tool>``), keeping every ``Set-Cookie``.
3. ``POST /verify`` with the run request, the rollout as a complete NeMo Gym
   response object (``to_nemo_response``) and the session's cookies as a ``Cookie``
   header; the answer's ``reward``, ``mask_sample`` and ``failure_kind`` are read
   by ``rollcage.controller._graders.parse_verify_answer``.
4. ``POST /close_session`` with the cookies and NeMo Gym's close body
   (``ResourcesCloseSessionRequest``: ``resources_session_id`` and ``episode_id``,
   nothing else; see ``close_request``), when offered (404/405: not offered), so the
   server can free the session's state.

A ``/seed_session`` that fails otherwise (unreachable, 5xx, no answer in time) is
an infrastructure failure of the attempt: it is retried, never graded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollcage.controller._graders import read_bounded
from rollcage.errors import HeaderValueError, ResourceUnavailableError
from rollcage.headers import cookie_header, header_value, update_cookies
from rollcage.protocol import ToolSpec, WorkerResult
from rollcage.trajectory import project_calls
from rollcage.wire import function_tools as agent_function_tools

if TYPE_CHECKING:
    import httpx

__all__ = [
    "CREATE_PARAMS_KEYS",
    "close_request",
    "close_session",
    "create_params_for",
    "function_tools",
    "nemo_item",
    "nemo_items",
    "request_headers",
    "run_request",
    "seed_session",
    "synthetic_positions",
    "to_nemo_response",
]

logger = logging.getLogger("rollcage.controller")

CREATE_PARAMS_KEYS = frozenset(
    {
        "background",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "reasoning",
        "service_tier",
        "store",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
        "stream",
    }
)
"""The fields NeMo Gym's ``NeMoGymResponseCreateParamsNonStreaming`` accepts (it forbids others)."""

CREATE_PARAMS_SAMPLING = (
    "temperature",
    "top_p",
    "max_output_tokens",
    "top_logprobs",
    "parallel_tool_calls",
    "tool_choice",
    "reasoning",
    "text",
)
"""The request fields of a NeMo Gym row that are sampling settings: read from a row, written back to one."""
_NOT_OFFERED = frozenset({404, 405})
_AGENT_CODE_CALLS = ("cell-", "bridge-")
"""Call ids of a codeact cell and of a tool its code called (``ToolCall.call_id``)."""
_ANSWER_LIMIT = 1024 * 1024
_ITEM_STATUSES = frozenset({"in_progress", "completed", "incomplete"})


def function_tools(tools: list[ToolSpec], *, codeact: bool) -> list[dict[str, Any]]:
    """The agent's function tools (``rollcage.wire.function_tools``), each saying ``strict`` as NeMo Gym's
    ``ToolParam`` requires (the tool's own, else false; none in codeact mode, which has no tools)."""
    return [{"strict": False, **tool} for tool in agent_function_tools(tools, codeact=codeact)]


def create_params_for(
    *,
    input: str | list[dict[str, Any]],
    instructions: str | None,
    tools: list[dict[str, Any]],
    model: str,
    sampling: Mapping[str, Any],
) -> dict[str, Any]:
    """``responses_create_params`` for a row that did not come with its own (rollcage, Inspect rows)."""
    params: dict[str, Any] = {
        "input": input,
        "model": model,
        "tools": tools,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
    }
    if instructions is not None:
        params["instructions"] = instructions
    # What the model was asked, as the Responses API says it (SamplingParams dumps it in those terms).
    for key in CREATE_PARAMS_SAMPLING:
        value = _without_none(sampling.get(key))
        if value is not None:
            params[key] = value
    return params


def _without_none(value: Any) -> Any:
    """A dumped sampling field with its unset (``None``) fields left out, at any depth but inside a JSON
    Schema (``text.format.schema``), which is the author's own document, kept as written."""
    if isinstance(value, Mapping):
        return {k: v if k == "schema" else _without_none(v) for k, v in value.items() if v is not None}
    return value


def run_request(create_params: Mapping[str, Any], verifier: Mapping[str, Any]) -> dict[str, Any]:
    """NeMo Gym's run request body: the row's verifier fields and its ``responses_create_params``."""
    return {**verifier, "responses_create_params": dict(create_params)}


_EPISODE_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ATTEMPT_SUFFIX = re.compile(r"-a[1-9][0-9]*$")


def episode_rollout_id(task_id: str, sample: int) -> str:
    """The logical rollout (one sample of one task) as NeMo Gym's ``EpisodeId.rollout_id`` spells it.

    NeMo Gym allows letters, digits, ``.``, ``_`` and ``-``, a letter or digit first,
    and reserves a ``-a<N>`` ending for attempts; a task id outside that is sanitised
    and followed by a hash of the original, so two tasks never share an episode.
    """
    stem = _EPISODE_UNSAFE.sub("_", task_id)
    if stem != task_id or not stem[:1].isalnum() or len(stem) > 80:
        digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        stem = f"t{stem[:80]}.{digest}"
    episode = f"{stem}-s{sample}"
    assert not _ATTEMPT_SUFFIX.search(episode)  # "-s<N>" can never read as "-a<N>"
    return episode


def close_request(*, rollout_id: str, task_id: str, sample: int, attempt: int) -> dict[str, Any]:
    """NeMo Gym 0.7.0's ``/close_session`` body (``ResourcesCloseSessionRequest``: no other field).

    ``resources_session_id`` is the attempt's rollout id (the session itself travels
    in the cookies ``/seed_session`` set); ``episode_id`` names the logical rollout
    (the task's sample) and which attempt of it this was (the infrastructure retry).
    """
    return {
        "resources_session_id": rollout_id,
        "episode_id": {"rollout_id": episode_rollout_id(task_id, sample), "attempt": attempt},
    }


def _text_part(part: Any) -> dict[str, Any] | None:
    if isinstance(part, str):
        return {"type": "output_text", "text": part, "annotations": [], "logprobs": None}
    if not isinstance(part, Mapping):
        return None
    if part.get("type") == "refusal":
        return {"type": "refusal", "refusal": str(part.get("refusal", ""))}
    annotations = part.get("annotations")
    logprobs = part.get("logprobs")
    return {
        "type": "output_text",
        "text": str(part.get("text", "")),
        "annotations": annotations if isinstance(annotations, list) else [],
        "logprobs": logprobs if isinstance(logprobs, list) else None,
    }


def _status(item: Mapping[str, Any], default: str) -> str:
    status = item.get("status")
    return status if isinstance(status, str) and status in _ITEM_STATUSES else default


def _item_id(item: Mapping[str, Any], prefix: str, index: int) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{index}"


def nemo_items(result: WorkerResult) -> list[dict[str, Any] | None]:
    """The rollout's output items in NeMo Gym's shape, by position (``None``: an item left out).

    The one conversion every NeMo Gym body and export uses (``/verify``'s response,
    the export's ``response``, ``ng_trajectory``'s conversation and turns), so an
    item has the same id and status wherever NeMo Gym meets it. Left out: items NeMo
    Gym cannot hold, and the calls the model never made (``synthetic_positions``).
    """
    items = result.response.output if result.response is not None else []
    synthetic = synthetic_positions(result)
    return [None if index in synthetic else nemo_item(item, index) for index, item in enumerate(items)]


def synthetic_positions(result: WorkerResult) -> frozenset[int]:
    """Positions in the output of calls no model output made, and of their outputs.

    rollcage's projection shows every action as a function call (``project_output``):
    a codeact turn's code cells (``cell-*``) and the tools agent code called
    (``bridge-*``) appear as calls named after the tool. The model wrote code in a
    message and saw the cells' output as a message (its turn's input); it never made
    those calls, so NeMo Gym's bodies do not claim it did. A harness's own first call
    (NOOA's), which the model is shown as a call, stays.
    """
    items = result.response.output if result.response is not None else []
    calls = project_calls(result.trajectory, partial=False)
    if sum(len(call.items) for call in calls) != len(items):
        return frozenset()  # not the worker's projection of this trajectory: nothing can be told apart
    synthetic: set[int] = set()
    position = 0
    for call, projected, lead, own in calls:
        declared = {str(i.get("call_id")) for i in call.output if i.get("type") == "function_call"}
        for offset in range(lead + own, len(projected)):
            call_id = str(projected[offset].get("call_id"))
            # Only rollcage's own cells and bridges: a harness's call is never dropped on an id mismatch.
            if call_id not in declared and call_id.startswith(_AGENT_CODE_CALLS):
                synthetic.add(position + offset)
        position += len(projected)
    return frozenset(synthetic)


def nemo_item(item: Mapping[str, Any], index: int) -> dict[str, Any] | None:
    """One output item in the shape NeMo Gym's models require; ``None`` for items they cannot hold."""
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role", "assistant") != "assistant":
            return None
        content = item.get("content")
        parts = content if isinstance(content, list) else [content if isinstance(content, str) else ""]
        return {
            "id": _item_id(item, "msg", index),
            "type": "message",
            "role": "assistant",
            "status": _status(item, "completed"),
            "content": [p for p in (_text_part(x) for x in parts) if p is not None],
        }
    if kind == "function_call":
        arguments = item.get("arguments", "")
        return {
            "id": _item_id(item, "fc", index),
            "type": "function_call",
            "call_id": str(item.get("call_id", "")),
            "name": str(item.get("name", "")),
            "arguments": arguments if isinstance(arguments, str) else str(arguments),
            "status": _status(item, "completed"),
        }
    if kind == "function_call_output":
        output = item.get("output", "")
        return {
            "id": _item_id(item, "fco", index),
            "type": "function_call_output",
            "call_id": str(item.get("call_id", "")),
            "output": output if isinstance(output, str) else str(output),
            "status": _status(item, "completed"),
        }
    if kind == "reasoning":
        summary = item.get("summary")
        texts = (
            [s.get("text") for s in summary if isinstance(s, Mapping)] if isinstance(summary, list) else []
        )
        out: dict[str, Any] = {
            "id": _item_id(item, "rs", index),
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": str(t)} for t in texts if t is not None],
        }
        if isinstance(item.get("encrypted_content"), str):
            out["encrypted_content"] = item["encrypted_content"]
        return out
    return None


def _usage(result: WorkerResult) -> dict[str, Any] | None:
    usage = result.response.usage if result.response is not None else None
    if usage is None or usage.input_tokens is None or usage.output_tokens is None:
        return None  # NeMo Gym's usage needs both counts; unreported is not 0
    total = usage.total_tokens if usage.total_tokens is not None else usage.input_tokens + usage.output_tokens
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": total,
    }


def to_nemo_response(
    result: WorkerResult, create_params: Mapping[str, Any], *, with_tokens: bool = False
) -> dict[str, Any]:
    """The rollout as a complete NeMo Gym response object (``NeMoGymResponse``, a Responses ``Response``).

    Every field NeMo Gym's model requires is present: ``created_at`` as an integer,
    ``parallel_tool_calls``, ``tool_choice`` and ``tools`` (from the request),
    an ``id`` and ``status`` on every item, ``annotations`` on every text part, and
    usage with its detail blocks (``None`` when the server did not report counts).
    Items NeMo Gym cannot hold (none the worker produces today) are left out.

    With ``with_tokens``, each model call whose token data is complete puts it where
    NeMo Gym's training items carry it: ``prompt_token_ids``, ``generation_token_ids``
    and ``generation_log_probs`` on the last item of the call's own output.
    """
    response = result.response
    converted_items = nemo_items(result)
    marks = _token_marks(result, len(converted_items)) if with_tokens else {}
    output: list[dict[str, Any]] = []
    for index, converted in enumerate(converted_items):
        if converted is not None:
            output.append({**converted, **marks.get(index, {})})
    status = response.status if response is not None else "failed"
    error = None
    if result.error is not None:
        error = {"code": "server_error", "message": f"{result.error.type}: {result.error.message}"[:2000]}
    return {
        "id": response.id if response is not None else result.rollout_id,
        "object": "response",
        "created_at": int(result.started_at),
        "model": response.model if response is not None else str(create_params.get("model") or ""),
        "status": status,
        "output": output,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"}
        if status == "incomplete" and error is None
        else None,
        "instructions": create_params.get("instructions"),
        "metadata": create_params.get("metadata"),
        "parallel_tool_calls": bool(create_params.get("parallel_tool_calls", True)),
        "temperature": create_params.get("temperature"),
        "tool_choice": create_params.get("tool_choice", "auto"),
        "tools": list(create_params.get("tools") or []),
        "top_p": create_params.get("top_p"),
        "max_output_tokens": create_params.get("max_output_tokens"),
        "usage": _usage(result),
    }


def _token_marks(result: WorkerResult, projected: int) -> dict[int, dict[str, Any]]:
    """Position in the output of each call's last own item -> the call's NeMo Gym token arrays."""
    calls = project_calls(result.trajectory, partial=False)
    if sum(len(call.items) for call in calls) != projected:
        return {}  # not the worker's projection of this trajectory: no position can be trusted
    marks: dict[int, dict[str, Any]] = {}
    position = 0
    for call, items, lead, own in calls:
        tokens = call.tokens
        if own and tokens.status == "observed" and tokens.scope == "generation":
            marks[position + lead + own - 1] = {
                "prompt_token_ids": tokens.prompt_token_ids,
                "generation_token_ids": tokens.generation_token_ids,
                "generation_log_probs": tokens.generation_log_probs,
            }
        position += len(items)
    return marks


def _cookies_set(response: httpx.Response) -> dict[str, str]:
    """The cookies an answer set; one that could never be sent back fails the whole answer.

    Raises:
        HeaderValueError: A cookie cannot be kept (see ``rollcage.headers.cookie_problem``).
    """
    jar: dict[str, str] = {}
    update_cookies(jar, response.headers.raw, strict=True)
    return jar


def request_headers(*, token: str | None, cookies: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers of a request to an environment (seed, verify, close): JSON, its token, the cookies.

    Raises:
        HeaderValueError: The token or a cookie cannot be sent (the message names it).
    """
    headers = [(b"content-type", b"application/json")]
    if token:
        headers.append((b"authorization", header_value(f"Bearer {token}", what="the environment's token")))
    if cookies:
        headers.append((b"cookie", cookie_header(cookies)))
    return headers


async def _post(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    *,
    body: bytes,
    token: str | None,
    cookies: Mapping[str, str],
    timeout_s: float,
) -> tuple[int, bytes | None, dict[str, str]]:
    headers = request_headers(token=token, cookies=cookies)
    async with asyncio.timeout(timeout_s):
        request = client.build_request(
            "POST", url.rstrip("/") + path, content=body, headers=headers, timeout=timeout_s
        )
        response = await client.send(request, stream=True)
        try:
            data = await read_bounded(response, _ANSWER_LIMIT)
        finally:
            await response.aclose()
    return response.status_code, data, _cookies_set(response) if path == "/seed_session" else {}


async def seed_session(
    client: httpx.AsyncClient, url: str, *, token: str | None, body: bytes, timeout_s: float
) -> dict[str, str]:
    """``POST /seed_session``; return the session cookies it set (``{}`` when it is not offered).

    Raises:
        ResourceUnavailableError: The environment could not be reached, gave no answer
            in time, answered anything but 2xx/404/405, or set a cookie that could never be
            sent back (retried as infra_failure: the environment's fault, never the policy's).

    **Cancellation:** the request is abandoned and its connection closed.
    """
    import httpx

    started = time.monotonic()
    try:
        status, data, cookies = await _post(
            client, url, "/seed_session", body=body, token=token, cookies={}, timeout_s=timeout_s
        )
    except TimeoutError as exc:
        raise ResourceUnavailableError(
            f"environment {url} gave no answer to /seed_session within {timeout_s:g} s"
        ) from exc
    except httpx.HTTPError as exc:
        raise ResourceUnavailableError(
            f"environment {url} could not be reached for /seed_session: {type(exc).__name__}: {exc}"
        ) from exc
    except HeaderValueError as exc:
        raise ResourceUnavailableError(f"environment {url} answered /seed_session unusably: {exc}") from exc
    if status in _NOT_OFFERED:
        return {}
    if not 200 <= status < 300:
        text = (data or b"")[:300].decode("utf-8", "replace")
        raise ResourceUnavailableError(f"environment {url} answered /seed_session with HTTP {status}: {text}")
    logger.debug("seeded a session on %s in %.3f s", url, time.monotonic() - started)
    return cookies


async def close_session(
    client: httpx.AsyncClient,
    url: str,
    *,
    token: str | None,
    body: bytes,
    cookies: Mapping[str, str],
    timeout_s: float,
) -> str | None:
    """``POST /close_session`` with the session's cookies; return why it failed, or ``None``.

    Not being offered (404/405) is not a failure. A failure is reported, never
    raised: the rollout's grade stands whatever happens here.

    **Cancellation:** the request is abandoned and its connection closed.
    """
    import httpx

    try:
        status, data, _ = await _post(
            client, url, "/close_session", body=body, token=token, cookies=cookies, timeout_s=timeout_s
        )
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    except HeaderValueError as exc:
        return str(exc)
    if status in _NOT_OFFERED or 200 <= status < 300:
        return None
    return f"HTTP {status}: {(data or b'')[:200].decode('utf-8', 'replace')}"
