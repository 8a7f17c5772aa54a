"""Webhook signatures and URLs (docs/WEBHOOKS.md): the Standard Webhooks signature checked
against the reference library's own test vector, and the addresses ``kiln webhook add``
refuses; on SQLite no worker delivers."""
import base64
import socket

import pytest

from gateway.ops.webhooks import (UnsafeURL, check_url, headers, new_secret, sign,
                                  start_deliverer)

# The sign test of the Standard Webhooks reference library (github.com/standard-webhooks/
# standard-webhooks, libraries/python/tests/test_webhooks.py, test_sign_function).
VECTOR = {"secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
          "msg_id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "timestamp": 1614265330,
          "body": b'{"test": 2432232314}',
          "signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}


def test_the_signature_is_the_reference_librarys():
    v = VECTOR
    assert sign(v["secret"], v["msg_id"], v["timestamp"], v["body"]) == v["signature"]
    # The prefix is optional, as in the reference library.
    assert sign(v["secret"].removeprefix("whsec_"), v["msg_id"], v["timestamp"],
                v["body"]) == v["signature"]


def test_a_changed_byte_changes_the_signature():
    v = VECTOR
    assert sign(v["secret"], v["msg_id"], v["timestamp"], v["body"] + b" ") != v["signature"]
    assert sign(v["secret"], v["msg_id"], v["timestamp"] + 1, v["body"]) != v["signature"]


def test_headers_carry_id_timestamp_and_signature():
    v = VECTOR
    sent = headers(v["secret"], v["msg_id"], v["body"], timestamp=v["timestamp"])
    assert sent["webhook-id"] == v["msg_id"]
    assert sent["webhook-timestamp"] == str(v["timestamp"])
    assert sent["webhook-signature"] == v["signature"]
    assert sent["Content-Type"] == "application/json"


def test_a_new_secret_is_whsec_and_32_random_bytes():
    secrets = {new_secret() for _ in range(50)}
    assert len(secrets) == 50
    for secret in secrets:
        assert secret.startswith("whsec_")
        assert len(base64.b64decode(secret[len("whsec_"):], validate=True)) == 32


def resolver(*addresses):
    """A name resolution that answers ``addresses`` (getaddrinfo's shape)."""
    def resolve(host, port, proto=0):
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, proto,
                 "", (a, port)) for a in addresses]
    return resolve


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "224.0.0.1"])
def test_private_and_loopback_addresses_are_refused(address):
    with pytest.raises(UnsafeURL, match="private or loopback"):
        check_url("https://hooks.example/x", resolve=resolver(address))
    check_url("https://hooks.example/x", allow_private=True, resolve=resolver(address))


def test_one_private_address_among_public_ones_is_refused():
    with pytest.raises(UnsafeURL):
        check_url("https://hooks.example/x", resolve=resolver("93.184.216.34", "10.0.0.1"))


def test_public_addresses_are_taken():
    check_url("https://hooks.example/x", resolve=resolver("93.184.216.34",
                                                          "2606:2800:220:1::1"))


@pytest.mark.parametrize("url", ["ftp://hooks.example/x", "hooks.example/x", "http:///x",
                                 "file:///etc/passwd"])
def test_only_http_urls_with_a_host(url):
    with pytest.raises(UnsafeURL, match="http"):
        check_url(url, allow_private=True, resolve=resolver("93.184.216.34"))


def test_a_host_that_does_not_resolve_is_refused():
    def fails(host, port, proto=0):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with pytest.raises(UnsafeURL, match="does not resolve"):
        check_url("https://nowhere.example/x", resolve=fails)


def test_no_deliverer_on_sqlite(kiln):
    app, _ = kiln
    start_deliverer(app)
    assert app.extensions.get("kiln.webhooks", {}).get("deliverer") is None

