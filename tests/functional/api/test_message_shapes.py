"""Every message shape of the current OpenAI chat API, sent by the official ``openai`` SDK through
gunicorn, and what each backend family receives (README "API", docs/PARAMETERS.md).

One model per backend family, all on the scripted fake upstream, which records each body. Then
the body's numbers and nesting (finite, in range, bounded depth: a 400 naming the ``param``), and
the image sources a vision model may be made to read (``images.py``).
"""
import base64
import copy
import uuid

import openai
import pytest

from contract_table import assert_no_trace, check_error, raw_post
from gateway_proc import Gateway, gateway_env, make_org

FAMILIES = ("openai", "generic", "vllm", "sglang", "llama-cpp-python", "llama.cpp")
MODEL = """
[[models]]
id = "m-{server}"
context_window = 32768
max_output_tokens = 256
input = ["text", "image", "audio", "file"]
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{url}", model = "backend-{server}", server = "{server}" }}]
"""
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 32).decode()
IMAGE = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}",
                                            "detail": "low"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
FILE = {"type": "file", "file": {"file_id": "file-abc123"}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def text(value):
    return {"type": "text", "text": value}


# Every role, content as a string and as parts where the role allows them, names, refusals
# (as a field and as a part), an audio reference, tool calls and tool results.
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "developer", "content": [text("Answer "), text("in English.")], "name": "policy"},
    {"role": "system", "content": [text("You are a test.")]},
    {"role": "user", "content": "Hi", "name": "ann"},
    {"role": "user", "content": [text("Look: "), IMAGE, AUDIO, FILE]},
    {"role": "assistant", "content": [text("Sure. "), {"type": "refusal", "refusal": "No."}],
     "name": "bot"},
    {"role": "assistant", "content": None, "refusal": "I cannot help with that."},
    {"role": "assistant", "content": None, "audio": {"id": "audio_abc123"}},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [text("21"), text(" C")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    {"role": "user", "content": "Thanks"},
]


def expected(server):
    """What a backend of family ``server`` must receive for :data:`CONVERSATION`, literally:
    ``developer`` only where the family knows it, OpenAI-platform fields (``refusal``,
    ``audio``) turned into content, text parts joined where the family wants strings (and a
    tool-call turn's null content sent as "" there)."""
    developer = "developer" if server == "openai" else "system"
    strings = server in ("llama-cpp-python", "llama.cpp")
    joined = (lambda parts, whole: whole) if strings else (lambda parts, whole: parts)
    return [
        {"role": developer, "content": "Be brief."},
        {"role": developer, "content": joined([text("Answer "), text("in English.")],
                                              "Answer in English."), "name": "policy"},
        {"role": "system", "content": joined([text("You are a test.")], "You are a test.")},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "user", "content": [text("Look: "), IMAGE, AUDIO, FILE]},
        {"role": "assistant", "content": joined([text("Sure. "), text("No.")], "Sure. No."),
         "name": "bot"},
        {"role": "assistant", "content": "I cannot help with that."},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "" if strings else None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": joined([text("21"), text(" C")],
                                                                     "21 C")},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.fixture(scope="module")
def family_gateway(pg_url, fake_upstream, tmp_path_factory):
    path = tmp_path_factory.mktemp("families") / "models.toml"
    path.write_text("".join(MODEL.format(server=s, url=fake_upstream.base_url)
                            for s in FAMILIES))
    gw = Gateway(gateway_env(pg_url, path), workers=1).start()
    yield gw
    gw.stop()


@pytest.fixture
def family_client(family_gateway, engine):
    org = make_org(engine, f"families-{uuid.uuid4().hex[:8]}")
    with openai.OpenAI(base_url=family_gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0, timeout=30) as c:
        yield c


@pytest.mark.parametrize("server", FAMILIES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_every_message_shape_is_accepted_and_sent_as_the_family_reads_it(family_client, fake,
                                                                          server, stream):
    sent = copy.deepcopy(CONVERSATION)
    reply = family_client.chat.completions.create(model=f"m-{server}", messages=sent,
                                                  stream=stream)
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    else:
        assert reply.choices[0].message.content
    received = fake.requests[-1].json
    assert received["model"] == f"backend-{server}"
    assert received["messages"] == expected(server)
    assert sent == CONVERSATION  # the SDK's objects are what it sent: Kiln changed copies


# -- numbers and nesting (item 3) -----------------------------------------------------------

BASE = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]'
NUMBERS = {
    "temperature-1e400": (b', "temperature": 1e400}', "temperature"),
    "temperature-neg-1e400": (b', "temperature": -1e400}', "temperature"),
    "top_p-NaN": (b', "top_p": NaN}', "top_p"),
    "seed-Infinity": (b', "seed": Infinity}', "seed"),
    "seed-beyond-64-bits": (b', "seed": 123456789012345678901234567890}', "seed"),
    "metadata-value": (b', "metadata": {"k": 1e999}}', "metadata.k"),
    "logit_bias-value": (b', "logit_bias": {"50256": -Infinity}}', "logit_bias.50256"),
    "tool-schema": (b', "tools": [{"type": "function", "function": {"name": "f", '
                    b'"description": "d", "parameters": {"type": "object", "properties": '
                    b'{"x": {"type": "number", "maximum": 1e400}}}}}]}',
                    "tools[0].function.parameters.properties.x.maximum"),
}


