"""``POST /v1/responses`` and the stored responses through the real gateway (gunicorn, gevent
workers, Postgres) on the scripted fake upstream, with the official ``openai`` SDK: create,
stream, a function-calling loop, ``previous_response_id``, retrieve, delete, input items, the
SDK's error classes; every response billed exactly once; the chat relay's stream shapes billed
the same through both APIs; ``store: false``, failed and cancelled responses keep nothing;
another org's id is 404 on every path; retention and purge (docs/RESPONSES.md,
deploy/RUNBOOK.md)."""
import json
import uuid
from decimal import Decimal

import openai
import pytest
import requests
import sqlalchemy as sa

from fake_upstream import (Close, Hang, Send, Status, chat_chunk, chat_completion, error_reply,
                           json_reply, make_usage, sse, sse_event)
from factories import fake_model_nanos
from gateway_proc import balance_nanos, make_org, settled_event, wait_until
from responses_checks import assert_billed_once, org_events, response_events, stored_ids
from streams import RawStream, close_raw_streams

RESPONSES = "/v1/responses"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
GRANT = 10 * 10**9


@pytest.fixture(autouse=True)
def raw_streams_closed():
    yield
    close_raw_streams()


def gid_of(raw):
    return raw.headers["X-Neocloud-Generation-Id"]


def cost_of(response):
    return response.usage.model_extra["cost"]


def upstream_messages(fake, n=-1):
    return fake.requests[n].json["messages"]


# -- the SDK's responses resource -------------------------------------------------------------

def test_create_is_answered_and_billed_once(client, fake, org, engine):
    raw = client.responses.with_raw_response.create(model="fake-model", input="Say hello")
    resp = raw.parse()
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.model == "fake-model"
    assert resp.output_text == "Hello from the fake upstream!"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == \
        (10, 5, 15)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    event, = assert_billed_once(engine, org, [gid_of(raw)], [cost_of(resp)], GRANT)
    assert event["cost_nanos"] == fake_model_nanos(prompt=10, completion=5)
    assert upstream_messages(fake) == [{"role": "user",
                                        "content": [{"type": "text", "text": "Say hello"}]}]
    assert stored_ids(engine, org.id, {resp.id}) == {resp.id}


