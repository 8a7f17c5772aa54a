"""A catalog backend's API key (gateway/contract/catalog.py, gateway/backends/upstream.py): read at
load from the variable ``api_key_env`` names or the file ``api_key_file`` names, refused with a
clear error when it cannot be read, sent as ``Authorization: Bearer`` on every request to that
backend (chat, completions, embeddings, the tokenize call, the health probe) and on no other
backend's, and never shown: not in a repr, an error, ``/v1/models`` or ``/metrics``."""
import logging

import pytest

import factories
from fake_upstream import FakeUpstream, json_reply
from gateway.backends import health, upstream
from gateway.contract.catalog import CatalogError, load_catalog

SECRET = "sk-backend-0123456789abcdef"
ENTRY = """
[[models]]
id = "m"
context_window = 4096
max_output_tokens = 256
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{backends}]
"""


def catalog(tmp_path, *backends):
    path = tmp_path / "models.toml"
    path.write_text(ENTRY.format(backends=", ".join(backends)))
    return str(path)


def backend(fields="", url="http://a:1/v1"):
    return f'{{ url = "{url}", model = "up"{", " + fields if fields else ""} }}'


def load_error(tmp_path, entry, environ=None):
    with pytest.raises(CatalogError) as caught:
        load_catalog(catalog(tmp_path, entry), {} if environ is None else environ)
    assert SECRET not in str(caught.value)
    return str(caught.value)


def test_a_key_is_read_from_the_named_variable_or_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")  # the final newline of a secret file is not the key's
    models = load_catalog(catalog(tmp_path, backend('api_key_env = "VLLM_KEY"'),
                                  backend(f'api_key_file = "{key_file}"', "http://b:1/v1"),
                                  backend(url="http://c:1/v1")),
                          {"VLLM_KEY": SECRET})
    keys = [b.api_key for b in models["m"].backends]
    assert keys == [SECRET, SECRET, None]


def test_a_key_is_in_no_repr_and_not_on_the_models_list(tmp_path):
    models = load_catalog(catalog(tmp_path, backend('api_key_env = "VLLM_KEY"')),
                          {"VLLM_KEY": SECRET})
    entry = models["m"]
    assert SECRET not in repr(entry.backends[0]) and SECRET not in repr(entry)
    assert "VLLM_KEY" in repr(entry.backends[0])  # where it comes from may be shown
    assert SECRET not in str(entry.public())


def test_without_an_environment_no_key_is_read(tmp_path):
    """The body checker's child and the sweeper never call a backend."""
    models = load_catalog(catalog(tmp_path, backend('api_key_env = "UNSET"'),
                                  backend('api_key_file = "/nonexistent/key"', "http://b:1/v1")))
    assert [b.api_key for b in models["m"].backends] == [None, None]


def test_an_unset_or_empty_variable_is_a_catalog_error(tmp_path):
    message = load_error(tmp_path, backend('api_key_env = "VLLM_KEY"'))
    assert "api_key_env VLLM_KEY is not set" in message and "http://a:1/v1" in message
    assert "is not set" in load_error(tmp_path, backend('api_key_env = "VLLM_KEY"'),
                                      {"VLLM_KEY": "  "})


def test_an_unreadable_or_empty_file_is_a_catalog_error(tmp_path):
    missing = tmp_path / "missing"
    assert "cannot be read (No such file or directory)" in load_error(
        tmp_path, backend(f'api_key_file = "{missing}"'))
    assert "cannot be read" in load_error(tmp_path, backend(f'api_key_file = "{tmp_path}"'))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty" in load_error(tmp_path, backend(f'api_key_file = "{empty}"'))


def test_a_key_that_is_not_one_line_of_visible_ascii_is_refused_unshown(tmp_path):
    two_lines = tmp_path / "two"
    two_lines.write_text(SECRET + "\n" + SECRET + "\n")
    assert "one line of visible ASCII" in load_error(
        tmp_path, backend(f'api_key_file = "{two_lines}"'))
    assert "one line of visible ASCII" in load_error(
        tmp_path, backend('api_key_env = "K"'), {"K": SECRET + "\r\nX-Injected: 1"})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" + SECRET.encode())
    assert "not ASCII text" in load_error(tmp_path, backend(f'api_key_file = "{binary}"'))


