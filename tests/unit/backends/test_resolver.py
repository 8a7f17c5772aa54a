"""An IP literal is resolved in place; a name goes to gevent's thread resolver
(gateway/backends/resolver.py)."""
import socket
from unittest import mock

import pytest

from gateway.backends import resolver
from gateway.backends.resolver import Resolver, is_ip_literal


@pytest.mark.parametrize("host, literal", [
    ("127.0.0.1", True), ("::1", True), (b"10.0.0.7", True), ("fe80::1%lo", True),
    ("localhost", False), ("backend-1.internal", False), ("127.0.0.1.nip.io", False),
    ("", False), (None, False)])
def test_what_counts_as_an_ip_literal(host, literal):
    assert is_ip_literal(host) is literal


def test_a_literal_is_answered_in_place_and_a_name_by_the_thread_pool():
    r = Resolver()
    try:
        with mock.patch.object(resolver.ThreadResolver, "getaddrinfo",
                               side_effect=AssertionError("not for a literal")):
            got = r.getaddrinfo("127.0.0.1", 8000, 0, socket.SOCK_STREAM)
        assert got == socket.getaddrinfo("127.0.0.1", 8000, 0, socket.SOCK_STREAM)
        with mock.patch.object(resolver.ThreadResolver, "getaddrinfo",
                               return_value=["asked"]) as pooled:
            assert r.getaddrinfo("localhost", 8000, 0, socket.SOCK_STREAM) == ["asked"]
        pooled.assert_called_once_with("localhost", 8000, 0, socket.SOCK_STREAM, 0, 0)
    finally:
        r.close()


def test_the_gunicorn_settings_install_it_for_gevent():
    import runpy
    from pathlib import Path
    conf = Path(__file__).resolve().parents[3] / "deploy" / "gunicorn.conf.py"
    with mock.patch.dict("os.environ", {}, clear=False) as env:
        env.pop("GEVENT_RESOLVER", None)
        runpy.run_path(str(conf))
        assert env["GEVENT_RESOLVER"] == "gateway.backends.resolver.Resolver"
    from gevent._config import Resolver as Setting
    assert Setting()._import_one("gateway.backends.resolver.Resolver") is Resolver