def test_stream_text_and_final_response(client, fake, org, engine):
    with client.responses.stream(model="fake-model", input="Say hello",
                                 instructions="Be brief.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Hello from the fake upstream!" == final.output_text
    assert final.status == "completed" and final.instructions == "Be brief."
    gid, = [e["id"] for e in org_events(engine, org.id)]
    assert_billed_once(engine, org, [gid], [cost_of(final)], GRANT)
    assert upstream_messages(fake)[0] == {"role": "system", "content": "Be brief."}
    assert fake.requests[-1].json["stream_options"] == {"include_usage": True}
    assert client.responses.retrieve(final.id).output_text == final.output_text


def get_weather(city):
    return f"Sunny in {city}, 21 C"


def scripted_call(call_id="call_w1", city="Paris"):
    return json_reply(chat_completion(None, finish_reason="tool_calls", tool_calls=[{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]))


@pytest.mark.parametrize("carried", ["previous_response_id", "input_items"])
def test_function_calling_loop(client, fake, org, engine, carried):
    """The model calls the tool (scripted), the client runs it and sends a function_call_output,
    either continuing the stored response or sending the whole conversation back itself."""
    fake.enqueue(scripted_call())
    store = carried == "previous_response_id"
    first = client.responses.with_raw_response.create(
        model="fake-model", input="Weather in Paris?", tools=[TOOL], store=store)
    r1 = first.parse()
    call, = [o for o in r1.output if o.type == "function_call"]
    assert (call.call_id, call.name) == ("call_w1", "get_weather") and r1.output_text == ""
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": get_weather(**json.loads(call.arguments))}
    if store:
        second = client.responses.with_raw_response.create(
            model="fake-model", previous_response_id=r1.id, input=[result], tools=[TOOL])
    else:
        items = [o.model_dump(exclude_none=True) for o in r1.output]
        second = client.responses.with_raw_response.create(
            model="fake-model", input=[{"role": "user", "content": "Weather in Paris?"},
                                       *items, result], tools=[TOOL], store=False)
    r2 = second.parse()
    assert r2.output_text == "Hello from the fake upstream!"
    sent = upstream_messages(fake)
    assert sent[-2]["role"] == "assistant" and sent[-2]["tool_calls"] == [{
        "id": "call_w1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_w1",
                        "content": "Sunny in Paris, 21 C"}
    assert fake.requests[-1].json["tools"][0]["function"]["name"] == "get_weather"
    assert_billed_once(engine, org, [gid_of(first), gid_of(second)],
                       [cost_of(r1), cost_of(r2)], GRANT)
    expected = {r1.id, r2.id} if store else set()
    assert stored_ids(engine, org.id, expected) == expected


def test_previous_response_id_carries_the_chain_and_the_stored_api(client, fake, org, engine):
    r1 = client.responses.create(model="fake-model", input="My name is Ada.")
    r2 = client.responses.create(model="fake-model", input="And yours?",
                                 previous_response_id=r1.id, instructions="Be kind.")
    r3 = client.responses.create(model="fake-model", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}],
        previous_response_id=r2.id)
    texts = [m.get("content") for m in upstream_messages(fake)]
    answer = "Hello from the fake upstream!"
    assert texts == [[{"type": "text", "text": "My name is Ada."}], [{"type": "text",
                     "text": answer}], [{"type": "text", "text": "And yours?"}],
                     [{"type": "text", "text": answer}],
                     [{"type": "text", "text": "What is my name?"}]]  # no earlier instructions
    assert r3.previous_response_id == r2.id
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == answer and got.instructions == "Be kind."
    raw = client.responses.with_raw_response.retrieve(r2.id)
    assert json.loads(raw.text, parse_float=Decimal)["usage"]["cost"] == \
        Decimal(str(cost_of(r2)))  # the number the answer told, exactly (not a string)
    items = client.responses.input_items.list(r3.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["What is my name?"]
    assert items.data[0].id.startswith("msg_") and items.data[0].role == "user"
    assert client.responses.delete(r2.id) is None  # the SDK returns nothing for a deletion
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)
    with pytest.raises(openai.NotFoundError) as err:  # a chain with a link gone is never used
        client.responses.create(model="fake-model", input="x", previous_response_id=r3.id)
    assert err.value.body["param"] == "previous_response_id"
    costs = [cost_of(r) for r in (r1, r2, r3)]
    assert len(org_events(engine, org.id)) == 3 and len(fake.requests) == 3
    assert GRANT - balance_nanos(engine, org.id)[0] == \
        sum(Decimal(str(c)) * 10**9 for c in costs)


def test_a_carried_history_counts_once_against_the_context_window(client, fake, org):
    # fake-model: 8,192 tokens of context, refused above 64 bytes a token (524,288 bytes).
    long_text = "word " * 60_000  # 300,000 bytes: fits once, not twice
    r1 = client.responses.create(model="fake-model", input=long_text)
    r2 = client.responses.create(model="fake-model", input="Go on.", previous_response_id=r1.id)
    assert r2.status == "completed"
    assert upstream_messages(fake)[0]["content"][0]["text"] == long_text
    with pytest.raises(openai.BadRequestError) as err:  # history and input together do not fit
        client.responses.create(model="fake-model", input=long_text, previous_response_id=r2.id)
    assert err.value.body["code"] == "context_length_exceeded"
    assert len(fake.requests) == 2


def test_input_items_pages(client, fake, org):
    parts = [{"role": "user", "content": f"line {i}"} for i in range(5)]
    resp = client.responses.create(model="fake-model", input=parts)
    page = client.responses.input_items.list(resp.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["line 4", "line 3"] and page.has_more
    every = [i.content[0].text for i in client.responses.input_items.list(resp.id, limit=2)]
    assert every == [f"line {i}" for i in (4, 3, 2, 1, 0)]  # the SDK follows `after`
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(resp.id, limit=101)


# -- the SDK's error classes ---------------------------------------------------------------------

def sdk(gateway, key):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=30)


def test_the_sdk_raises_its_own_error_class_for_each_status(gateway, client, fake, org, engine):
    create = dict(model="fake-model", input="Hi")
    cases = []

    def expect(cls, status, call):
        with pytest.raises(cls) as err:
            call()
        assert err.value.status_code == status
        cases.append(status)
        return err.value

    assert expect(openai.BadRequestError, 400, lambda: client.responses.create(
        **create, extra_body={"colour": "red"})).code == "unknown_parameter"
    with sdk(gateway, "kiln-not-a-key") as bad:
        expect(openai.AuthenticationError, 401, lambda: bad.responses.create(**create))
    poor = make_org(engine, f"poor-{uuid.uuid4().hex[:8]}", usd="0.0000001")
    with sdk(gateway, poor.key) as c:
        assert expect(openai.APIStatusError, 402, lambda: c.responses.create(
            **create)).code == "insufficient_credits"
    suspended = make_org(engine, f"susp-{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE orgs SET status = 'suspended' WHERE id = :o"),
                     {"o": suspended.id})
    with sdk(gateway, suspended.key) as c:
        expect(openai.PermissionDeniedError, 403, lambda: c.responses.create(**create))
    assert expect(openai.NotFoundError, 404, lambda: client.responses.create(
        model="no-such-model", input="Hi")).code == "model_not_found"
    expect(openai.NotFoundError, 404, lambda: client.responses.retrieve("resp_nope"))
    fake.enqueue(error_reply(500, "boom"))
    expect(openai.InternalServerError, 502, lambda: client.responses.create(**create))
    fake.enqueue(error_reply(429, "busy"))
    expect(openai.InternalServerError, 503, lambda: client.responses.create(**create))
    # 429: the org's one slot is held by a stream the backend has not answered yet.
    busy = make_org(engine, f"busy-{uuid.uuid4().hex[:8]}", limit=1)
    fake.enqueue([Hang()])
    held = RawStream(gateway.base_url, busy.key, {**create, "stream": True}, path=RESPONSES)
    fake.wait_for(lambda rs: rs and rs[-1].json.get("stream"), timeout=15)
    with sdk(gateway, busy.key) as c:
        expect(openai.RateLimitError, 429, lambda: c.responses.create(**create))
    held.close()
    assert cases == [400, 401, 402, 403, 404, 404, 502, 503, 429]
    assert [e["status"] for e in org_events(engine, org.id)].count("completed") == 0
    assert stored_ids(engine, org.id) == set()


