"""End to end through llama.cpp's own server (``llama-server``, the catalog's ``llama.cpp``
family) with SmolLM2-135M: streams that carry the server's usage, its refusal of a prompt over
its context in each dialect's envelope and unbilled, its ``/tokenize`` as Kiln's tokenizer, and
the Anthropic Messages and legacy completions dialects through it, and its tool calls
(docs/RELIABILITY.md, "A second real model server").

The server has one slot of ``LLAMA_SERVER_N_CTX`` (2048) tokens while the catalog says 4096:
a prompt Kiln admits can still be over what the server holds, which is how a server
configured with less context than its catalog entry answers."""
import json
from decimal import Decimal

import anthropic
import openai
import pytest
import requests

from factories import SMOLLM2_NANOS, literal_cost_nanos
from gateway.billing import TEMPLATE_TOKENS_PER_MESSAGE, TEMPLATE_TOKENS_PER_REQUEST
from gateway_proc import Gateway, balance_nanos, make_org, settled_event
from model_server import LLAMA_SERVER_N_CTX
from streams import RawStream, close_raw_streams, org_events

pytestmark = pytest.mark.llama

MODEL = "smollm2-135m"
CATALOG = """
[[models]]
id = "{model}"
context_window = 4096
max_output_tokens = 256
input = ["text"]
endpoints = ["chat", "completions"]
parallel_tool_calls = false
forced_tool_choice = true
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{base}/v1", model = "{model}", server = "llama.cpp", \
tokenize_url = "{base}/tokenize" }}]
"""
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# SmolLM2-135M answers a question in prose even when its prompt lists tools, and "required"
# does not change that: llama-server's grammar for it lets any text that is not the call's
# opening tag come first and only forbids ending without a call, so the model writes prose
# until max_tokens. A system turn that shows a call in the template's format makes it call.
CALLER = "You call functions. Answer every question with a <tool_call> and nothing else."
SHOWN = ('Example:\nuser: Weather in Paris?\nassistant: <tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
CALL_FOR = [{"role": "system", "content": CALLER + "\n" + SHOWN},
            {"role": "user", "content": "Weather in London?"}]
GRANT = 10 * 10**9
# Over the server's 2048-token context and under the catalog's 4096 (one token per word here).
OVER_SERVER_CONTEXT = " ".join(["colour"] * 2500)


@pytest.fixture(scope="module")
def server_gateway(pg_url, llama_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-server") / "models.toml"
    path.write_text(CATALOG.format(model=MODEL, base=llama_server))
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(path)}, workers=2).start()
    yield gw
    gw.stop()


def sdk(gateway, key):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=120)


def server_tokens(llama_server, text):
    """llama-server's own count of ``text`` (``POST /tokenize``, no special tokens added)."""
    resp = requests.post(llama_server + "/tokenize", json={"content": text}, timeout=30)
    resp.raise_for_status()
    return len(resp.json()["tokens"])


def direct_usage(llama_server, **body):
    """The usage llama-server itself reports for ``body`` (non-stream, straight to it)."""
    resp = requests.post(llama_server + "/v1/chat/completions", timeout=120,
                         json={"model": MODEL, "stream": False, **body})
    resp.raise_for_status()
    return resp.json()["usage"]


def assert_billed_once(engine, org, gid, cost, endpoint="chat"):
    """``gid`` is the org's one usage event, completed, priced from its tokens by literal
    arithmetic; ``cost`` (the answer's ``usage.cost``) is its cost and what left the balance."""
    event = settled_event(engine, gid)
    assert [e["id"] for e in org_events(engine, org.id)] == [gid]
    assert event["status"] == "completed" and event["endpoint"] == endpoint
    assert event["cost_nanos"] == literal_cost_nanos(
        SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"],
        event["cached_tokens"]) > 0
    assert Decimal(str(cost)) == Decimal(event["cost_nanos"]) / 10**9
    assert balance_nanos(engine, org.id) == (GRANT - event["cost_nanos"], 0, 0)
    return event


