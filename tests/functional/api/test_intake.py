"""Bounded work before admission (deploy/kiln.env.example, "bounded work before admission"),
through gunicorn and the shipped nginx site.

A body trickled too slowly is cut (408 from the gateway; nginx's own timeouts in front of it);
large bodies take a share of a per-worker budget and get a fast 503 with ``Retry-After`` when
none is free; an unknown key is remembered as unknown (no database query per repeat); and when
more requests arrive than the database pool can admit they are told 503 with ``Retry-After``,
uncharged, never a 500, and no in-flight slot leaks.
"""
import json
import socket
import threading
import uuid

import pytest
import requests
import sqlalchemy as sa

import nginx_proc
from gateway.api.auth import hash_key
from factories import concurrently
from gateway_proc import ROOT, balance_nanos, make_org, wait_until

SITE = ROOT / "deploy" / "nginx" / "kiln.conf"
SMALL = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


class SlowClient:
    """A raw HTTP/1.1 client that sends the head, then the body a few bytes at a time."""

    def __init__(self, port, key, length=200, head=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.head = head or (f"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\n"
                             f"Authorization: Bearer {key}\r\nContent-Type: application/json"
                             f"\r\nContent-Length: {length}\r\n\r\n").encode()
        self.sock.sendall(self.head)

    def trickle_until_answered(self, gap_s=0.3, limit=10_000):
        """Send one byte every ``gap_s`` until the server answers or closes; return what it
        sent (empty if it closed without an answer)."""
        for _ in range(limit):
            try:
                self.sock.sendall(b" ")
            except OSError:
                return self.read_rest()
            if socket_readable(self.sock, gap_s):
                return self.read_rest()
        raise AssertionError("the server never answered nor closed")

    def read_rest(self):
        """Read until the server closes the connection; return the bytes. The server must end
        it: this socket's own timeout running out is a failure, never a close."""
        chunks = []
        try:
            while chunk := self.sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        except socket.timeout as err:
            raise AssertionError(f"the server neither answered nor closed within the client's "
                                 f"{self.sock.gettimeout()} s; got {b''.join(chunks)!r}") from err
        return b"".join(chunks)

    def close(self):
        self.sock.close()


def socket_readable(sock, timeout_s):
    import select
    return bool(select.select([sock], [], [], timeout_s)[0])


def parse_answer(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.decode().partition(":") for line in head.split(b"\r\n")[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, headers, body


def assert_untouched(engine, org):
    """No usage event, no hold, no lease: the org is as created ($10)."""
    with engine.connect() as conn:
        events = conn.execute(sa.text("SELECT count(*) FROM usage_events WHERE org_id = :o"),
                              {"o": org.id}).scalar_one()
    assert events == 0
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


@pytest.fixture
def org_b(engine):
    return make_org(engine, f"other-{uuid.uuid4().hex[:8]}")


# -- slow bodies ----------------------------------------------------------------------------

def test_a_body_trickled_past_the_body_timeout_is_408_and_holds_no_worker(start_gateway, fake,
                                                                          engine, org, org_b):
    gw = start_gateway(workers=1, body_timeout_s=2)
    slow = SlowClient(gw.port, org.key)
    # While the trickle goes on, the only worker serves another org at once.
    ok = requests.post(gw.base_url + "/v1/chat/completions", json=SMALL, timeout=30,
                       headers=org_b.headers)
    assert ok.status_code == 200
    status, headers, body = parse_answer(slow.trickle_until_answered())
    slow.close()
    assert status == 408 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert_untouched(engine, org)
    assert len(fake.requests) == 1  # the other org's request only


@pytest.fixture
def timeouts_site(tmp_path):
    """The shipped site with its client timeouts shortened to 2 s (the rest as shipped)."""
    text = SITE.read_text()
    for directive in ("client_header_timeout 10s;", "client_body_timeout 10s;"):
        assert directive in text, directive
        text = text.replace(directive, directive.replace("10s", "2s"))
    path = tmp_path / "kiln.conf"
    path.write_text(text)
    return path


@pytest.fixture
def nginx_gateway(start_gateway, timeouts_site, tmp_path):
    if nginx_proc.find_nginx() is None:
        pytest.skip("nginx not installed")
    gw = start_gateway(workers=1, body_timeout_s=3)
    handle = nginx_proc.start_nginx(timeouts_site, nginx_proc.free_port(),
                                    f"127.0.0.1:{gw.port}", tmp_path / "nginx")
    yield handle
    handle.stop()


def test_nginx_closes_a_client_that_stalls_in_its_head_or_its_body(nginx_gateway, fake, engine,
                                                                    org, org_b):
    stalled_head = SlowClient(nginx_gateway.port, org.key,
                              head=b"POST /v1/chat/completions HTTP/1.1\r\nHost: k")
    stalled_body = SlowClient(nginx_gateway.port, org.key, length=500)
    stalled_body.sock.sendall(b'{"model": ')
    ok = requests.post(nginx_gateway.base_url + "/v1/chat/completions", json=SMALL,
                       headers=org_b.headers, timeout=30)
    assert ok.status_code == 200
    # nginx ends both (it may answer 408 or just close); neither reaches the model.
    for client in (stalled_head, stalled_body):
        answer = client.read_rest()
        assert answer == b"" or parse_answer(answer)[0] == 408
        client.close()
    assert_untouched(engine, org)
    assert len(fake.requests) == 1


def test_a_trickle_fast_enough_for_nginx_is_cut_by_the_gateway(nginx_gateway, fake, engine, org):
    slow = SlowClient(nginx_gateway.port, org.key, length=500)
    status, _, body = parse_answer(slow.trickle_until_answered(gap_s=0.3))
    slow.close()
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert_untouched(engine, org)
    assert fake.requests == []


# -- large bodies ---------------------------------------------------------------------------

def large_body(size=300_000):
    """A valid chat body of about ``size`` bytes (above the inline threshold)."""
    return json.dumps({**SMALL, "metadata": {"pad": "x" * (size - 120)}}).encode()


def test_large_bodies_beyond_the_parse_budget_get_a_fast_503(start_gateway, fake, engine, org,
                                                             org_b):
    gw = start_gateway(workers=1, parse_budget_bytes=400_000, parse_wait_s=0.2,
                       body_timeout_s=120)
    holder = SlowClient(gw.port, org.key, length=350_000)  # holds 350 kB of the 400 kB
    # Until the worker has read the holder's head, a large body may still be served; the
    # probes go as a third org so that each one served is billed there, and counted.
    prober = make_org(engine, f"prober-{uuid.uuid4().hex[:8]}")
    served = []

    def refused():
        r = requests.post(gw.base_url + "/v1/chat/completions", data=large_body(),
                          headers={**prober.headers, "Content-Type": "application/json"},
                          timeout=30)
        if r.status_code == 200:
            served.append(r)
        return [r] if r.status_code == 503 else None  # a 503 Response is falsy
    busy, = wait_until(refused, timeout_s=60, interval_s=0.1)
    assert busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "server_busy"
    # Small bodies take no share: another org is served meanwhile.
    assert requests.post(gw.base_url + "/v1/chat/completions", json=SMALL, timeout=30,
                         headers=org_b.headers).status_code == 200
    holder.close()  # the share comes back; a large body is served again
    wait_until(lambda: requests.post(
        gw.base_url + "/v1/chat/completions", data=large_body(), timeout=30,
        headers={**org_b.headers, "Content-Type": "application/json"}).status_code == 200,
        timeout_s=60, interval_s=0.2)
    assert_untouched(engine, org)
    with engine.connect() as conn:
        billed = conn.execute(sa.text("SELECT count(*) FROM usage_events WHERE org_id = :o"),
                              {"o": prober.id}).scalar_one()
    assert billed == len(served)  # a refused probe is never billed


def test_a_large_body_refused_unread_closes_its_connection(start_gateway, fake, org):
    """A bad key with a 2 MiB body: the gateway answers 401 and closes the connection instead
    of reading 2 MiB it has no use for (gunicorn would drain it to keep the connection,
    holding the worker's event loop); a small body refused unread keeps its connection."""
    import http.client
    gw = start_gateway(workers=1)
    bad_key = {"Authorization": "Bearer kiln-" + "x" * 43, "Content-Type": "application/json"}

    def second_request_on_the_same_connection(body):
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=bad_key)
            first = conn.getresponse()
            assert first.status == 401 and json.loads(first.read())["error"]["code"] == \
                "invalid_api_key"
            sock = conn.sock
            try:
                conn.request("POST", "/v1/chat/completions", body=json.dumps(SMALL),
                             headers=bad_key)
                answered = conn.getresponse().status
            except (http.client.RemoteDisconnected, ConnectionError):
                answered = None
            return answered, conn.sock is sock
        finally:
            conn.close()
    large = json.dumps(SMALL).encode() + b" " * (2 * 1024 * 1024)
    assert second_request_on_the_same_connection(large)[0] is None  # closed
    assert second_request_on_the_same_connection(json.dumps(SMALL)) == (401, True)  # kept
    assert requests.post(gw.base_url + "/v1/chat/completions", json=SMALL, timeout=30,
                         headers=org.headers).status_code == 200
    assert len(fake.requests) == 1


# -- unknown keys ---------------------------------------------------------------------------

def add_key(engine, org, key):
    """Insert ``key`` for ``org`` directly, as ``kiln key create`` would store it."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO api_keys (org_id, prefix, key_hash, name) "
                             "VALUES (:o, :p, :h, 'late')"),
                     {"o": org.id, "p": key[:12], "h": hash_key(key)})


def post_with(gw, key):
    return requests.post(gw.base_url + "/v1/chat/completions", json=SMALL, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


def test_an_unknown_key_is_remembered_without_asking_the_database(start_gateway, fake, engine,
                                                                   org):
    gw = start_gateway(workers=1, unknown_key_cache_ttl_s=3600)
    key = "kiln-" + uuid.uuid4().hex * 2
    assert post_with(gw, key).status_code == 401
    add_key(engine, org, key)  # now it exists, but this worker remembers it as unknown
    for _ in range(5):
        r = post_with(gw, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post_with(gw, org.key).status_code == 200  # known keys are looked up as before
    assert fake.requests and all(r.json["model"] == "upstream-fake" for r in fake.requests)


def test_an_unknown_key_is_forgotten_after_its_ttl(start_gateway, fake, engine, org):
    gw = start_gateway(workers=1, unknown_key_cache_ttl_s=1)
    key = "kiln-" + uuid.uuid4().hex * 2
    assert post_with(gw, key).status_code == 401
    add_key(engine, org, key)
    wait_until(lambda: post_with(gw, key).status_code == 200, timeout_s=60, interval_s=0.2)


# -- overload -------------------------------------------------------------------------------

def test_more_arrivals_than_the_pool_admits_are_503_with_retry_after(start_gateway, fake,
                                                                     engine):
    gw = start_gateway(workers=1, db_pool_size=1, db_max_overflow=0, db_pool_timeout_s=0.05)
    org = make_org(engine, f"crowd-{uuid.uuid4().hex[:8]}", usd="100", limit=1000)

    refused = threading.Event()

    def one(_):
        r = requests.post(gw.base_url + "/v1/chat/completions", timeout=120,
                          headers=org.headers, json={**SMALL, "stream": True})
        if r.status_code == 503:
            refused.set()
        return r.status_code, r.headers, r.content

    def stall_the_database():
        # A fast database admits 200 arrivals in a few batches before any waits out its pool
        # timeout. Holding the org's balance row (as a long transaction would) keeps the one
        # pooled connection's admission waiting until the others have been refused.
        with engine.connect() as conn, conn.begin():
            conn.execute(sa.text("SELECT 1 FROM credit_balances WHERE org_id = :o FOR UPDATE"),
                         {"o": org.id})
            locked.set()
            refused.wait(timeout=60)
    locked = threading.Event()
    staller = threading.Thread(target=stall_the_database)
    staller.start()
    assert locked.wait(timeout=30)
    answers = concurrently(200, one)  # released together: arrivals the pool cannot admit
    staller.join()
    statuses = sorted({status for status, _, _ in answers})
    assert set(statuses) <= {200, 503}, statuses
    busy = [(h, json.loads(body)) for status, h, body in answers if status == 503]
    assert busy, "the pool was never saturated: the test did not test overload"
    for headers, envelope in busy:
        assert headers["Retry-After"].isdigit()
        assert envelope["error"]["code"] in ("database_busy", "server_busy")
    served = [body for status, _, body in answers if status == 200]
    assert all(body.endswith(b"data: [DONE]\n\n") for body in served)
    completed = len(served)
    balance, held, in_flight = balance_nanos(engine, org.id)
    assert (held, in_flight) == (0, 0)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*), sum(cost_nanos) FROM usage_events "
                                    "WHERE org_id = :o GROUP BY status"), {"o": org.id}).all()
    by_status = {status: (count, cost) for status, count, cost in rows}
    # An admission that committed only after its request had given up with 503 is settled at
    # once as an error, nothing billed (Ledger._settle_orphan); every other event is an answer.
    orphans = by_status.pop("error", (0, 0))
    assert orphans[1] == 0 and orphans[0] <= len(busy)
    assert set(by_status) == {"completed"} and by_status["completed"][0] == completed
    assert balance == 100 * 10**9 - by_status["completed"][1]
    # Past the overload the pool admits again.
    assert requests.post(gw.base_url + "/v1/chat/completions", timeout=60, headers=org.headers,
                         json=SMALL).status_code == 200