# -- what is stored, and whose it is ----------------------------------------------------------

def test_another_orgs_response_is_404_on_every_path(gateway, client, fake, org, engine):
    mine = client.responses.create(model="fake-model", input="Secret plans")
    other = make_org(engine, f"other-{uuid.uuid4().hex[:8]}")
    base, h = gateway.base_url + RESPONSES, other.headers
    for method, url, kwargs in [
            ("GET", f"{base}/{mine.id}", {}), ("DELETE", f"{base}/{mine.id}", {}),
            ("GET", f"{base}/{mine.id}/input_items", {}),
            ("POST", base, {"json": {"model": "fake-model", "input": "Go on",
                                     "previous_response_id": mine.id}}),
            ("POST", base, {"json": {"model": "fake-model", "input": "Go on", "stream": True,
                                     "previous_response_id": mine.id}})]:
        r = requests.request(method, url, headers=h, timeout=30, **kwargs)
        assert r.status_code == 404, (method, url, r.text)
        assert r.json()["error"]["code"] == "not_found"
        assert "Secret" not in r.text
    assert len(fake.requests) == 1 and org_events(engine, other.id) == []
    assert client.responses.retrieve(mine.id).output_text  # still the owner's, untouched


@pytest.mark.parametrize("stream", [False, True])
def test_store_false_keeps_nothing(client, fake, org, engine, stream):
    if stream:
        with client.responses.stream(model="fake-model", input="Hi", store=False) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(model="fake-model", input="Hi", store=False)
    assert resp.store is False and resp.output_text
    assert stored_ids(engine, org.id) == set()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="fake-model", input="x", previous_response_id=resp.id)
    assert len(org_events(engine, org.id)) == 1  # the 404s were never generations


def test_store_default_off_by_setting(start_gateway, fake, org, engine):
    import time

    from gateway.models import response_id_created_at
    gw = start_gateway(responses_store_default="false")
    with sdk(gw, org.key) as c:
        resp = c.responses.create(model="fake-model", input="Hi")
        kept = c.responses.create(model="fake-model", input="Hi", store=True)
    assert resp.store is False and kept.store is True
    assert stored_ids(engine, org.id, {kept.id}) == {kept.id}
    # The stored one's id tells when it was made (a read may wait for its row); the unstored
    # one's is random: naming it is a 404 at once, never taken for a row still to be written.
    assert abs(response_id_created_at(kept.id) - time.time()) < 60
    assert abs(response_id_created_at(resp.id) - time.time()) > 60  # chance 1 in 35 million


