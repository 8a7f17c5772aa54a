"""End to end: the official openai SDK, through Kiln (gunicorn, gevent workers), to the real
llama.cpp server with SmolLM2-135M. The usage event, the header, ``usage.cost`` and the
balance change agree exactly; the SQLite smoke path of ``make run`` works too."""
import json
import subprocess
import sys
from decimal import Decimal

import openai
import pytest
import sqlalchemy as sa

from factories import SMOLLM2_NANOS, literal_cost_nanos
from gateway_proc import (ROOT, Gateway, balance_nanos, make_org, settled_event,
                          usage_event)
from model_server import gguf_path

pytestmark = pytest.mark.llama

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def llama_catalog(llama, tmp_path_factory):
    """The demo catalog as ``make run`` writes it: on this module's server, with its GGUF file
    as the model's local tokenizer."""
    text = (ROOT / "gateway" / "demo_models.toml").read_text().replace(
        "http://127.0.0.1:8081", llama).replace(
        'id = "smollm2-135m"\n', f'id = "smollm2-135m"\ntokenizer = {json.dumps(gguf_path())}\n')
    path = tmp_path_factory.mktemp("llama") / "models.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def llama_gateway(pg_url, llama_catalog):
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(llama_catalog)},
                 workers=2).start()
    yield gw
    gw.stop()


def expected_nanos(event):
    """The event's tokens at the demo catalog's prices, by literal arithmetic."""
    return literal_cost_nanos(SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"],
                              event["cached_tokens"])


def sdk(gateway, key):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=120)


def test_non_stream_answer_is_billed_exactly(llama_gateway, llama_catalog, engine):
    org = make_org(engine, "e2e-json")
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=MESSAGES, max_tokens=24, temperature=0)
    resp = raw.parse()
    assert resp.choices[0].message.content.strip()
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "completed" and not event["estimated"]
    assert event["prompt_tokens"] == resp.usage.prompt_tokens > 0
    assert event["completion_tokens"] == resp.usage.completion_tokens > 0
    assert event["cost_nanos"] == expected_nanos(event)
    assert Decimal(str(resp.usage.model_extra["cost"])) == Decimal(event["cost_nanos"]) / 10**9
    after = balance_nanos(engine, org.id)
    assert before[0] - after[0] == event["cost_nanos"] and after[1:] == (0, 0)


def tokens(llama, text):
    """The model's own count of ``text`` (llama.cpp's tokenize endpoint)."""
    import requests
    resp = requests.post(llama + "/extras/tokenize/count", json={"input": text}, timeout=30)
    return resp.json()["count"]


