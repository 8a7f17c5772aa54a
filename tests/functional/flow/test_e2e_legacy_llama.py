"""End to end: the official openai SDK's ``completions.create`` and ``embeddings.create``
through Kiln to real llama.cpp servers (llama-cpp-python with SmolLM2-135M; a second one with
``--embedding true``): each answer is billed exactly the usage the client saw."""
import sys
import uuid
import tempfile
from decimal import Decimal
from pathlib import Path

import openai
import pytest

from factories import SMOLLM2_NANOS, literal_cost_nanos
from gateway_proc import Gateway, balance_nanos, free_port, make_org, settled_event
from model_server import start_model_server, stop, wait_ready

pytestmark = pytest.mark.llama

CATALOG = """
[[models]]
id = "smollm2-135m"
context_window = 4096
max_output_tokens = 64
endpoints = ["chat", "completions"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{chat}/v1", model = "smollm2-135m", server = "llama-cpp-python", \
tokenize_url = "{chat}/extras/tokenize/count" }}]

[[models]]
id = "smollm2-embed"
context_window = 4096
endpoints = ["embeddings"]
pricing = {{ input = "0.10" }}
backends = [{{ url = "{embed}/v1", model = "smollm2-135m", server = "llama-cpp-python" }}]
"""


def _server(*extra):
    port = free_port()
    proc = start_model_server(sys.executable, port, Path(tempfile.mkdtemp()) / "llama.log",
                              extra_args=extra)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=180, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def legacy_gateway(pg_url, tmp_path_factory):
    chat_proc, chat = _server()
    embed_proc, embed = None, None
    try:
        embed_proc, embed = _server("--embedding", "true")
        path = tmp_path_factory.mktemp("legacy") / "models.toml"
        path.write_text(CATALOG.format(chat=chat, embed=embed))
        gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(path)}, workers=2).start()
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        stop(chat_proc)
        if embed_proc is not None:
            stop(embed_proc)


def sdk(gateway, key):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=120)


def check_billed(engine, org, before, raw_headers, usage):
    """The event, ``usage.cost`` and the balance agree with the usage the client saw."""
    event = settled_event(engine, raw_headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "completed"
    assert event["prompt_tokens"] == usage.prompt_tokens > 0
    assert event["completion_tokens"] == getattr(usage, "completion_tokens", 0)
    assert event["cost_nanos"] == literal_cost_nanos(SMOLLM2_NANOS, event["prompt_tokens"],
                                                     event["completion_tokens"])
    assert Decimal(str(usage.model_extra["cost"])) == Decimal(event["cost_nanos"]) / 10 ** 9
    after = balance_nanos(engine, org.id)
    assert before[0] - after[0] == event["cost_nanos"] and after[1:] == (0, 0)
    return event


@pytest.mark.parametrize("options", [{}, {"echo": True, "logprobs": 2}],
                         ids=["plain", "echo-logprobs"])
def test_completion_is_billed_exactly(legacy_gateway, engine, options):
    org = make_org(engine, f"legacy-completion-{uuid.uuid4().hex[:8]}")
    before = balance_nanos(engine, org.id)
    prompt = "The capital of France is"
    with sdk(legacy_gateway, org.key) as client:
        raw = client.completions.with_raw_response.create(
            model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0, **options)
    resp = raw.parse()
    text = resp.choices[0].text
    assert resp.object == "text_completion" and text
    if options:
        assert text.startswith(prompt) and resp.choices[0].logprobs.tokens
    event = check_billed(engine, org, before, raw.headers, resp.usage)
    assert not event["estimated"] and event["endpoint"] == "completions"
    assert 0 < resp.usage.completion_tokens <= 8


def test_completion_stream_is_metered_and_billed_exactly(legacy_gateway, engine):
    org = make_org(engine, "legacy-stream")
    before = balance_nanos(engine, org.id)
    with sdk(legacy_gateway, org.key) as client:
        raw = client.completions.with_raw_response.create(
            model="smollm2-135m", prompt="Once upon a time", max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
    usage = chunks[-1].usage
    event = check_billed(engine, org, before, raw.headers, usage)
    assert event["estimated"] and 0 < event["completion_tokens"] <= 8


@pytest.mark.parametrize("inputs, fmt", [("Hello there", "float"),
                                         (["Hello", "Bye there", "A third input"], "float"),
                                         (["Hello", "Bye there"], "base64")],
                         ids=["one", "batch", "base64"])
def test_embeddings_are_billed_exactly(legacy_gateway, engine, inputs, fmt):
    org = make_org(engine, f"legacy-embed-{uuid.uuid4().hex[:8]}")
    before = balance_nanos(engine, org.id)
    with sdk(legacy_gateway, org.key) as client:
        raw = client.embeddings.with_raw_response.create(model="smollm2-embed", input=inputs,
                                                         encoding_format=fmt)
    resp = raw.parse()
    count = 1 if isinstance(inputs, str) else len(inputs)
    assert [d.index for d in resp.data] == list(range(count))
    if fmt == "float":  # the SDK decodes base64 itself only when it chose the format
        sizes = {len(d.embedding) for d in resp.data}
        assert len(sizes) == 1 and sizes.pop() > 16
        assert all(isinstance(x, float) for x in resp.data[0].embedding)
    else:
        assert all(isinstance(d.embedding, str) for d in resp.data)
    event = check_billed(engine, org, before, raw.headers, resp.usage)
    assert event["endpoint"] == "embeddings" and not event["estimated"]
