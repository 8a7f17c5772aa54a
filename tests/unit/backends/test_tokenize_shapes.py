"""A backend's tokenize endpoint is asked in its family's shape (gateway.backends.upstream
``count_tokens``): llama-server's ``/tokenize`` for ``llama.cpp``, llama-cpp-python's
``/extras/tokenize/count`` for the others; an answer that is not a count is no count
(``TokenizeFailed`` ``malformed``)."""
import pytest

from fake_upstream import FakeUpstream, json_reply
from gateway.backends import upstream
from gateway.contract.catalog import Backend


@pytest.fixture
def fake():
    with FakeUpstream() as server:
        yield server


def ask(fake, server, path, reply):
    backend = Backend(url=fake.base_url, model="m", server=server,
                      tokenize_url=fake.base_url.rsplit("/v1", 1)[0] + path)
    fake.enqueue(json_reply(reply), path=None)
    try:
        count = upstream.count_tokens(upstream.create_session(1), backend, "héllo")
    except upstream.TokenizeFailed as err:
        count = err.reason
    return count, fake.requests[-1]


def test_llama_server_is_asked_for_content_and_answers_tokens(fake):
    count, sent = ask(fake, "llama.cpp", "/tokenize", {"tokens": [1, 2, 3, 4]})
    assert count == 4
    assert sent.path == "/tokenize" and sent.json == {"content": "héllo"}


@pytest.mark.parametrize("server", ["llama-cpp-python", "generic"])
def test_other_families_are_asked_for_input_and_answer_a_count(fake, server):
    count, sent = ask(fake, server, "/extras/tokenize/count", {"count": 3})
    assert count == 3
    assert sent.path == "/extras/tokenize/count" and sent.json == {"input": "héllo"}


@pytest.mark.parametrize("server,reply", [
    ("llama.cpp", {"tokens": "1 2 3"}), ("llama.cpp", {"count": 3}), ("llama.cpp", [1, 2]),
    ("llama-cpp-python", {"tokens": [1, 2, 3]}), ("llama-cpp-python", {"count": True}),
])
def test_an_answer_in_another_shape_is_no_count(fake, server, reply):
    assert ask(fake, server, "/t", reply)[0] == "malformed"