def test_a_chain_continued_at_once_across_two_workers_never_misses_a_turn(start_gateway, fake,
                                                                         org, engine):
    """Each turn continues the one before the moment its answer ends, on one keep-alive
    connection to a gateway of two workers: whichever worker gets the next turn finds the row
    the other one writes after its answer (docs/RESPONSES.md, "Stored responses")."""
    gw = start_gateway(workers=2)
    fake.default = lambda record: [*json_reply(chat_completion("Noted."))]
    previous, ids = None, []
    with requests.Session() as http:
        for turn in range(16):
            body = {"model": "fake-model", "input": f"Turn {turn}."}
            if previous:
                body["previous_response_id"] = previous
            r = http.post(gw.base_url + "/v1/responses", json=body, headers=org.headers,
                          timeout=30)
            assert r.status_code == 200, (turn, r.text)
            previous = r.json()["id"]
            ids.append(previous)
    carried = [len(record.json["messages"]) for record in fake.requests[-16:]]
    assert carried == [1 + 2 * turn for turn in range(16)]  # the whole history, every turn
    assert stored_ids(engine, org.id, set(ids)) == set(ids)


def test_retention_setting_and_the_sweep(start_gateway, fake, org, engine):
    from gateway.ledger.responses import sweep_expired
    gw = start_gateway(responses_retention_days=2)
    with sdk(gw, org.key) as c:
        old = c.responses.create(model="fake-model", input="Hi")
        young = c.responses.create(model="fake-model", input="Hi")
    assert stored_ids(engine, org.id, {old.id, young.id}) == {old.id, young.id}
    with engine.begin() as conn:
        spans = conn.execute(sa.text("SELECT expires_at - created_at FROM stored_responses "
                                     "WHERE org_id = :o"), {"o": org.id}).scalars().all()
        assert [s.days for s in spans] == [2, 2]
        conn.execute(sa.text("UPDATE stored_responses SET expires_at = now() - interval '1 "
                             "second' WHERE id = :r"), {"r": old.id})
    with sdk(gw, org.key) as c:  # past its expiry it is gone at once, before any sweep
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(old.id)
        assert sweep_expired(engine) >= 1
        assert stored_ids(engine, org.id) == {young.id}
        assert c.responses.retrieve(young.id).id == young.id


def test_the_runbooks_purge_removes_one_orgs_responses_only(client, fake, org, engine):
    mine = [client.responses.create(model="fake-model", input="Hi").id for _ in range(2)]
    other = make_org(engine, f"keep-{uuid.uuid4().hex[:8]}")
    with sdk_for(client, other) as c:
        theirs = c.responses.create(model="fake-model", input="Hi").id
    assert stored_ids(engine, org.id, set(mine)) == set(mine)
    assert stored_ids(engine, other.id, {theirs}) == {theirs}
    with engine.begin() as conn:  # deploy/RUNBOOK.md, "Stored responses"
        conn.execute(sa.text("DELETE FROM stored_responses WHERE org_id = "
                             "(SELECT id FROM orgs WHERE name = :name)"), {"name": org.name})
    assert stored_ids(engine, org.id) == set() and stored_ids(engine, other.id) == {theirs}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine[0])


def sdk_for(client, org):
    return openai.OpenAI(base_url=str(client.base_url), api_key=org.key, max_retries=0,
                         timeout=30)


def test_stored_content_is_never_logged(gateway, client, fake, org, engine):
    secret_in, secret_out = f"in-{uuid.uuid4().hex}", f"out-{uuid.uuid4().hex}"
    fake.enqueue(json_reply(chat_completion(f"The answer is {secret_out}.")))
    r1 = client.responses.create(model="fake-model", input=f"Remember {secret_in}",
                                 metadata={"topic": secret_in})
    fake.enqueue(sse([chat_chunk(secret_out), chat_chunk(finish_reason="stop")]))
    with client.responses.stream(model="fake-model", input="Again",
                                 previous_response_id=r1.id) as s:
        s.get_final_response()
    client.responses.retrieve(r1.id)
    list(client.responses.input_items.list(r1.id))
    client.responses.delete(r1.id)
    assert secret_in in json.dumps(fake.requests[0].json)  # it did pass through
    log = gateway.log()
    assert "/v1/responses" in log  # the requests were logged, their content never
    assert secret_in not in log and secret_out not in log