def test_stream_answer_is_metered_by_kiln_and_billed_exactly(llama, llama_gateway, llama_catalog,
                                                             engine):
    # llama.cpp's server sends no usage chunk even when asked: Kiln meters the stream itself.
    org = make_org(engine, "e2e-stream")
    before = balance_nanos(engine, org.id)
    with sdk(llama_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=MESSAGES, max_tokens=24, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    usage = chunks[-1].usage
    gid = raw.headers["X-Neocloud-Generation-Id"]
    event = settled_event(engine, gid)
    assert event["status"] == "completed" and event["estimated"] is True
    assert event["completion_tokens"] == usage.completion_tokens > 0
    assert event["prompt_tokens"] == usage.prompt_tokens > 0
    # Kiln's count of the relayed text is exact: its local tokenizer (the GGUF's vocabulary)
    # counts it as the model server itself does, busy or not; never the bytes.
    assert event["completion_tokens"] == tokens(llama, text) <= 24
    assert event["completion_counted_by"] == "tokenizer" and event["prompt_counted_by"] == "bound"
    # The prompt, counted by Kiln too, is never below what the model itself counts for it.
    with sdk(llama_gateway, make_org(engine, "e2e-stream-prompt").key) as client:
        model_prompt = client.chat.completions.create(
            model="smollm2-135m", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert event["prompt_tokens"] >= model_prompt > 0
    assert event["cost_nanos"] == expected_nanos(event)
    assert Decimal(str(usage.model_extra["cost"])) == Decimal(event["cost_nanos"]) / 10**9
    assert before[0] - balance_nanos(engine, org.id)[0] == event["cost_nanos"]


STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.mark.parametrize("lengths", [{"max_tokens": 1, "max_completion_tokens": 500},
                                     {"max_completion_tokens": 1, "max_tokens": 500},
                                     {"max_tokens": 1, "n_predict": 400}])
@pytest.mark.parametrize("stream", [False, True])
def test_the_model_generates_no_more_than_the_cap_kiln_held_for(
        llama, llama_gateway, engine, lengths, stream):
    """Whatever length fields a client mixes, the backend is sent the smallest and the bill is
    what it generated: one token here (0.10 / 0.30 USD per million tokens)."""
    org = make_org(engine, f"e2e-cap-{stream}-{'-'.join(lengths)}")
    extra = {k: v for k, v in lengths.items() if k == "n_predict"}
    standard = {k: v for k, v in lengths.items() if k != "n_predict"}
    with sdk(llama_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=STORY, stream=stream, temperature=0,
            extra_body=extra, **standard,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        reply = raw.parse()
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            text, usage = reply.choices[0].message.content or "", reply.usage
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == usage.completion_tokens == 1
    assert tokens(llama, text) <= 1
    cost = Decimal(event["prompt_tokens"]) * Decimal("0.10") / 10**6 + Decimal("0.30") / 10**6
    assert Decimal(event["cost_nanos"]) / 10**9 == cost == Decimal(str(usage.model_extra["cost"]))
    assert 10 * 10**9 - balance_nanos(engine, org.id)[0] == event["cost_nanos"]


def test_min_tokens_above_the_cap_is_refused_and_nothing_is_billed(llama_gateway, engine):
    org = make_org(engine, "e2e-min-tokens")
    with sdk(llama_gateway, org.key) as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2-135m", messages=STORY,
                                       max_completion_tokens=1, extra_body={"min_tokens": 600})
    assert err.value.body["param"] == "min_tokens"
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_a_developer_message_reaches_the_model_as_system(llama_gateway, engine):
    org = make_org(engine, "e2e-developer")
    with sdk(llama_gateway, org.key) as client:
        resp = client.chat.completions.create(
            model="smollm2-135m", max_tokens=8,
            messages=[{"role": "developer", "content": "Answer in one word."}, *MESSAGES])
    assert resp.choices[0].message.content.strip()


def test_the_tool_calling_loop_reaches_the_model(llama_gateway, engine):
    """The SDK's own tool-call turn goes back as history (content null, then the tool's
    answer), as every agent loop sends it: the model answers, and it is billed once."""
    org = make_org(engine, "e2e-tool-loop")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}
    with sdk(llama_gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m", max_tokens=8, messages=[
                *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}])
    assert raw.parse().choices[0].message.content is not None
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "completed" and event["cost_nanos"] > 0


def test_make_run_smoke_path_on_sqlite(llama_catalog, tmp_path):
    """The embedded default: SQLite file, `kiln` CLI as `make run` uses it, a real answer."""
    url = f"sqlite:///{tmp_path}/kiln.db"
    env = {"KILN_DATABASE_URL": url, "KILN_MODELS": str(llama_catalog)}
    kiln = [sys.executable, "-m", "gateway.ops.cli"]

    def run(*args):
        return subprocess.run(kiln + list(args), env={**_env(), **env}, check=True,
                              capture_output=True, text=True).stdout
    run("db", "upgrade")
    run("org", "create", "demo")
    run("credits", "grant", "demo", "5.00")
    key = run("key", "create", "demo").strip().splitlines()[-1]
    gw = Gateway(env, workers=2).start()
    try:
        with sdk(gw, key) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2-135m", messages=MESSAGES, max_tokens=16)
        cost = Decimal(str(raw.parse().usage.model_extra["cost"]))
        gid = raw.headers["X-Neocloud-Generation-Id"]
    finally:
        gw.stop()
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        row = conn.execute(sa.text("SELECT cost_nanos, status FROM usage_events WHERE id = :g"),
                           {"g": gid}).first()
        balance = conn.execute(sa.text("SELECT balance_nanos FROM credit_balances")).scalar_one()
    eng.dispose()
    assert row.status == "completed" and Decimal(row.cost_nanos) / 10**9 == cost > 0
    assert balance == 5 * 10**9 - row.cost_nanos
    assert "balance_usd=" in run("credits", "show", "demo")


def _env():
    import os
    return dict(os.environ)
