"""Streams through a real nginx started from the shipped site file (``deploy/nginx/kiln.conf``)
in front of the gateway (gunicorn, gevent workers): no buffering on the way, and a client that
hangs up at nginx still reaches the model server (at once, not at a read timeout)."""
import pytest

import nginx_proc
from fake_upstream import Hang, Status
from gateway_proc import ROOT, balance_nanos, settled_event
from streams import (SSE_HEAD, RawStream, close_raw_streams, data_events, relay_event_by_event,
                     stream_body)

SITE = ROOT / "deploy" / "nginx" / "kiln.conf"

pytestmark = [pytest.mark.nginx,
              pytest.mark.skipif(nginx_proc.find_nginx() is None, reason="nginx not installed")]


@pytest.fixture(scope="module")
def nginx(gateway, tmp_path_factory):
    """nginx on a free loopback port, proxying to the shared gateway."""
    handle = nginx_proc.start_nginx(SITE, nginx_proc.free_port(), f"127.0.0.1:{gateway.port}",
                                    tmp_path_factory.mktemp("nginx"))
    yield handle
    close_raw_streams()
    handle.stop()


def test_stream_through_nginx_is_not_buffered(nginx, fake, org, engine):
    raw = relay_event_by_event(nginx.base_url, fake, org)
    assert raw.status == 200 and raw.ended
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["cache-control"] == "no-cache"
    assert "content-length" not in raw.headers
    assert raw.body.endswith(b"data: [DONE]\n\n") and len(data_events(raw.body)) == 10
    assert settled_event(engine, raw.gid)["status"] == "completed"


def test_client_hanging_up_at_nginx_closes_the_model_connection(nginx, fake, org, engine):
    fake.enqueue([Status(200, SSE_HEAD), Hang()])
    raw = RawStream(nginx.base_url, org.key, stream_body()).read_head()
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert record.closed_at > closed_at  # within the 15 s wait above, not at a read timeout
    event = settled_event(engine, raw.gid)
    assert event["status"] == "client_cancelled" and event["cost_nanos"] > 0
    assert 10 * 10**9 - balance_nanos(engine, org.id)[0] == event["cost_nanos"]
    assert balance_nanos(engine, org.id)[1:] == (0, 0)
