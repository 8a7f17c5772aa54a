"""End to end on the Anthropic Messages API: the official ``anthropic`` SDK and Claude Code,
through Kiln (gunicorn, gevent workers), to the real llama.cpp server with SmolLM2-135M
(docs/MESSAGES.md). Each answer's ``usage.cost``, its usage event (endpoint ``messages``) and
the balance's change agree exactly; every request is billed once.
"""
from decimal import Decimal

import anthropic
import pytest

import claude_code
from factories import SMOLLM2_NANOS, literal_cost_nanos
from fake_upstream import chat_completion, json_reply, make_usage
from gateway_proc import ROOT, Gateway, balance_nanos, make_org, settled_event
from streams import org_events

pytestmark = pytest.mark.llama

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def llama_gateway(pg_url, llama, tmp_path_factory):
    """A gateway whose catalog is ``make run``'s, on the module's model server."""
    path = tmp_path_factory.mktemp("llama-messages") / "models.toml"
    path.write_text((ROOT / "gateway" / "demo_models.toml").read_text().replace(
        "http://127.0.0.1:8081", llama))
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(path)}, workers=2).start()
    yield gw
    gw.stop()


def sdk(gateway, key):
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0,
                               timeout=120)


def assert_billed_once(engine, org, gid, cost, before):
    """The generation ``gid`` is the org's one usage event, endpoint ``messages``, at the
    demo catalog's prices; ``cost`` (the answer's ``usage.cost``) is what it cost and what left
    the balance."""
    event = settled_event(engine, gid)
    assert [e["id"] for e in org_events(engine, org.id)] == [gid]
    assert event["endpoint"] == "messages" and event["status"] == "completed"
    assert event["cost_nanos"] == literal_cost_nanos(
        SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"],
        event["cached_tokens"]) > 0
    assert Decimal(str(cost)) == Decimal(event["cost_nanos"]) / 10**9
    after = balance_nanos(engine, org.id)
    assert before[0] - after[0] == event["cost_nanos"] and after[1:] == (0, 0)
    return event


def test_create_answers_and_is_billed_exactly(llama_gateway, engine):
    org = make_org(engine, "msg-e2e-create")
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=24,
                                                       messages=ASK,
                                                       extra_body={"temperature": 0})
    message = raw.parse()
    assert isinstance(message, anthropic.types.Message) and message.model == MODEL
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               message.usage.model_extra["cost"], before)
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (message.usage.input_tokens, message.usage.output_tokens)
    assert 0 < message.usage.output_tokens <= 24


def test_max_tokens_above_the_models_maximum_is_lowered_and_said(llama_gateway, engine):
    """Agent clients ask for more than the model's 1024: held for at 1024, said in a header."""
    org = make_org(engine, "msg-e2e-lowered")
    with sdk(llama_gateway, org.key) as client:
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=32000,
                                                       messages=ASK, extra_body={"temperature": 0},
                                                       stop_sequences=["\n"])
    assert raw.headers["X-Kiln-Max-Tokens-Lowered"] == "32000->1024"
    assert settled_event(engine, raw.headers["X-Neocloud-Generation-Id"])["hold_nanos"] >= \
        1024 * SMOLLM2_NANOS["output"]


def test_stream_text_and_final_message_are_billed_exactly(llama_gateway, engine):
    # llama.cpp's server sends no usage in streams: Kiln's own count, flagged estimated. The
    # SDK's final message keeps Anthropic's usage fields only: Kiln's cost is read from the
    # message_delta event that told it.
    org = make_org(engine, "msg-e2e-stream")
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK) as stream:
            kinds, text, usage = [], "", None
            for event in stream:
                kinds.append(event.type)
                if event.type == "text":
                    text += event.text
                if event.type == "message_delta":
                    usage = event.usage
            final = stream.get_final_message()
            gid = stream.response.headers["X-Neocloud-Generation-Id"]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert text.strip() and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert usage.model_extra["estimated"] is True
    event = assert_billed_once(engine, org, gid, usage.model_extra["cost"], before)
    assert event["estimated"] is True
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.input_tokens, usage.output_tokens) == \
        (final.usage.input_tokens, final.usage.output_tokens)
    assert 0 < final.usage.output_tokens <= 24


def test_count_tokens_is_the_models_count_or_above_and_never_billed(llama_gateway, engine):
    org = make_org(engine, "msg-e2e-count")
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        counted = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
        assert org_events(engine, org.id) == [] and balance_nanos(engine, org.id) == before
        used = client.messages.create(model=MODEL, max_tokens=1, messages=ASK).usage
    assert counted >= used.input_tokens > 0


