"""``POST /v1/responses`` end to end on the real model: the official openai SDK and the
``openai-agents`` SDK through Kiln (gunicorn, gevent workers) to the llama.cpp server with
SmolLM2-135M. Every response is billed exactly once: one usage event per generation id, of
endpoint ``responses``, its cost the answer's ``usage.cost``, the balance moved by exactly that;
a continued conversation's carried history is metered as input (docs/RESPONSES.md)."""
import json
import uuid

import openai
import pytest

from factories import CATALOG, SMOLLM2_NANOS, literal_cost_nanos
from gateway_proc import ROOT, Gateway, balance_nanos, make_org, settled_event
from responses_checks import (assert_billed_once, org_events, run_agent, stored_generations,
                              stored_ids)

pytestmark = pytest.mark.llama

MODEL = "smollm2-135m"
GRANT = 10 * 10**9


@pytest.fixture(scope="module")
def llama_gateway(pg_url, llama, fake_upstream, tmp_path_factory):
    """A gateway whose catalog has the real model and the fake upstream's models (a scripted
    tool call from one, the plain answer from the other)."""
    text = (ROOT / "gateway" / "demo_models.toml").read_text().replace(
        "http://127.0.0.1:8081", llama) + CATALOG.format(url=fake_upstream.base_url)
    path = tmp_path_factory.mktemp("llama-responses") / "models.toml"
    path.write_text(text)
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(path)}, workers=2).start()
    yield gw
    gw.stop()


@pytest.fixture
def org(engine):
    return make_org(engine, f"resp-llama-{uuid.uuid4().hex[:8]}")


def sdk(gateway, key):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=120)


def gid(raw):
    return raw.headers["X-Neocloud-Generation-Id"]


def cost(response):
    return response.usage.model_extra["cost"]


def priced(event):
    return literal_cost_nanos(SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"],
                              event["cached_tokens"])


def test_create_stream_continue_retrieve_list_delete(llama_gateway, engine, org):
    with sdk(llama_gateway, org.key) as client:
        first = client.responses.with_raw_response.create(
            model=MODEL, input="Name three colours.", max_output_tokens=24, temperature=0)
        r1 = first.parse()
        assert r1.output_text.strip() and r1.status in ("completed", "incomplete")
        assert r1.usage.input_tokens > 0 and 0 < r1.usage.output_tokens <= 24
        with client.responses.stream(model=MODEL, input="And three animals?",
                                     previous_response_id=r1.id, max_output_tokens=24,
                                     temperature=0) as stream:
            seen = list(stream)
        deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        # At its length a generation ends with response.incomplete (the SDK's
        # get_final_response() wants response.completed): either carries the whole response.
        assert seen[-1].type in ("response.completed", "response.incomplete")
        r2 = seen[-1].response
        assert deltas == r2.output_text and deltas.strip()
        # The carried history (r1's input and answer) is metered as input.
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
        r3_raw = client.responses.with_raw_response.create(
            model=MODEL, input="Which did you like?", previous_response_id=r2.id,
            max_output_tokens=16, temperature=0)
        r3 = r3_raw.parse()
        assert r3.usage.input_tokens > r2.usage.input_tokens
        got = client.responses.retrieve(r2.id)
        assert got.output_text == r2.output_text and got.usage.model_extra["cost"] == cost(r2)
        items = client.responses.input_items.list(r3.id)
        assert [i.content[0].text for i in items.data] == ["Which did you like?"]
        client.responses.delete(r3.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r3.id)
    gids = [gid(first), stored_generations(engine, org.id, [r2.id])[r2.id], gid(r3_raw)]
    events = assert_billed_once(engine, org, gids, [cost(r1), cost(r2), cost(r3)], GRANT)
    for event in events:
        assert event["status"] == "completed" and event["cost_nanos"] == priced(event)
    # r3 was deleted: its row stays, expired, until the sweep (docs/RESPONSES.md)
    assert stored_ids(engine, org.id, {r1.id, r2.id}, live=True) == {r1.id, r2.id}


def test_function_calling_loop_with_the_real_model_answering(llama_gateway, fake_upstream,
                                                             engine, org):
    """The tool call is scripted (the fake upstream's model, deterministic); the client runs the
    tool and the real model answers from its output, continuing the stored response."""
    from fake_upstream import chat_completion, json_reply
    fake_upstream.clear()
    fake_upstream.enqueue(json_reply(chat_completion(None, finish_reason="tool_calls",
                                                     tool_calls=[{
        "id": "call_t1", "type": "function",
        "function": {"name": "get_time", "arguments": json.dumps({"city": "Lima"})}}])))
    tool = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}
    with sdk(llama_gateway, org.key) as client:
        first = client.responses.with_raw_response.create(
            model="fake-model", input="What time is it in Lima?", tools=[tool])
        r1 = first.parse()
        call, = [o for o in r1.output if o.type == "function_call"]
        output = {"type": "function_call_output", "call_id": call.call_id,
                  "output": f"It is 10:30 in {json.loads(call.arguments)['city']}."}
        second = client.responses.with_raw_response.create(
            model=MODEL, previous_response_id=r1.id, input=[output], max_output_tokens=24,
            temperature=0)
        r2 = second.parse()
    assert r2.output_text.strip() and r2.status in ("completed", "incomplete")
    assert_billed_once(engine, org, [gid(first), gid(second)], [cost(r1), cost(r2)], GRANT)


def test_a_plain_agent_run_on_the_real_model_is_billed_once(llama_gateway, engine, org):
    """An Agent with no tools: the run completes with the model's answer, or fails with a clean
    OpenAI or Agents SDK error (never a 5xx, never a hang); whatever it asked is billed once."""
    try:
        result = run_agent(llama_gateway.base_url, org.key, MODEL, "Say hello in one sentence.",
                           instructions="Reply briefly.", temperature=0, max_tokens=48)
    except openai.APIStatusError as err:
        assert err.status_code < 500, err
        result = None
    except openai.APIConnectionError as err:
        raise AssertionError(f"the run did not get an answer: {err!r}") from err
    except Exception as err:  # noqa: BLE001 - e.g. the SDK refusing an incomplete response
        assert type(err).__module__.startswith("agents"), repr(err)
        result = None
    events = org_events(engine, org.id)
    assert events, "the agent made no request"
    for event in events:
        event = settled_event(engine, event["id"])
        assert event["endpoint"] == "responses" and event["cost_nanos"] == priced(event)
    if result is not None:
        assert isinstance(result.final_output, str) and result.final_output.strip()
        ids = [r.response_id for r in result.raw_responses]
        generations = stored_generations(engine, org.id, ids)
        with sdk(llama_gateway, org.key) as client:
            costs = [cost(client.responses.retrieve(i)) for i in ids]
        assert_billed_once(engine, org, [generations[i] for i in ids], costs, GRANT)
    else:
        assert GRANT - balance_nanos(engine, org.id)[0] == sum(
            settled_event(engine, e["id"])["cost_nanos"] for e in events)
