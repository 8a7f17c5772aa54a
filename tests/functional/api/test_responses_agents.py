"""The ``openai-agents`` SDK (PyPI ``openai-agents``) against Kiln on the scripted fake upstream:
an Agent with one function tool, run through ``OpenAIResponsesModel`` on ``POST /v1/responses``
(the model calls the tool, the SDK runs it and sends its output, the model answers); every
request of the run billed exactly once (docs/RESPONSES.md)."""
import json
import uuid

import openai
import pytest
from agents import function_tool

from fake_upstream import chat_chunk, chat_completion, json_reply, sse
from gateway_proc import make_org
from responses_checks import assert_billed_once, run_agent, stored_generations

GRANT = 10 * 10**9
ANSWER = "Hello from the fake upstream!"


def weather_tool(calls):
    # No docstring: the Agents SDK then sends the tool without a description, which OpenAI
    # accepts (docs/RESPONSES.md, "tools").
    @function_tool
    def get_weather(city: str) -> str:
        calls.append(city)
        return f"Sunny in {city}, 21 C"
    return get_weather


def call_script(stream):
    call = {"id": "call_ag1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}
    if not stream:
        return json_reply(chat_completion(None, finish_reason="tool_calls", tool_calls=[call]))
    return sse([chat_chunk(tool_calls=[{"index": 0, **call}], role="assistant"),
                chat_chunk(finish_reason="tool_calls")])


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_an_agent_with_a_function_tool_runs_to_its_answer(gateway, fake, engine, stream):
    org = make_org(engine, f"agent-{uuid.uuid4().hex[:8]}")
    fake.enqueue(call_script(stream))
    calls = []
    result = run_agent(gateway.base_url, org.key, "fake-model", "Weather in Oslo?",
                       tools=[weather_tool(calls)], stream=stream, instructions="Use tools.")
    assert result.final_output == ANSWER and calls == ["Oslo"]
    first, second = (r.json for r in fake.requests[-2:])
    assert first["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "get_weather",
        "parameters": first["tools"][0]["function"]["parameters"], "strict": True}}]
    assert first["messages"][0] == {"role": "system", "content": "Use tools."}
    assert second["messages"][-2]["tool_calls"][0]["id"] == "call_ag1"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_ag1",
                                      "content": "Sunny in Oslo, 21 C"}
    # Each model call of the run is one stored response and one usage event.
    ids = [r.response_id for r in result.raw_responses]
    generations = stored_generations(engine, org.id, ids)
    assert sorted(generations) == sorted(ids) and len(ids) == 2
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0) as client:
        costs = [client.responses.retrieve(i).usage.model_extra["cost"] for i in ids]
    assert_billed_once(engine, org, [generations[i] for i in ids], costs, GRANT)


def test_a_backend_failure_is_a_clean_openai_error_for_the_agent(gateway, fake, engine):
    from fake_upstream import error_reply
    org = make_org(engine, f"agent-fail-{uuid.uuid4().hex[:8]}")
    fake.enqueue(error_reply(500, "boom"))
    with pytest.raises(openai.InternalServerError) as err:
        run_agent(gateway.base_url, org.key, "fake-model", "Hi")
    assert err.value.status_code == 502
