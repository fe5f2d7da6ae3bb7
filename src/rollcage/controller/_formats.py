"""Other harnesses' dataset rows, read as they are: NeMo Gym rollout rows and Inspect samples.

Each reader maps one row to rollcage's row (``rollcage.controller._dataset.DatasetRow``
fields) and keeps apart what the sandbox must never see:

* **NeMo Gym** (``{"responses_create_params": {...}, <verifier fields>...}``):
  ``input``, ``instructions`` and the function ``tools`` of ``responses_create_params``
  become the model-visible input and the environment's resource tools (each with its
  ``strict``); every field that shapes the model's answer (``temperature``, ``top_p``,
  ``max_output_tokens``, ``top_logprobs``, ``parallel_tool_calls``, ``tool_choice``,
  ``reasoning``, ``text``, and the ``extra_body`` and ``chat_template_kwargs`` that
  NeMo Gym's model servers read from ``metadata``) becomes the row's sampling, sent
  on either API in its own terms. A field rollcage cannot send as the row's author
  meant (``background``, ``include``, ``previous_response_id``, ``prompt``,
  ``service_tier``, ``truncation: auto``, ``user``, another ``metadata`` key) refuses
  the row, naming it. Every other top-level field is a
  verifier field (``expected_count``, ``ground_truth``...): controller-only, sent to
  the environment's ``/seed_session`` and ``/verify`` with the original
  ``responses_create_params``, never to ``input.json``. The task id is the first of
  ``id``, ``task_id``, ``instance_id``, ``problem_id``, ``_ng_task_index``, else
  ``line-<n>``. The environment is the run's ``--environment`` (NeMo Gym rows name
  their resource server in the NeMo Gym config, not in the row).
* **Inspect** (``{"input", "target", "id", "metadata", "choices"}``): run as Inspect runs a
  plain sample (``rollcage.controller._inspect_scoring``): ``input`` (text or chat messages)
  as it is, with no tools and no system prompt (``generate()``), scored by ``match()``; with
  ``choices``, the last user message becomes ``multiple_choice()``'s prompt and ``choice()``
  scores it. ``target`` is the controller-only ``expected`` (graded by the environment's
  ``/verify`` instead when there is one, and then the environment's tools are offered). A
  ``sandbox`` naming docker with an image (``{"type": "docker", "config": {"image": ...}}``, or a
  compose file whose single service has an ``image:``) becomes the row's task image (``docker://``
  that image) and the row gets rollcage's agent and its python tool there (a notice says so: Inspect's
  solver and sandbox tools are not reproduced); ``local`` is no image; any other sandbox (a build,
  several services, another provider) is refused, naming what it holds. ``files`` and ``setup`` are
  refused: they are not reproduced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from rollcage.controller._inspect_scoring import choice_positions, choice_prompt
from rollcage.controller._nemo_gym import CREATE_PARAMS_KEYS, CREATE_PARAMS_SAMPLING
from rollcage.errors import ConfigError
from rollcage.protocol import SamplingParams

__all__ = ["FORMATS", "DatasetFormat", "detect_format_of", "from_inspect", "from_nemo_gym", "inspect_notices"]

DatasetFormat = Literal["rollcage", "nemo-gym", "inspect"]
"""How a dataset's rows are written."""

FORMATS: tuple[DatasetFormat, ...] = ("rollcage", "nemo-gym", "inspect")

_INSPECT_KEYS = frozenset({"input", "target", "id", "metadata", "choices", "sandbox", "files", "setup"})
_NEMO_ID_KEYS = ("id", "task_id", "instance_id", "problem_id", "_ng_task_index")
_NUMBER_KEYS = frozenset({"temperature", "top_p", "max_output_tokens", "top_logprobs"})
# Request fields with no meaning rollcage can give them: a row that sets one is refused, named.
_UNSENDABLE: dict[str, str] = {
    "background": "rollcage waits for each answer; it does not run requests in the background",
    "include": "rollcage asks for what it keeps itself (logprobs: the row's top_logprobs)",
    "previous_response_id": "rollcage sends the whole conversation; it continues no stored response",
    "prompt": "rollcage sends the row's own input; it uses no stored prompt template",
    "service_tier": "rollcage does not choose a provider's service tier",
    "user": "rollcage does not send an end-user id",
}
# The metadata keys NeMo Gym's model servers read (vllm_model), as JSON text; any other is refused.
_METADATA_REQUEST_KEYS = ("extra_body", "chat_template_kwargs")