def test_a_key_is_named_not_written_and_named_once(tmp_path):
    assert "api_key_env or api_key_file" in load_error(
        tmp_path, backend(f'api_key = "{SECRET}"'))
    key_file = tmp_path / "key"
    key_file.write_text(SECRET)
    assert "both given" in load_error(
        tmp_path, backend(f'api_key_env = "K", api_key_file = "{key_file}"'), {"K": SECRET})
    for source in ('api_key_env = ""', "api_key_env = 7", 'api_key_file = ""'):
        assert "must name" in load_error(tmp_path, backend(source))
        with pytest.raises(CatalogError):  # the shape is checked also when no key is read
            load_catalog(catalog(tmp_path, backend(source)))


# -- on the wire -----------------------------------------------------------------------------

@pytest.fixture
def fake():
    with FakeUpstream() as server:
        yield server


def keyed(tmp_path, url, environ=None):
    """The catalog's two backends at ``url``: the first with a key, the second without."""
    models = load_catalog(catalog(tmp_path, backend('api_key_env = "K"', url),
                                  backend(url=url) + f', {{ url = "{url}", model = "tok", '
                                  f'tokenize_url = "{url}/tokenize", api_key_env = "K" }}'),
                          {"K": SECRET} if environ is None else environ)
    return models["m"].backends


def authorization(record):
    return record.headers.get("Authorization")


def test_every_request_to_a_keyed_backend_carries_its_key(tmp_path, fake):
    with_key, without, tokenizer = keyed(tmp_path, fake.base_url)
    session = upstream.create_session(4)
    for path in ("/chat/completions", "/completions", "/embeddings"):
        fake.enqueue(json_reply({"ok": True}), path=None)
        upstream.open_chat(session, with_key, b"{}", (2, 2), path=path).close()
        fake.enqueue(json_reply({"ok": True}), path=None)
        upstream.open_chat(session, without, b"{}", (2, 2), path=path).close()
    fake.enqueue(json_reply({"count": 3}), path=None)
    assert upstream.count_tokens(session, tokenizer, "hello") == 3
    breaker, policy = health.Breaker(), health.BreakerPolicy()
    assert health.probe(session, with_key, breaker, "/models", 2, policy) == "up"
    assert health.probe(session, without, breaker, "/models", 2, policy) == "up"
    seen = [(r.path, authorization(r)) for r in fake.requests]
    bearer = "Bearer " + SECRET
    assert seen == [("/v1/chat/completions", bearer), ("/v1/chat/completions", None),
                    ("/v1/completions", bearer), ("/v1/completions", None),
                    ("/v1/embeddings", bearer), ("/v1/embeddings", None),
                    ("/v1/tokenize", bearer), ("/v1/models", bearer), ("/v1/models", None)]


def test_a_keyed_apps_models_list_metrics_and_logs_never_show_the_key(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv("KILN_TEST_BACKEND_KEY", SECRET)
    toml = factories.CATALOG.format(url=factories.UNREACHABLE_BACKEND).replace(
        'model = "upstream-fake" }', 'model = "upstream-fake", api_key_env = '
                                     '"KILN_TEST_BACKEND_KEY" }', 1)
    assert "api_key_env" in toml
    caplog.set_level(logging.DEBUG)
    app, engine = factories.sqlite_app(tmp_path, toml, probe_interval_s=0)
    try:
        entry = app.extensions["kiln.catalog"]["fake-model"]
        assert entry.backends[0].api_key == SECRET
        org = factories.org(engine)
        client = app.test_client()
        auth = {"Authorization": f"Bearer {org.key}"}
        models = client.get("/v1/models", headers=auth)
        answer = client.post("/v1/chat/completions", headers=auth, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
        metrics = client.get("/metrics")
        assert models.status_code == 200 and answer.status_code == 502
        for text in (models.get_data(as_text=True), answer.get_data(as_text=True),
                     metrics.get_data(as_text=True), caplog.text):
            assert SECRET not in text
    finally:
        body_process = app.extensions.get("kiln.body_process")
        if body_process is not None:
            body_process.stop()
        engine.dispose()



def test_kiln_catalog_check_reads_the_keys(tmp_path):
    """The reload's check (deploy/kiln-gateway.service) fails on a key the workers could not
    read, naming the variable, never showing a key."""
    from click.testing import CliRunner

    from gateway.ops import cli
    path = catalog(tmp_path, backend('api_key_env = "KILN_TEST_BACKEND_KEY"'))
    runner = CliRunner()
    missing = runner.invoke(cli.main, ["catalog", "check", path],
                            env={"KILN_TEST_BACKEND_KEY": None})
    assert missing.exit_code == 1
    assert "api_key_env KILN_TEST_BACKEND_KEY is not set" in missing.output
    ok = runner.invoke(cli.main, ["catalog", "check", path],
                       env={"KILN_TEST_BACKEND_KEY": SECRET})
    assert ok.exit_code == 0 and SECRET not in ok.output
