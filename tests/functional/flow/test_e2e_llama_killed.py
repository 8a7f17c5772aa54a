"""End to end: the real model server (llama-cpp-python's, SmolLM2-135M, which sends no usage in
streams) killed mid-stream. Its model has a local tokenizer in the catalog, the GGUF file it
serves, and no tokenize route: nobody is left to count, and the bill is still the exact count
of what was relayed, as llama.cpp's own tokenizer counts it here (docs/RELIABILITY.md, "Exact
counts when the backend cannot count")."""
import json
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from factories import SMOLLM2_NANOS, literal_cost_nanos
from gateway_proc import Gateway, balance_nanos, free_port, make_org, usage_event
from model_server import gguf_path, start_model_server, stop, wait_ready

pytestmark = pytest.mark.llama

STORY = [{"role": "user", "content": "Write a long story about a dragon who loves the sea."}]
DELTAS_BEFORE_KILL = 12
# SmolLM2's chat template (the GGUF's tokenizer.chat_template) as llama-cpp-python's server
# renders it for STORY: its default system prompt, the message, the assistant's turn.
TEMPLATE = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture
def model_server():
    """A model server of this test's own (it is killed): ``(Popen, base URL)``."""
    port = free_port()
    proc = start_model_server(sys.executable, port, Path(tempfile.mkdtemp()) / "llama.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=180, proc=proc)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture
def gateway(pg_url, model_server, tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'''[[models]]
id = "smollm2-135m"
context_window = 4096
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
tokenizer = {json.dumps(gguf_path())}
backends = [{{ url = "{model_server[1]}/v1", model = "smollm2-135m", server = "llama-cpp-python" }}]
''')
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog)}, workers=1).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def llama_tokens():
    """llama.cpp's own count of a text (its vocabulary alone, from the same GGUF file)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(model_path=gguf_path(), vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def relay_until_killed(gateway, key, proc):
    """Stream STORY; kill the model server (SIGKILL) after a few deltas; read the stream to its
    end. Return ``(generation id, text relayed, the stream's last payload)``."""
    r = requests.post(gateway.base_url + "/v1/chat/completions", stream=True, timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "smollm2-135m", "messages": STORY, "max_tokens": 800,
                            "temperature": 0, "stream": True})
    assert r.status_code == 200
    pieces, payloads = [], []
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        payloads.append(line[6:].decode())
        chunk = json.loads(payloads[-1]) if payloads[-1] != "[DONE]" else {}
        for choice in chunk.get("choices") or ():
            if choice["delta"].get("content"):
                pieces.append(choice["delta"]["content"])
                if len(pieces) == DELTAS_BEFORE_KILL:
                    proc.kill()
    return r.headers["X-Neocloud-Generation-Id"], "".join(pieces), payloads[-1]


def test_a_stream_whose_model_server_dies_is_billed_the_exact_count_relayed(
        gateway, model_server, engine, llama_tokens):
    org = make_org(engine, "e2e-killed")
    before = balance_nanos(engine, org.id)
    gid, text, last = relay_until_killed(gateway, org.key, model_server[0])
    assert "error" in json.loads(last), last  # the stream ended with an error, not [DONE]
    assert len(text) > 0 and llama_tokens(text) >= DELTAS_BEFORE_KILL
    event = usage_event(engine, gid)
    assert event["status"] == "upstream_error"
    # The completion is the exact count of the text relayed, by Kiln's own tokenizer: not the
    # bytes (several times more), and equal to llama.cpp's count of it.
    assert event["completion_tokens"] == llama_tokens(text) < len(text.encode())
    assert event["completion_counted_by"] == "tokenizer"
    # The prompt is a bound from above (the template is the server's): the message's exact
    # count plus the template allowance (8 per message, 32 per request), never below the
    # prompt as the server rendered it.
    content = STORY[0]["content"]
    assert event["prompt_counted_by"] == "bound"
    assert event["prompt_tokens"] == llama_tokens(content) + 8 + 32
    assert event["prompt_tokens"] >= llama_tokens(TEMPLATE.format(content=content))
    cost = literal_cost_nanos(SMOLLM2_NANOS, event["prompt_tokens"], event["completion_tokens"])
    assert event["cost_nanos"] == cost == before[0] - balance_nanos(engine, org.id)[0]