def detect_format_of(value: Any) -> DatasetFormat | None:
    """The format one parsed row is written in; ``None`` when it says nothing (not an object)."""
    if not isinstance(value, dict):
        return None
    if "responses_create_params" in value:
        return "nemo-gym"
    if "target" in value and "input" in value and set(value) <= _INSPECT_KEYS:
        return "inspect"
    return "rollcage"


def _task_id(value: dict[str, Any], line: int) -> str:
    for key in _NEMO_ID_KEYS:
        raw = value.get(key)
        if (isinstance(raw, str) and raw) or (isinstance(raw, int) and not isinstance(raw, bool)):
            return str(raw)
    return f"line-{line}"


def _input_items(items: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"{where}[{index}] must be an object, got {type(item).__name__}")
        # NeMo Gym's EasyInputMessage may leave out "type": it is a message.
        out.append(item if "type" in item else {"type": "message", **item})
    return out


def from_nemo_gym(
    value: dict[str, Any], line: int, environment: str | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Map a NeMo Gym row to ``(rollcage row, verifier fields, responses_create_params)``.

    Raises:
        ConfigError: The row is not a usable NeMo Gym row (the message names the field).
    """
    params = value.get("responses_create_params")
    if not isinstance(params, dict):
        raise ConfigError("responses_create_params must be an object")
    unknown = sorted(set(params) - CREATE_PARAMS_KEYS)
    if unknown:
        raise ConfigError(f"responses_create_params.{unknown[0]}: not a field NeMo Gym accepts")
    if params.get("stream"):
        raise ConfigError("responses_create_params.stream: NeMo Gym rows are non-streaming (false or null)")
    for key, why in _UNSENDABLE.items():
        if params.get(key) not in (None, False, []):
            raise ConfigError(f"responses_create_params.{key}: {why}; remove it to run the row")
    if params.get("truncation") not in (None, "disabled"):
        raise ConfigError(
            "responses_create_params.truncation: rollcage never cuts the conversation to fit; "
            "remove it (or say 'disabled') to run the row"
        )
    model_input = _nemo_input(params.get("input"))
    instructions = params.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ConfigError("responses_create_params.instructions must be a string or null")
    if environment is None:
        raise ConfigError(
            "a NeMo Gym row names no environment: pass --environment URL (the resource server's base URL)"
        )
    tools = _nemo_tools(params.get("tools") or [])
    sampling = _nemo_sampling(params)
    row: dict[str, Any] = {
        "id": _task_id(value, line),
        "input": model_input,
        "instructions": instructions,
        "environment": environment,
        "tools": tools,
        "grader": {"type": "verify"},
    }
    if sampling:
        row["model"] = {"sampling": sampling}
    max_tool_calls = params.get("max_tool_calls")
    if max_tool_calls is not None:
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 0:
            raise ConfigError(
                f"responses_create_params.max_tool_calls: must be a whole number of 0 or more, got "
                f"{max_tool_calls!r}"[:200]
            )
        row["agent"] = {"max_tool_calls": max_tool_calls}
    verifier = {k: v for k, v in value.items() if k != "responses_create_params"}
    return row, verifier, params


def _nemo_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """The row's sampling fields, checked as rollcage's ``SamplingParams`` checks them, named as written."""
    sampling = {k: params[k] for k in CREATE_PARAMS_SAMPLING if params.get(k) is not None}
    for key, value in sampling.items():
        # JSON's true is no temperature: pydantic would read it as 1.
        if key in _NUMBER_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"responses_create_params.{key}: must be a number, got {value!r}"[:200])
    extra_body = _metadata_extra_body(params.get("metadata"))
    for key in sorted(set(extra_body) & (set(SamplingParams.model_fields) - {"extra_body"})):
        # A typed field in metadata.extra_body (vLLM's stop, seed...) is sent as rollcage sends that field.
        sampling.setdefault(key, extra_body.pop(key))
    if extra_body:
        sampling["extra_body"] = extra_body
    try:
        SamplingParams.model_validate(sampling)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in error.get("loc", ()))
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        if where == "extra_body":  # it came from metadata (see _metadata_extra_body)
            where, message = "metadata", message.removeprefix("extra_body: ")
            message = f"extra_body or chat_template_kwargs: {message}"
        raise ConfigError(f"responses_create_params.{where}: {message}") from None
    return sampling


def _metadata_extra_body(metadata: Any) -> dict[str, Any]:
    """The request fields NeMo Gym's model servers take from ``metadata`` (``extra_body`` and
    ``chat_template_kwargs``, each JSON text), as rollcage's ``extra_body``."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ConfigError("responses_create_params.metadata must be an object or null")
    extra: dict[str, Any] = {}
    for key, value in metadata.items():
        if key not in _METADATA_REQUEST_KEYS:
            raise ConfigError(
                f"responses_create_params.metadata.{key}: rollcage cannot send it to the model as NeMo Gym's "
                f"model servers would; it sends only metadata {' and '.join(_METADATA_REQUEST_KEYS)}"
            )
        try:
            parsed = json.loads(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ConfigError(f"responses_create_params.metadata.{key}: must be a JSON object, as text")
        if key == "extra_body":
            extra.update(parsed)
        elif parsed:
            extra["chat_template_kwargs"] = {**extra.get("chat_template_kwargs", {}), **parsed}
    return extra


def _nemo_input(raw_input: Any) -> str | list[dict[str, Any]]:
    if isinstance(raw_input, str):
        return raw_input
    if isinstance(raw_input, list) and raw_input:
        return _input_items(raw_input, "responses_create_params.input")
    raise ConfigError("responses_create_params.input must be a string or a non-empty list of items")


def _nemo_tools(raw_tools: Any) -> list[dict[str, Any]]:
    """NeMo Gym's function tools as rollcage resource tool specs."""
    if not isinstance(raw_tools, list):
        raise ConfigError("responses_create_params.tools must be a list")
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(raw_tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ConfigError(
                f"responses_create_params.tools[{index}]: only function tools are served, got {kind!r}"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"responses_create_params.tools[{index}].name must be a non-empty string")
        spec: dict[str, Any] = {
            "type": "resource",
            "name": name,
            "description": tool.get("description") or "",
        }
        if isinstance(tool.get("parameters"), dict):
            spec["parameters"] = tool["parameters"]
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ConfigError(f"responses_create_params.tools[{index}].strict must be true, false or null")
        if strict is not None:
            spec["strict"] = strict
        tools.append(spec)
    return tools


def _inspect_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ConfigError(f"{where}[{index}]: only text content is supported, got {kind!r}")
        # Inspect's ChatMessage.text: the text parts, a line apart (what its solvers rewrite).
        return "\n".join(texts)
    raise ConfigError(f"{where} must be a string or a list of content parts")


def from_inspect(
    value: dict[str, Any], line: int, environment: str | None, *, base: Path | None = None
) -> dict[str, Any]:
    """Map an Inspect sample to a rollcage row (``base``: where a relative compose file is read from).

    Raises:
        ConfigError: The sample is not usable here (the message names the field).
    """
    unknown = sorted(set(value) - _INSPECT_KEYS)
    if unknown:
        raise ConfigError(f"field {unknown[0]!r}: not a field of an Inspect sample")
    for key in ("files", "setup"):
        if value.get(key):
            raise ConfigError(
                f"{key}: Inspect's sample {key} are not reproduced; rollcage starts every rollout in an "
                "empty workspace (put what the agent needs in the input, or serve it from an environment)"
            )
    model_input = _inspect_input(value.get("input"))
    target = value.get("target")
    if target is not None and not (
        isinstance(target, str) or (isinstance(target, list) and all(isinstance(t, str) for t in target))
    ):
        raise ConfigError("target must be a string or a list of strings")
    choices = value.get("choices")
    grader: dict[str, Any] = {"type": "match"}
    if choices is not None:
        multiple = _multiple_correct(choices, target)
        model_input = _with_choices(model_input, choices, multiple_correct=multiple)
        grader = {"type": "choice", "choices": len(choices), "multiple_correct": multiple}
    raw_id = value.get("id")
    ok_id = (isinstance(raw_id, str) and raw_id) or (isinstance(raw_id, int) and not isinstance(raw_id, bool))
    row: dict[str, Any] = {"id": raw_id if ok_id else f"line-{line}", "input": model_input}
    if value.get("metadata") is not None:
        row["metadata"] = value["metadata"]
    if environment is not None:
        row["environment"] = environment
    if target is not None and target != []:
        row["expected"] = target
        if environment is None:
            row["grader"] = grader
    image = _inspect_image(value["sandbox"], base) if value.get("sandbox") is not None else None
    if image is not None:
        row["sandbox"] = {"image": image}
    elif environment is None:
        # generate() offers the model no tools; rollcage's default would be its python tool.
        row["tools"] = []
    return row


ASSUMED_SCORER = (
    "Assumed: Inspect samples name no solver or scorer (their task does); samples without choices run as "
    "generate() and are scored by match(), samples with choices run as multiple_choice() (multiple_correct "
    "when the target names several letters) and are scored by choice()"
)
"""Said once per run with Inspect samples graded here: which of Inspect's solvers and scorers they get."""


def inspect_notices(value: dict[str, Any], environment: str | None) -> tuple[str, ...]:
    """What a run says up front of an Inspect sample: what is assumed, what is not run as Inspect would."""
    notices: list[str] = []
    target = value.get("target")
    if environment is None and target is not None and target != []:
        notices.append(ASSUMED_SCORER)
    if value.get("sandbox") is not None and not _local(value["sandbox"]):
        notices.append(
            "Not reproduced: the solver, sandbox tools and other compose services of Inspect samples with "
            "a sandbox (rollcage's agent runs them with its python tool in the sandbox's image)"
        )
    if environment is not None:
        notices.append(
            "Not reproduced: Inspect samples run against --environment: its tools are offered and its "
            "/verify grades; Inspect's generate() and scorers are not reproduced"
        )
    return tuple(notices)


def _local(sandbox: Any) -> bool:
    return (
        sandbox == "local"
        or sandbox == ["local"]
        or (isinstance(sandbox, dict) and sandbox == {"type": "local"})
    )


def _multiple_correct(choices: Any, target: Any) -> bool:
    """Whether the target names several options: Inspect's ``multiple_correct``, which the sample cannot say.

    Raises:
        ConfigError: The target names no option of the choices (``choice()`` would refuse it).
    """
    if not isinstance(choices, list) or not choices:
        raise ConfigError("choices must be a non-empty list of strings")
    if target is None or target == []:
        return False
    try:
        positions = choice_positions(target, len(choices))
    except ValueError as exc:
        raise ConfigError(f"target: {exc}") from None
    return len(positions) > 1


_COMPOSE_FILES = (".yaml", ".yml")


def _inspect_image(sandbox: Any, base: Path | None) -> str | None:
    """The task image an Inspect sample's ``sandbox`` names (``docker://``), ``None`` for ``local``.

    Raises:
        ConfigError: It names no single image (the message says what it holds instead).
    """
    kind: Any
    config: Any
    if isinstance(sandbox, str):
        kind, config = sandbox, None
    elif isinstance(sandbox, list) and 1 <= len(sandbox) <= 2:
        kind, config = sandbox[0], sandbox[1] if len(sandbox) == 2 else None
    elif isinstance(sandbox, dict):
        kind, config = sandbox.get("type"), sandbox.get("config")
    else:
        raise ConfigError("sandbox: expected 'docker', ['docker', CONFIG] or {'type': ..., 'config': ...}")
    if kind == "local" and config is None:
        return None
    if kind != "docker":
        raise ConfigError(f"sandbox: type {kind!r} cannot be mapped (only docker with an image can)")
    if config is None:
        raise ConfigError(
            "sandbox: docker without a config names no image (Inspect's default builds one): give a compose "
            "file whose single service has an image"
        )
    if isinstance(config, str):
        if not config.endswith(_COMPOSE_FILES):
            raise ConfigError(
                f"sandbox: config {config!r} is not a compose file (.yaml, .yml); a Dockerfile must be built "
                "first: build and push the image, and name it in a compose file or the row's sandbox.image"
            )
        config = _read_compose(config, base)
    if not isinstance(config, dict):
        raise ConfigError("sandbox: config must be a compose file path or a mapping")
    if "image" in config and "services" not in config:
        return _docker_ref(config["image"], "sandbox: config.image")
    services = config.get("services")
    if not isinstance(services, dict) or len(services) != 1:
        count = len(services) if isinstance(services, dict) else 0
        raise ConfigError(
            f"sandbox: the compose config has {count} services; only one, with an image, can be mapped"
        )
    ((name, service),) = services.items()
    if not isinstance(service, dict) or "image" not in service:
        what = "a build" if isinstance(service, dict) and "build" in service else "no image"
        raise ConfigError(
            f"sandbox: compose service {name!r} has {what}; build and push it, then name its image"
        )
    return _docker_ref(service["image"], f"sandbox: compose service {name!r} image")


def _read_compose(path: str, base: Path | None) -> Any:
    import yaml

    file = Path(path) if base is None or Path(path).is_absolute() else base / path
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"sandbox: cannot read the compose file {file}: {exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"sandbox: the compose file {file} is not valid YAML: {first}") from exc


def _docker_ref(image: Any, where: str) -> str:
    if not isinstance(image, str) or not image.strip():
        raise ConfigError(f"{where} must be a non-empty string")
    return image if image.startswith("docker://") else f"docker://{image.strip()}"


def _inspect_input(raw: Any) -> str | list[dict[str, Any]]:
    """An Inspect sample's input: a string, or chat messages as Responses message items."""
    if isinstance(raw, str):
        return raw
    if not (isinstance(raw, list) and raw):
        raise ConfigError("input must be a string or a non-empty list of chat messages")
    items: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise ConfigError(f"input[{index}] must be a chat message object")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ConfigError(f"input[{index}].role: {role!r} is not supported (system, user, assistant)")
        text = _inspect_content(message.get("content"), f"input[{index}].content")
        items.append({"type": "message", "role": role, "content": text})
    return items


def _with_choices(
    model_input: str | list[dict[str, Any]], choices: Any, *, multiple_correct: bool
) -> str | list[dict[str, Any]]:
    """The input with its (last) user message made ``multiple_choice()``'s prompt for ``choices``."""
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices) or len(choices) > 26:
        raise ConfigError("choices must be a list of at most 26 strings")
    if isinstance(model_input, str):
        return choice_prompt(model_input, choices, multiple_correct=multiple_correct)
    last = max((i for i, m in enumerate(model_input) if m["role"] == "user"), default=None)
    if last is None:
        raise ConfigError("choices need a user message in input to go with")
    items = list(model_input)
    question = items[last]["content"]
    items[last] = {
        **items[last],
        "content": choice_prompt(question, choices, multiple_correct=multiple_correct),
    }
    return items
