"""``POST /v1/completions`` and ``POST /v1/embeddings`` through gunicorn with the scripted fake
upstream: each relay shape chat has (usage missing, the cap ignored, a mid-stream failure, a
client that leaves), embeddings' usage missing or malformed, too few vectors, a huge reply; one
usage event per request with its endpoint, billed what the client was told."""
import base64
import json
import socket
import struct
from decimal import Decimal

import openai
import pytest
import requests

from factories import FAKE_EMBED_NANOS, fake_model_nanos, literal_cost_nanos
from fake_upstream import (COMPLETIONS_PATH, EMBEDDINGS_PATH, Close, Send, Sleep, Status,
                           embeddings_list, json_reply, make_usage, sse, text_chunk,
                           text_completion)
from gateway_proc import balance_nanos, metric, usage_event, wait_until


def post(gateway, org, path, **body):
    return requests.post(gateway.base_url + path, json=body, headers=org.headers, timeout=30)


def chunks_of(text):
    return [json.loads(line[6:]) for line in text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def cost_of(body_usage):
    return Decimal(str(body_usage["cost"]))


# -- completions ---------------------------------------------------------------------------

def test_completion_is_sent_to_the_backends_completions_with_kilns_body(gateway, fake, org,
                                                                        engine):
    fake.enqueue(json_reply(text_completion(" Paris.", make_usage(6, 3))), COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="The capital is",
             max_tokens=7, suffix="!", echo=False, logprobs=2, user="u1", temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " Paris."
    sent = json.loads(fake.requests[-1].body)
    assert fake.requests[-1].path == COMPLETIONS_PATH
    assert sent == {"model": "upstream-fake", "prompt": "The capital is", "suffix": "!",
                    "echo": False, "logprobs": 2, "temperature": 0, "max_tokens": 7,
                    "stream": False}
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["endpoint"] == "completions" and event["status"] == "completed"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (6, 3)
    assert event["cost_nanos"] == fake_model_nanos(6, 3) == cost_of(body["usage"]) * 10 ** 9


def test_completion_stream_without_usage_is_metered_by_kiln(gateway, fake, org, engine):
    fake.enqueue(sse([text_chunk("Hello"), text_chunk(" world"),
                      text_chunk(finish_reason="stop")]), COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="Say", stream=True,
             max_tokens=20, stream_options={"include_usage": True})
    chunks = chunks_of(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["object"] == "text_completion" and usage["estimated"] is True
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["estimated"] and event["endpoint"] == "completions"
    assert event["completion_tokens"] == usage["completion_tokens"] >= 2
    assert event["prompt_tokens"] == usage["prompt_tokens"] >= 1
    assert event["cost_nanos"] == cost_of(usage) * 10 ** 9
    assert json.loads(fake.requests[-1].body)["stream_options"] == {"include_usage": True}


def test_a_completions_backend_that_ignores_max_tokens_is_cut_at_the_cap(gateway, fake, org,
                                                                         engine):
    fake.enqueue(sse([text_chunk("tok ") for _ in range(40)]
                     + [text_chunk(finish_reason="length")], delay_s=0.01), COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="x", stream=True,
             max_tokens=4, stream_options={"include_usage": True})
    chunks = chunks_of(r.text)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert [t for t in texts if t] == ["tok "] * 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and r.text.endswith("[DONE]\n\n")
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == 4 and event["anomaly"] is True


def test_kilns_stop_strings_cut_completion_text(gateway, fake, org):
    fake.enqueue(json_reply(text_completion("one two END three", make_usage(2, 4))),
                 COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="x", stop=["END"])
    assert r.json()["choices"][0] == {"index": 0, "text": "one two ", "logprobs": None,
                                      "finish_reason": "stop"}


def test_echoed_prompt_is_not_metered_as_generated(gateway, fake, org, engine):
    prompt = "A long prompt that the backend echoes back " * 4
    fake.enqueue(sse([text_chunk(prompt), text_chunk(" yes"), text_chunk(finish_reason="stop")]),
                 COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt=prompt, echo=True,
             stream=True, max_tokens=2, stream_options={"include_usage": True})
    chunks = chunks_of(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + " yes"
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    # " yes" is 4 bytes: one token at least, at most its bytes; never the echoed prompt's
    assert 1 <= event["completion_tokens"] <= 4 and event["anomaly"] is False


def test_completion_mid_stream_failure_ends_with_an_error_event(gateway, fake, org, engine):
    head = {"Content-Type": "text/event-stream"}
    fake.enqueue([Status(200, head), Send(b'data: {"id":"c","object":"text_completion",'
                                          b'"choices":[{"index":0,"text":"partial"}]}\n\n'),
                  Sleep(0.05), Close()], COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="x", stream=True,
             max_tokens=10)
    events = chunks_of(r.text)
    assert events[0]["choices"][0]["text"] == "partial" and "error" in events[-1]
    assert "[DONE]" not in r.text
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["status"] != "completed" and event["completion_tokens"] >= 1


def test_completion_client_disconnect_is_settled_as_cancelled(gateway, fake, org, engine):
    fake.enqueue(sse([text_chunk("tok ") for _ in range(200)], delay_s=0.05), COMPLETIONS_PATH)
    body = json.dumps({"model": "fake-model", "prompt": "x", "stream": True,
                       "max_tokens": 500}).encode()
    host, port = gateway.base_url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer " + org.key.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while b"tok" not in head:
            head += sock.recv(4096)
    gid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-neocloud-generation-id"))
    event = usage_event(engine, gid)
    assert event["status"] == "client_cancelled" and event["endpoint"] == "completions"
    record = fake.wait_for(lambda rs: rs[-1].closed_at is not None and rs[-1])
    assert not record.completed


def test_completions_contract_refusals_charge_nothing(gateway, fake, org, engine):
    before = balance_nanos(engine, org.id)
    cases = [({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
             ({"prompt": "x", "logprobs": 6}, "logprobs"),
             ({"prompt": "x", "messages": []}, "messages"),
             ({"prompt": [], "max_tokens": 1}, "prompt"),
             ({"prompt": [[1, -2]]}, "prompt[0]"),
             ({"prompt": "x", "best_of": 2, "n": 3}, "best_of"),
             ({"prompt": "x", "best_of": 21}, "best_of"),
             ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
             ({"prompt": list(range(9000))}, "prompt")]
    for body, param in cases:
        r = post(gateway, org, "/v1/completions", model="fake-model", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(gateway, org, "/v1/completions", model="fake-vision", prompt="x")
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "This is a chat model and not supported in the v1/completions endpoint. "
                   "Did you mean to use v1/chat/completions?",
        "type": "invalid_request_error", "param": "model", "code": "unsupported_endpoint"}
    assert not [rec for rec in fake.requests if rec.path == COMPLETIONS_PATH]
    assert balance_nanos(engine, org.id) == before


def test_best_of_is_held_for_in_the_worst_case(gateway, fake, org, engine):
    fake.enqueue(json_reply(text_completion("x", make_usage(1, 30))), COMPLETIONS_PATH)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt="x", max_tokens=10,
             best_of=3)
    assert r.status_code == 200
    assert json.loads(fake.requests[-1].body)["best_of"] == 3
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    # 30 completion tokens (three candidates of 10) are within the hold: no anomaly
    assert event["completion_tokens"] == 30 and event["anomaly"] is False


# -- embeddings ----------------------------------------------------------------------------

def test_embeddings_with_the_backends_usage(gateway, fake, org, engine):
    fake.enqueue(json_reply(embeddings_list(2, usage={"prompt_tokens": 7, "total_tokens": 7})),
                 EMBEDDINGS_PATH)
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0) as client:
        raw = client.embeddings.with_raw_response.create(model="fake-embed",
                                                         input=["a", "b"])
    resp = raw.parse()
    assert [d.embedding for d in resp.data] == [[0.5] * 4, [1.5] * 4]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == 7 and resp.model == "fake-embed"
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["endpoint"] == "embeddings" and not event["estimated"]
    assert (event["prompt_tokens"], event["completion_tokens"]) == (7, 0)
    assert event["cost_nanos"] == literal_cost_nanos(FAKE_EMBED_NANOS, 7) == 140
    assert Decimal(str(resp.usage.model_extra["cost"])) == Decimal(140) / 10 ** 9
    sent = json.loads(fake.requests[-1].body)
    assert sent == {"model": "upstream-embed", "input": ["a", "b"], "encoding_format": "base64"}


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": "7"}, {"prompt_tokens": -1},
                                   {"prompt_tokens": 3, "total_tokens": 9}])
def test_embeddings_missing_or_malformed_usage_is_kilns_count(gateway, fake, org, engine, usage):
    fake.enqueue(json_reply(embeddings_list(1, usage=usage)), EMBEDDINGS_PATH)
    r = post(gateway, org, "/v1/embeddings", model="fake-embed", input="hello there",
             encoding_format="float")
    body = r.json()
    assert body["usage"]["estimated"] is True
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    # no tokenizer: the input's 11 bytes plus its two special tokens, upward of any tokenizer
    assert event["prompt_tokens"] == body["usage"]["prompt_tokens"] == 13
    assert event["estimated"] and event["cost_nanos"] == 13 * 20


def test_embeddings_base64_is_encoded_by_kiln_when_the_backend_sends_floats(gateway, fake, org):
    fake.enqueue(json_reply(embeddings_list(1, dims=3, usage=make_usage(2, 0))),
                 EMBEDDINGS_PATH)
    r = post(gateway, org, "/v1/embeddings", model="fake-embed", input=[[1, 2]],
             encoding_format="base64")
    vector = r.json()["data"][0]["embedding"]
    assert struct.unpack("<3f", base64.b64decode(vector)) == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("reply", [embeddings_list(1), {"object": "list", "data": "no"},
                                   embeddings_list(3)])
def test_embeddings_with_the_wrong_number_of_vectors_fail_unbilled(gateway, fake, org, engine,
                                                                  reply):
    before = balance_nanos(engine, org.id)
    fake.enqueue(json_reply({**reply, "usage": {"prompt_tokens": 4, "total_tokens": 4}}),
                 EMBEDDINGS_PATH)
    r = post(gateway, org, "/v1/embeddings", model="fake-embed", input=["a", "b"])
    assert r.status_code == 502
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["cost_nanos"] == 0 and event["status"] != "completed"
    assert balance_nanos(engine, org.id) == before


def test_a_huge_embeddings_reply_is_refused_and_billed_its_inputs(start_gateway, fake, org,
                                                                   engine):
    """docs/METERING.md: the backend embedded the inputs; the vectors were too large to
    relay (502 ``upstream_too_large``), and the inputs are billed at Kiln's estimate."""
    gw = start_gateway(max_reply_bytes=4096)
    fake.enqueue(json_reply(embeddings_list(2, dims=2000)), EMBEDDINGS_PATH)
    before = balance_nanos(engine, org.id)
    r = post(gw, org, "/v1/embeddings", model="fake-embed", input=["a", "b"])
    assert r.status_code == 502 and "larger than 4096 bytes" in r.json()["error"]["message"]
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["error_code"] == "upstream_too_large" and event["completion_tokens"] == 0
    assert event["prompt_tokens"] > 0 and event["cost_nanos"] > 0
    wait_until(lambda: balance_nanos(engine, org.id)[0] == before[0] - event["cost_nanos"])


def test_a_completions_answer_larger_than_the_model_allows_is_refused(gateway, fake, org,
                                                                      engine):
    """docs/RELIABILITY.md, "Big answers": max_tokens × best_of × prompts × (1 + logprobs)
    above the model's max_reply_tokens is a 400 before admission, nothing sent or billed."""
    before = balance_nanos(engine, org.id)
    r = post(gateway, org, "/v1/completions", model="fake-model", prompt=["a"] * 10, n=128,
             max_tokens=1024, logprobs=5)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "logprobs")
    assert "1024 × 128 × 10 × 6" in error["message"]
    assert not [rec for rec in fake.requests if rec.path == COMPLETIONS_PATH]
    assert balance_nanos(engine, org.id) == before


def test_embeddings_refusals(gateway, fake, org):
    cases = [({"input": "x", "stream": True}, "stream"),
             ({"input": ["x"] * 9}, "input"),
             ({"input": ""}, "input"),
             ({"input": "x", "dimensions": 8}, "dimensions"),
             ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
             ({"input": [list(range(600))]}, "input[0]")]
    for body, param in cases:
        r = post(gateway, org, "/v1/embeddings", model="fake-embed", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(gateway, org, "/v1/chat/completions", model="fake-embed",
             messages=[{"role": "user", "content": "x"}])
    assert r.json()["error"]["message"] == (
        "This is not a chat model and thus not supported in the v1/chat/completions endpoint. "
        "Did you mean to use v1/embeddings?")
    assert not [rec for rec in fake.requests if rec.path == EMBEDDINGS_PATH]


def test_models_and_metrics_tell_the_endpoints(gateway, fake, org):
    models = {m["id"]: m for m in requests.get(gateway.base_url + "/v1/models",
                                               headers=org.headers, timeout=10).json()["data"]}
    assert models["fake-model"]["endpoints"] == ["chat", "completions"]
    assert models["fake-vision"]["endpoints"] == ["chat"]
    assert models["fake-embed"]["endpoints"] == ["embeddings"]
    assert models["fake-embed"]["pricing"]["output"] == "0"
    fake.enqueue(json_reply(embeddings_list(1, usage=make_usage(3, 0))), EMBEDDINGS_PATH)
    before = metric(gateway.base_url, "kiln_endpoint_requests_total", endpoint="embeddings",
                    model="fake-embed", status="completed") or 0
    assert post(gateway, org, "/v1/embeddings", model="fake-embed", input="x").status_code == 200
    after = metric(gateway.base_url, "kiln_endpoint_requests_total", endpoint="embeddings",
                   model="fake-embed", status="completed")
    assert after == before + 1