# -- the chat relay's stream shapes, through /v1/responses, billed as through chat ----------

def reasoning_usage():
    return {**make_usage(12, 9), "completion_tokens_details": {"reasoning_tokens": 6}}


def call_fragment(index, call_id, name, arguments):
    function = {"arguments": arguments, **({"name": name} if name else {})}
    return chat_chunk(tool_calls=[{"index": index, **({"id": call_id, "type": "function"}
                                                       if call_id else {}),
                                   "function": function}])


SHAPES = {
    "usage-missing": [chat_chunk("Hel", role="assistant"), chat_chunk("lo"),
                      chat_chunk(finish_reason="stop")],
    "usage": [chat_chunk("Hello"), chat_chunk(finish_reason="stop"),
              chat_chunk(choices=False, usage=make_usage(10, 2))],
    "reasoning": [chat_chunk(role="assistant") | {"choices": [{
        "index": 0, "delta": {"reasoning_content": "Think."}, "finish_reason": None}]},
        chat_chunk("Done."), chat_chunk(finish_reason="stop"),
        chat_chunk(choices=False, usage=reasoning_usage())],
    "tool-call-fragments": [
        call_fragment(0, "call_a", "get_weather", ""), call_fragment(1, "call_b", "get_weather",
                                                                     "{\"city\":"),
        call_fragment(0, None, None, "{\"city\": \"Oslo\"}"), call_fragment(1, None, None,
                                                                            "\"Rome\"}"),
        chat_chunk(finish_reason="tool_calls"), chat_chunk(choices=False, usage=make_usage(20, 8))],
    "calls-all-at-index-0": [
        call_fragment(0, "call_a", "get_weather", "{\"city\": \"Oslo\"}"),
        call_fragment(0, "call_b", "get_weather", "{\"city\": \"Rome\"}"),
        chat_chunk(finish_reason="tool_calls")],
}
CHAT_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                   "parameters")}}


def both_ways(gateway, fake, engine, script, **cap):
    """Run ``script`` through chat and through Responses (each in a fresh org): return
    ``(chat event, chat body, responses event, responses events, the responses org)``."""
    chat_org, resp_org = (make_org(engine, f"shape-{uuid.uuid4().hex[:8]}") for _ in "ab")
    fake.enqueue(script)
    chat = requests.post(gateway.base_url + "/v1/chat/completions", headers=chat_org.headers,
                         json={"model": "fake-model", "messages": CHAT_MESSAGES,
                               "tools": [CHAT_TOOL], "stream": True,
                               "stream_options": {"include_usage": True},
                               **({"max_tokens": cap["max"]} if cap else {})}, timeout=30)
    fake.enqueue(script)
    resp = requests.post(gateway.base_url + RESPONSES, headers=resp_org.headers,
                         json={"model": "fake-model", "input": "Say hello", "tools": [TOOL],
                               "stream": True,
                               **({"max_output_tokens": cap["max"]} if cap else {})},
                         timeout=30)
    assert chat.status_code == resp.status_code == 200
    sent = [r.json for r in fake.requests[-2:]]
    assert sent[0]["messages"] == sent[1]["messages"] and sent[0]["tools"] == sent[1]["tools"]
    chat_event = settled_event(engine, chat.headers["X-Neocloud-Generation-Id"])
    resp_event = settled_event(engine, resp.headers["X-Neocloud-Generation-Id"])
    assert (chat_event["endpoint"], resp_event["endpoint"]) == ("chat", "responses")
    for field in ("status", "prompt_tokens", "cached_tokens", "completion_tokens",
                  "cost_nanos", "estimated"):
        assert chat_event[field] == resp_event[field], field
    assert GRANT - balance_nanos(engine, resp_org.id)[0] == resp_event["cost_nanos"]
    assert len(org_events(engine, resp_org.id)) == 1
    return chat_event, chat.content, resp_event, response_events(resp.content), resp_org