def test_a_stream_carries_the_servers_usage_and_is_billed_by_it(llama_server, server_gateway,
                                                                 engine):
    """llama-server sends usage in streams when asked (Kiln always asks): the event is the
    server's count, not Kiln's estimate, and equals what the server reports for the same
    request without a stream."""
    org = make_org(engine, "ls-stream")
    with sdk(server_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text.strip() and not chunks[-1].choices
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               usage.model_extra["cost"])
    assert event["estimated"] is False
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.prompt_tokens, usage.completion_tokens)
    own = direct_usage(llama_server, messages=ASK, max_tokens=16, temperature=0)
    assert (usage.prompt_tokens, usage.completion_tokens) == \
        (own["prompt_tokens"], own["completion_tokens"])
    assert 0 < usage.completion_tokens <= 16


def test_a_stream_without_include_usage_is_still_billed_by_the_servers_usage(server_gateway,
                                                                             engine):
    org = make_org(engine, "ls-stream-quiet")
    with sdk(server_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=8, temperature=0, stream=True)
        chunks = list(raw.parse())
    assert all(c.usage is None for c in chunks)
    event = settled_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "completed" and event["estimated"] is False
    assert 0 < event["completion_tokens"] <= 8 and event["cost_nanos"] > 0


def assert_refused_unbilled(engine, org):
    events = org_events(engine, org.id)
    assert events and all(e["cost_nanos"] == 0 for e in events)
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_servers_context_is_its_400_in_openais_envelope(
        llama_server, server_gateway, engine, stream):
    """llama-server answers 400 ``exceed_context_size_error`` before it generates anything;
    the client gets a 400 ``upstream_rejected`` quoting it, and nothing is billed."""
    assert server_tokens(llama_server, OVER_SERVER_CONTEXT) > LLAMA_SERVER_N_CTX
    org = make_org(engine, f"ls-context-{stream}")
    with sdk(server_gateway, org.key) as client, pytest.raises(openai.BadRequestError) as err:
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=8, stream=stream,
            messages=[{"role": "user", "content": OVER_SERVER_CONTEXT}])
        list(reply) if stream else None
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "upstream_rejected"
    assert "exceeds the available context size" in body["message"]
    assert_refused_unbilled(engine, org)


def test_a_prompt_over_the_servers_context_is_its_400_in_anthropics_envelope(server_gateway,
                                                                              engine):
    org = make_org(engine, "ls-context-messages")
    with anthropic.Anthropic(base_url=server_gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=120) as client, \
            pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=8,
                               messages=[{"role": "user", "content": OVER_SERVER_CONTEXT}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["code"] == "upstream_rejected"
    assert_refused_unbilled(engine, org)


def test_kilns_token_count_is_the_servers_own(llama_server, server_gateway, engine):
    """``tokenize_url`` is llama-server's ``/tokenize``: the count Kiln makes of a Messages
    request is the server's count of its text plus the template allowance (8 per message, 32
    per request, docs/METERING.md), exactly; its UTF-8 bytes would be far more."""
    text = "Kiln meters every generation of SmolLM2 exactly, in nano-dollars."
    exact = server_tokens(llama_server, text)
    assert 0 < exact < len(text.encode())
    org = make_org(engine, "ls-count")
    with anthropic.Anthropic(base_url=server_gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=120) as client:
        counted = client.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": text}]).input_tokens
    assert counted == exact + TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS_PER_REQUEST
    assert org_events(engine, org.id) == [] and balance_nanos(engine, org.id) == (GRANT, 0, 0)


def direct_pieces(llama_server, body):
    """The text of each delta llama-server itself streams for ``body`` (one token each)."""
    with requests.post(llama_server + "/v1/chat/completions", json=body, stream=True,
                       timeout=300) as resp:
        resp.raise_for_status()
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith(b"data: {")]
    return [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]