@pytest.mark.parametrize("case", NUMBERS, ids=list(NUMBERS))
def test_non_finite_and_out_of_range_numbers_anywhere_are_400_with_param(gateway, fake, org,
                                                                         engine, case):
    tail, param = NUMBERS[case]
    error = check_error(raw_post(gateway, org, BASE + tail), 400, "invalid_value", param)
    assert "finite" in error["message"]
    assert_no_trace(engine, fake, org)


def nested(depth):
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("member,depth", [("metadata", 70), ("tools", 5000),
                                          ("response_format", 100_000)])
def test_deep_nesting_is_400_naming_the_member(gateway, fake, org, engine, member, depth):
    data = BASE + b', "' + member.encode() + b'": ' + nested(depth) + b"}"
    error = check_error(raw_post(gateway, org, data), 400, "invalid_json", member)
    assert "nested more than 64 levels" in error["message"]
    assert_no_trace(engine, fake, org)


def test_nesting_up_to_the_limit_and_64_bit_numbers_are_accepted(client, fake):
    schema = {"type": "object"}
    for _ in range(29):  # the innermost schema object is the body's 63rd level below it
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": schema}}
    client.chat.completions.create(model="fake-model", tools=[tool], seed=2**63 - 1,
                                   messages=[{"role": "user", "content": "hi"}],
                                   temperature=1.5e-300)
    received = fake.requests[-1].json
    assert received["tools"] == [tool] and received["seed"] == 2**63 - 1
    assert received["temperature"] == 1.5e-300


# -- image sources (item 4) -----------------------------------------------------------------

REFUSED_IMAGES = [
    "http://127.0.0.1/cat.png", "https://127.0.0.1:8443/cat.png", "https://localhost/cat.png",
    "https://10.0.0.5/cat.png", "https://172.16.3.4/cat.png", "https://192.168.1.1/cat.png",
    "https://169.254.169.254/latest/meta-data/", "https://[::1]/cat.png",
    "https://[fe80::1]/cat.png", "https://[::ffff:10.0.0.1]/cat.png", "https://100.64.0.1/a.png",
    "https://metadata.google.internal/computeMetadata/v1/", "https://printer.local/a.png",
    "https://user:pw@1.1.1.1/a.png", "http://1.1.1.1/cat.png", "ftp://1.1.1.1/cat.png",
    "file:///etc/passwd", "gopher://1.1.1.1/", "https:///nohost.png",
    "data:text/plain;base64,aGVsbG8=", f"data:image/png;base64,{JPEG}",
    "data:image/png;base64,not base64!", "data:image/svg+xml;base64,PHN2Zz4=",
    "data:image/png,rawbytes",
]


@pytest.mark.parametrize("url", REFUSED_IMAGES)
def test_image_sources_that_reach_inside_the_network_are_refused(client, gateway, fake, org,
                                                                  engine, url):
    messages = [{"role": "user", "content": [text("what is this?"),
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-vision", messages=messages)
    assert err.value.body["code"] == "invalid_image_url"
    assert err.value.body["param"] == "messages[0].content[1].image_url"
    assert_no_trace(engine, fake, org)


def test_an_image_larger_than_the_limit_is_refused(start_gateway, fake, org, engine):
    gw = start_gateway(max_body_bytes=40 * 1024 * 1024)
    payload = b"A" * (28 * 1024 * 1024)  # 21 MiB once decoded
    data = (BASE[:-1] + b',{"role": "user", "content": [{"type": "image_url", "image_url": '
            b'{"url": "data:image/png;base64,' + payload + b'"}}]}]}')
    data = data.replace(b'"fake-model"', b'"fake-vision"')
    check_error(raw_post(gw, org, data), 400, "invalid_image_url",
                "messages[1].content[0].image_url")
    assert_no_trace(engine, fake, org)


@pytest.mark.parametrize("url", ["https://1.1.1.1/cat.png", "https://[2606:4700::1111]/a.jpg",
                                 f"data:image/png;base64,{PNG}",
                                 f"data:image/jpeg;base64,{JPEG}"])
def test_public_https_and_checked_data_images_are_forwarded_as_sent(client, fake, url):
    part = {"type": "image_url", "image_url": {"url": url, "detail": "high"}}
    client.chat.completions.create(model="fake-vision",
                                   messages=[{"role": "user", "content": [text("hi"), part]}])
    assert fake.requests[-1].json["messages"][0]["content"] == [text("hi"), part]
