"""The ``Authorization`` header as clients really send it, odd bytes included, through gunicorn:
every key that is not one of ours is a 401 in the envelope, never a 500."""
import json
import socket

from gateway_proc import make_org


def raw_get(gateway, path, authorization):
    """Send ``GET path`` with ``authorization`` as raw header bytes; return (status, body)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: kiln\r\nAuthorization: "
                     + authorization + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


ODD_KEYS = [
    b"Bearer kiln-\xff\xfe",          # latin-1 bytes (obs-text): allowed in a header value
    b"Bearer \xed\xa0\x80",           # a lone surrogate's UTF-8 bytes
    b"Bearer kiln-%00abc",            # a NUL, percent-encoded as text
    b"Bearer kiln-abc def",           # a space inside the key
    b"Bearer \"kiln-abc\"",           # quoted
    b"Bearer kiln-" + b"A" * 4000,    # far longer than any key
    b"Bearer kiln-\xc3\xa9t\xc3\xa9",  # UTF-8 text
    b"Bearer    ",                    # a scheme and nothing else
    b"bearer",
]


def test_odd_authorization_headers_are_401_in_the_envelope(gateway, engine):
    org = make_org(engine, "auth-odd")
    log_before = len(gateway.log())
    for header in ODD_KEYS:
        for path in ("/v1/credits", "/v1/generation?id=gen-1"):
            status, body = raw_get(gateway, path, header)
            assert status == 401, (header[:30], path, body[:300])
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
    # A key with odd bytes appended is another key, not a prefix match.
    status, _ = raw_get(gateway, "/v1/credits", b"Bearer " + org.key.encode() + b"\xff")
    assert status == 401
    status, _ = raw_get(gateway, "/v1/credits", b"Bearer " + org.key.encode())
    assert status == 200
    assert "Traceback" not in gateway.log()[log_before:]
