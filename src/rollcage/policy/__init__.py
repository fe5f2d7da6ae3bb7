"""The scripted policy: a deterministic OpenAI-compatible model server with fault injection.

It serves ``/v1/chat/completions``, ``/v1/responses`` (both also as server-sent
events) and ``/v1/models``, answering from a **policy script**, so the whole
pipeline runs and is tested with no GPU and no network. Answers are shaped so
that the official ``openai`` SDK parses them.

Script format (YAML or JSON)::

    model: scripted-policy            # optional: the model id /v1/models lists
    tasks:
      weather-1:                      # task id: X-Task-Id header, else a [task:ID] marker in the prompt
        - reasoning: "Need the weather, and a sum."       # reasoning_content / a reasoning item
          tool_calls:                                      # several calls in one turn: parallel calls
            - {name: get_weather, arguments: {city: Oslo}}
            - {name: python, arguments: {code: "print(sum([40, 2]))"}}
        - text: "cold;sum=42"                              # final answer
      codeact-1:
        - code: "w = get_weather(city='Oslo')\\nprint(w)"  # sent as a fenced ```python block
        - code: "submit(f'{w};sum={sum([40,2])}')"
      loops-forever:
        - tool_calls: [{name: python, arguments: {code: "1"}}]
          repeat: true                                     # last turn only: replay it forever
      broken-json:
        - tool_calls: [{name: python, arguments_raw: "{bad json"}]   # arguments sent verbatim
      cut-short:
        - text: "This answer stops mid-"
          finish: length                                   # finish_reason=length / status=incomplete
      "*":                                                 # any other task
        - text: "I don't know"

A turn has at least one of ``text``, ``code``, ``tool_calls``, ``reasoning``;
``text`` and ``code`` together make one message (text, then the code block).
Tool-call ids are ``call_<turn>_<k>``.

**Turn selection is stateless**: the turn played is the number of assistant
turns already in the request's history (chat: assistant messages; responses:
runs of consecutive model items - message, function_call, reasoning). A retried
request replays the same turn, and any number of rollouts can share one server.
Past the end of the script the server replays the last turn if it has
``repeat``, else answers with the last turn's text, else with a fixed message.

Token usage is deterministic: ``ceil(utf8 bytes / 4)`` per text (see
``rollcage.policy._render``); cached tokens are reported as 0.

Faults (see ``rollcage.policy._faults`` for the grammar and every kind) are
injected by schedule (``call=3:status=503``) or by seeded chance; each injected
fault is logged in memory (``PolicyServer.faults_injected``) and optionally as
JSONL, with the call number, rollout id, task id and kind. Requests are counted
per rollout id (``PolicyServer.requests``).

In-process use::

    with PolicyServer("examples/policy-demo.yaml", faults=["call=1:status=503"]) as srv:
        endpoint = srv.endpoint(api="responses")      # ModelEndpoint for rollcage.model
        ...
        srv.faults_injected, srv.requests
"""

from rollcage.policy._app import PolicyApp, PolicyState, RequestRecord, count_model_turns, find_task_marker
from rollcage.policy._faults import FaultPlan, FaultRecord, FaultRule, parse_fault_kinds, parse_fault_spec
from rollcage.policy._render import count_tokens
from rollcage.policy._script import PolicyScript, load_script
from rollcage.policy._server import PolicyServer, ServeOptions, bind_socket, serve

__all__ = [
    "FaultPlan",
    "FaultRecord",
    "FaultRule",
    "PolicyApp",
    "PolicyScript",
    "PolicyServer",
    "PolicyState",
    "RequestRecord",
    "ServeOptions",
    "bind_socket",
    "count_model_turns",
    "count_tokens",
    "find_task_marker",
    "load_script",
    "parse_fault_kinds",
    "parse_fault_spec",
    "serve",
]