def test_a_stream_its_client_left_is_billed_the_servers_count_of_what_was_relayed(
        llama_server, server_gateway, engine):
    """A client that leaves mid-stream: no usage ever comes, and Kiln bills its own count of
    the text it relayed (the server's ``/tokenize``), flagged ``estimated``: the server's own
    count of a prefix of the stream it generates (greedy: the same deltas as straight to it).
    Which prefix depends on when Kiln saw the client leave; that the count is the tokenizer's
    and not the bytes' is shown exactly by the count_tokens test above."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 256, "temperature": 0, "stream": True}
    pieces = direct_pieces(llama_server, body)
    org = make_org(engine, "ls-left")
    try:
        stream = RawStream(server_gateway.base_url, org.key, body)
        stream.read_until(lambda s: s.body.count(b'"content"') >= 4, timeout_s=120)
        stream.close()
    finally:
        close_raw_streams()
    event = settled_event(engine, stream.gid)
    assert event["estimated"] is True and event["completion_tokens"] < 256
    counts = [server_tokens(llama_server, "".join(pieces[:j])) for j in range(len(pieces) + 1)]
    assert event["completion_tokens"] in counts
    assert event["cost_nanos"] == literal_cost_nanos(
        SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"], 0)
    assert balance_nanos(engine, org.id) == (GRANT - event["cost_nanos"], 0, 0)


def test_messages_stream_through_llama_server_is_billed_by_its_usage(llama_server,
                                                                     server_gateway, engine):
    """The Anthropic Messages dialect end to end: the event stream's usage is the server's."""
    org = make_org(engine, "ls-messages")
    with anthropic.Anthropic(base_url=server_gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=120) as client:
        with client.messages.stream(model=MODEL, max_tokens=16, messages=ASK,
                                    extra_body={"temperature": 0}) as stream:
            usage = None
            for event in stream:
                if event.type == "message_delta":
                    usage = event.usage
            final = stream.get_final_message()
            gid = stream.response.headers["X-Neocloud-Generation-Id"]
    assert final.content[0].text.strip()
    assert not usage.model_extra.get("estimated")
    event = assert_billed_once(engine, org, gid, usage.model_extra["cost"], endpoint="messages")
    assert event["estimated"] is False
    # The server reuses its KV cache: the prefix it reused is Anthropic's cache read, outside
    # ``input_tokens``, and billed at the cached-input price.
    cached = usage.cache_read_input_tokens or 0
    assert cached == event["cached_tokens"]
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.input_tokens + cached, usage.output_tokens)
    own = direct_usage(llama_server, messages=ASK, max_tokens=16, temperature=0)
    assert usage.output_tokens == own["completion_tokens"]


def test_legacy_completions_through_llama_server_are_billed_by_its_usage(server_gateway,
                                                                         engine):
    org = make_org(engine, "ls-completions")
    with sdk(server_gateway, org.key) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="The three primary colours are", max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(raw.parse())
    text = "".join(c.text for ch in chunks for c in ch.choices)
    usage = next(ch.usage for ch in reversed(chunks) if ch.usage)
    assert text.strip()
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               usage.model_extra["cost"], endpoint="completions")
    assert event["estimated"] is False
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.prompt_tokens, usage.completion_tokens)
    assert 0 < usage.completion_tokens <= 8


def assert_one_call(calls, name="get_weather"):
    """``calls`` is one well-formed OpenAI function call of ``name``: an id, type function,
    arguments a JSON object as a string, with the one required argument."""
    assert len(calls) == 1
    call = calls[0]
    assert isinstance(call["id"], str) and call["id"]
    assert call["type"] == "function" and call["function"]["name"] == name
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    return arguments


@pytest.mark.parametrize("tool_choice", ["auto", "required",
                                         {"type": "function", "function": {"name": "get_time"}}],
                         ids=["auto", "required", "named"])
def test_a_tool_call_through_kiln_is_the_servers_and_is_billed_by_its_usage(
        llama_server, server_gateway, engine, tool_choice):
    """llama-server parses the model's ``<tool_call>`` into OpenAI's ``tool_calls`` with
    ``finish_reason: "tool_calls"``; Kiln relays it and bills the server's usage, the same as
    the server reports for the same request straight to it. A named choice reaches the server
    as "required" with that function alone (it reads no named choice), so the call is the named
    function's even though the prompt shows the other one. The model goes on calling after its
    first call and the server's grammar for this template allows that whatever
    ``parallel_tool_calls`` says, so the catalog says it does not honour the flag and Kiln keeps
    the first call."""
    name = "get_time" if isinstance(tool_choice, dict) else "get_weather"
    org = make_org(engine, f"ls-tools-{tool_choice if isinstance(tool_choice, str) else 'named'}")
    with sdk(server_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CALL_FOR, tools=[WEATHER, TIME], tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=64, temperature=0)
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert_one_call([c.model_dump() for c in choice.message.tool_calls], name)
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               reply.usage.model_extra["cost"])
    assert event["estimated"] is False
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    sent = {"tools": [TIME], "tool_choice": "required"} if name == "get_time" else \
        {"tools": [WEATHER, TIME], "tool_choice": tool_choice}
    own = direct_usage(llama_server, messages=CALL_FOR, max_tokens=64, temperature=0, **sent)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == \
        (own["prompt_tokens"], own["completion_tokens"])


def test_a_streamed_tool_call_through_kiln_is_whole_and_billed_by_the_servers_usage(
        llama_server, server_gateway, engine):
    """The stream's ``tool_calls`` deltas join into one call (id and name first, then the
    arguments in pieces), the last choice chunk says ``tool_calls``, and the usage chunk is the
    server's, which the event is; ``parallel_tool_calls: false`` is Kiln's to keep (the first
    call only)."""
    org = make_org(engine, "ls-tools-stream")
    with sdk(server_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CALL_FOR, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
    calls = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "type": None, "function": {
                    "name": "", "arguments": ""}})
                call["id"] = call["id"] or delta.id
                call["type"] = call["type"] or delta.type
                if delta.function:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finishes == ["tool_calls"]
    assert_one_call(list(calls.values()))
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens > 0
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               usage.model_extra["cost"])
    assert event["estimated"] is False
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.prompt_tokens, usage.completion_tokens)
    own = direct_usage(llama_server, messages=CALL_FOR, tools=[WEATHER], tool_choice="required",
                       max_tokens=64, temperature=0)
    assert (usage.prompt_tokens, usage.completion_tokens) == \
        (own["prompt_tokens"], own["completion_tokens"])


def test_a_tool_use_through_the_messages_endpoint_is_the_servers_call(server_gateway, engine):
    """Anthropic's Messages end to end: the server's tool call is a ``tool_use`` block (its id,
    the tool's name, the arguments as ``input``) with ``stop_reason: "tool_use"``, billed by the
    server's usage; ``{"type": "any"}`` is sent as "required"."""
    org = make_org(engine, "ls-tools-messages")
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    with anthropic.Anthropic(base_url=server_gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=120) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, system=CALL_FOR[0]["content"], messages=CALL_FOR[1:],
            tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0})
    message = raw.parse()
    assert message.stop_reason == "tool_use"
    use, = [b for b in message.content if b.type == "tool_use"]
    assert use.id and use.name == "get_weather" and isinstance(use.input["city"], str)
    usage = message.usage
    event = assert_billed_once(engine, org, raw.headers["X-Neocloud-Generation-Id"],
                               usage.model_extra["cost"], endpoint="messages")
    assert event["estimated"] is False
    cached = usage.cache_read_input_tokens or 0
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage.input_tokens + cached, usage.output_tokens)
