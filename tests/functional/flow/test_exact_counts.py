"""Kiln's own counts are exact when a tokenizer is there (docs/METERING.md, "Which count
applies"): a stream with no usage is billed the tokenizer's count, by the model's local
tokenizer or by the backend's tokenize route, never the bound; a tokenize call that fails is
logged and counted before the bound is billed; each usage event says which count it bills."""
import pytest
import requests
from tokenizers import Tokenizer, models, pre_tokenizers

from factories import CATALOG, MESSAGES
from fake_upstream import TOKENIZE_PATH, chat_chunk, error_reply, fake_token_count, sse
from gateway_proc import Gateway, gateway_env, metric, usage_event

# Ten deltas of two words: the fake's tokenizer and the local one count 20 tokens; Kiln's
# floor is 10 (one per delta) and the bound 110 (the bytes): each count shows which it is.
DELTAS = ["alpha beta "] * 10
TEXT = "".join(DELTAS)
# The prompt is always a bound: the tokenizer's count of "Say hello" (2) plus the template
# allowance, 8 per message and 32 per request.
PROMPT = 2 + 8 + 32


@pytest.fixture(scope="module")
def counting_gateway(pg_url, fake_upstream, tmp_path_factory):
    """A gateway whose catalog adds two models on the fake: ``fake-counted`` (its backend's
    tokenize route) and ``fake-local`` (a local tokenizer.json, one token per word)."""
    folder = tmp_path_factory.mktemp("exact-counts")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "alpha": 1, "beta": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(folder / "tokenizer.json"))
    root = fake_upstream.base_url.removesuffix("/v1")
    extra = f'''
[[models]]
id = "fake-counted"
context_window = 8192
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{fake_upstream.base_url}", model = "upstream-fake",
              tokenize_url = "{root}{TOKENIZE_PATH}" }}]

[[models]]
id = "fake-local"
context_window = 8192
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
tokenizer = "tokenizer.json"
backends = [{{ url = "{fake_upstream.base_url}", model = "upstream-fake" }}]
'''
    path = folder / "models.toml"
    path.write_text(CATALOG.format(url=fake_upstream.base_url) + extra.replace("\n   ", " "))
    gw = Gateway(gateway_env(pg_url, path), workers=1).start()
    yield gw
    gw.stop()


def stream(gateway, org, model):
    """Stream ``model``'s answer (the fake's next script); return its usage event, settled."""
    r = requests.post(gateway.base_url + "/v1/chat/completions", timeout=30, headers=org.headers,
                      json={"model": model, "messages": MESSAGES, "stream": True,
                            "max_tokens": 500})
    assert r.status_code == 200 and "data: [DONE]" in r.text
    return r.headers["X-Neocloud-Generation-Id"]


def no_usage_stream():
    return sse([chat_chunk(d) for d in DELTAS] + [chat_chunk(finish_reason="stop")])


def tokenize_calls(fake):
    return [r for r in fake.requests if r.path == TOKENIZE_PATH]


def test_the_backends_tokenize_route_is_billed_not_the_bound(counting_gateway, fake, org,
                                                             engine):
    fake.enqueue(no_usage_stream())
    event = usage_event(engine, stream(counting_gateway, org, "fake-counted"))
    assert fake_token_count(TEXT) == 20
    assert event["completion_tokens"] == 20 and event["completion_counted_by"] == "tokenizer"
    assert event["prompt_tokens"] == PROMPT and event["prompt_counted_by"] == "bound"
    assert [r.json["input"] for r in tokenize_calls(fake)] == ["Say hello", TEXT]


def test_a_local_tokenizer_counts_without_asking_anyone(counting_gateway, fake, org, engine):
    fake.enqueue(no_usage_stream())
    gid = stream(counting_gateway, org, "fake-local")
    event = usage_event(engine, gid)
    assert event["completion_tokens"] == 20 and event["completion_counted_by"] == "tokenizer"
    assert event["prompt_tokens"] == PROMPT and event["prompt_counted_by"] == "bound"
    assert tokenize_calls(fake) == []
    shown = requests.get(counting_gateway.base_url + "/v1/generation", params={"id": gid},
                         headers=org.headers, timeout=30).json()
    assert (shown["prompt_counted_by"], shown["completion_counted_by"]) == ("bound", "tokenizer")


def test_a_failed_tokenize_call_is_logged_and_counted_then_the_bound_billed(
        counting_gateway, fake, org, engine):
    before = metric(counting_gateway.base_url, "kiln_tokenize_failures_total",
                    model="fake-counted", reason="http_500") or 0
    for _ in range(2):  # the prompt's count, then the completion's
        fake.enqueue(error_reply(500, "tokenizer down"), path=TOKENIZE_PATH)
    fake.enqueue(no_usage_stream())
    gid = stream(counting_gateway, org, "fake-counted")
    event = usage_event(engine, gid)
    assert event["completion_tokens"] == len(TEXT.encode()) == 110  # the bytes: the bound
    assert event["completion_counted_by"] == "bound" and event["prompt_counted_by"] == "bound"
    assert event["prompt_tokens"] == len("Say hello") + 8 + 32
    assert metric(counting_gateway.base_url, "kiln_tokenize_failures_total",
                  model="fake-counted", reason="http_500") == before + 2
    logged = counting_gateway.log_events(event="tokenize_failed", model="fake-counted")
    assert len(logged) >= 2 and logged[-1]["reason"] == "http_500"


def test_a_backends_usage_is_billed_as_the_backends(counting_gateway, fake, org, engine):
    r = requests.post(counting_gateway.base_url + "/v1/chat/completions", timeout=30,
                      headers=org.headers, json={"model": "fake-local", "messages": MESSAGES})
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["prompt_tokens"], event["completion_tokens"]) == (10, 5)  # the fake's usage
    assert event["prompt_counted_by"] == event["completion_counted_by"] == "backend"