@pytest.mark.parametrize("shape", list(SHAPES))
def test_stream_shapes_are_billed_as_through_chat(gateway, fake, engine, shape):
    _, _, event, events, org = both_ways(gateway, fake, engine, sse(SHAPES[shape]))
    last = events[-1]
    assert last["type"] == "response.completed"
    assert [e["type"] for e in events].count("response.completed") == 1
    response = last["response"]
    usage = response["usage"]
    assert Decimal(event["cost_nanos"]) / 10**9 == usage["cost"]
    assert (usage["input_tokens"], usage["output_tokens"]) == \
        (event["prompt_tokens"], event["completion_tokens"])
    assert usage.get("estimated", False) is event["estimated"]
    kinds = [o["type"] for o in response["output"]]
    if shape.startswith("usage"):
        assert kinds == ["message"] and response["output"][0]["content"][0]["text"] == "Hello"
        assert event["estimated"] is (shape == "usage-missing")
    if shape == "reasoning":
        assert kinds == ["reasoning", "message"]
        assert usage["output_tokens_details"] == {"reasoning_tokens": 6}
    if "call" in shape:
        calls = [(o["call_id"], json.loads(o["arguments"])) for o in response["output"]]
        assert calls == [("call_a", {"city": "Oslo"}), ("call_b", {"city": "Rome"})]
    assert stored_ids(engine, org.id, {response["id"]}) == {response["id"]}


MID_STREAM_FAILURE = [Status(200, {"Content-Type": "text/event-stream"}),
                      Send(sse_event(chat_chunk("partial"))), Close()]


def test_mid_stream_failure_fails_the_response_billed_as_through_chat(gateway, fake, engine):
    _, chat_body, event, events, org = both_ways(gateway, fake, engine, MID_STREAM_FAILURE)
    types = [e["type"] for e in events]
    assert types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types and "response.incomplete" not in types
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert b'"error"' in chat_body.split(b"\n\n")[-2]  # chat told it as its error event
    assert event["status"] != "completed"
    assert stored_ids(engine, org.id) == set()  # a failed response is not kept


def test_kilns_budget_cut_is_an_incomplete_response(gateway, fake, engine):
    ignores_cap = sse([chat_chunk("word ") for _ in range(50)] + [chat_chunk(
        finish_reason="stop")])
    _, _, event, events, org = both_ways(gateway, fake, engine, ignores_cap, max=5)
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "response.completed" not in [e["type"] for e in events]
    assert event["completion_tokens"] == 5 == last["response"]["usage"]["output_tokens"]
    assert last["response"]["usage"]["cost"] == Decimal(event["cost_nanos"]) / 10**9


@pytest.mark.parametrize("tokens", [0, 2], ids=["before-first-token", "after-two-tokens"])
def test_client_disconnect_is_cancelled_billed_what_was_relayed_and_not_stored(
        gateway, fake, org, engine, tokens):
    chunks = [chat_chunk(t) for t in ("a", "b")[:tokens]]
    fake.enqueue(sse(chunks, done=False)[:tokens + 1] + [Hang()])
    raw = RawStream(gateway.base_url, org.key, {"model": "fake-model", "input": "Hi",
                                                "stream": True}, path=RESPONSES).read_head()
    raw.read_until(lambda s: s.body.count(b"response.output_text.delta\ndata") == tokens)
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert record.closed_at > closed_at
    event = settled_event(engine, raw.gid)
    assert (event["status"], event["http_status"], event["endpoint"]) == \
        ("client_cancelled", 499, "responses")
    assert event["completion_tokens"] == tokens and event["prompt_tokens"] > 0
    assert event["cost_nanos"] == fake_model_nanos(prompt=event["prompt_tokens"],
                                                   completion=tokens)
    assert GRANT - balance_nanos(engine, org.id)[0] == event["cost_nanos"]
    assert balance_nanos(engine, org.id)[1:] == (0, 0)
    assert stored_ids(engine, org.id) == set()


def test_a_failed_json_answer_is_not_stored(client, fake, org, engine):
    fake.enqueue(error_reply(500, "boom"))
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="fake-model", input="Hi")
    event, = org_events(engine, org.id)
    wait_until(lambda: settled_event(engine, event["id"]))
    assert stored_ids(engine, org.id) == set()
    assert GRANT - balance_nanos(engine, org.id)[0] == 0