def test_a_tool_loop_the_fake_calls_the_tool_and_the_model_answers(llama_gateway, gateway,
                                                                   fake, engine):
    """tool_use -> tool_result -> answer. The small model does not call tools reliably: the
    scripted fake upstream (the shared gateway's ``fake-model``) makes the call, and the real
    model answers the conversation with the tool's result. Each request is billed once."""
    call = {"id": "call_w1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    fake.enqueue(json_reply(chat_completion(None, tool_calls=[call], finish_reason="tool_calls",
                                            usage=make_usage(prompt=60, completion=9))))
    org = make_org(engine, "msg-e2e-tools")
    question = {"role": "user", "content": "What is the weather in Paris?"}
    with sdk(gateway, org.key) as client:
        first = client.messages.create(model="fake-model", max_tokens=100, tools=[WEATHER],
                                       messages=[question])
    assert first.stop_reason == "tool_use"
    use, = [b for b in first.content if b.type == "tool_use"]
    assert (use.id, use.name, use.input) == ("call_w1", "get_weather", {"city": "Paris"})
    assert fake.requests[-1].json["tools"][0]["function"]["name"] == "get_weather"
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=32, tools=[WEATHER], extra_body={"temperature": 0}, messages=[
                question, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "Sunny, 24 degrees Celsius."}]}])
    answer = raw.parse()
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content and answer.usage.output_tokens > 0
    gid = raw.headers["X-Neocloud-Generation-Id"]
    event = settled_event(engine, gid)
    assert event["endpoint"] == "messages" and event["status"] == "completed"
    assert Decimal(str(answer.usage.model_extra["cost"])) == Decimal(event["cost_nanos"]) / 10**9
    assert before[0] - balance_nanos(engine, org.id)[0] == event["cost_nanos"]
    events = org_events(engine, org.id)
    assert len(events) == 2 and {e["endpoint"] for e in events} == {"messages"}


def test_a_prompt_over_the_context_window_is_a_clean_400(llama_gateway, engine):
    """Over the model's 4096 tokens: the backend's own 400, relayed in Anthropic's envelope
    (the SDK's BadRequestError) and not billed."""
    org = make_org(engine, "msg-e2e-context")
    long = " ".join(["colour"] * 6000)  # over 4096 tokens, under 64 bytes per token
    with sdk(llama_gateway, org.key) as client, pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=16,
                               messages=[{"role": "user", "content": long}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["code"] == "upstream_rejected"
    assert balance_nanos(engine, org.id)[0] == 10 * 10**9
    assert all(e["cost_nanos"] == 0 for e in org_events(engine, org.id))


def test_claude_code_gets_an_answer_or_a_clean_error_never_a_5xx(llama_gateway, engine):
    """Claude Code's system prompt and tools are larger than the small model's 4096-token
    context: its request gets Kiln's or the backend's 400 in Anthropic's envelope (or, were it
    to fit, an answer), promptly; never a 5xx, never a hang, never a charge for a refusal."""
    binary = claude_code.installed()
    if binary is None:
        pytest.skip("npm is absent: Claude Code cannot be installed")
    org = make_org(engine, "msg-e2e-claude-code")
    done = claude_code.run(binary, llama_gateway.base_url, org.key, MODEL, "Say hello.",
                           timeout_s=240)
    logged = llama_gateway.log_events(org_id=org.id)
    statuses = [e["http_status"] for e in logged]
    assert statuses and all(s in (200, 400) for s in statuses), logged
    if done.returncode == 0:
        assert done.stdout.strip()
    else:
        assert "400" in done.stdout + done.stderr
        refused = [e for e in logged if e["http_status"] == 400]
        codes = [(e["event"], e.get("code")) for e in refused]
        assert refused and all(code in ("upstream_rejected", "context_length_exceeded",
                                        "invalid_value") for _, code in codes), codes
        events = {e["id"]: e for e in org_events(engine, org.id)}
        for e in refused:  # the backend's refusals: each a usage event, status rejected
            if e["event"] == "generation":
                assert events[e["generation_id"]]["status"] == "rejected"
    events = org_events(engine, org.id)
    billed = sum(e["cost_nanos"] for e in events)
    assert balance_nanos(engine, org.id) == (10 * 10**9 - billed, 0, 0)
    assert all(e["endpoint"] == "messages" for e in events)
    if done.returncode != 0:  # refused throughout: nothing generated, nothing billed
        assert billed == 0, events
