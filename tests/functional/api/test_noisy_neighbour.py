"""A key that pays nothing cannot slow another org (docs/RELIABILITY.md), through gunicorn with
one gevent worker (the flood and the victim share its event loop), Postgres and the scripted
fake upstream: a $0 org floods the worker's parse budget with 16 MiB bodies while another org's
400 KB image requests are all served; a $0 org's image URLs name hosts whose name server
answers after a minute while another org's requests (their backend named by a host name) are
served and the name server sees at most the flooder's share of lookups at once.
"""
import base64
import json
import threading
import uuid

import pytest
import requests

from dns_server import DnsServer
from gateway_proc import Gateway, gateway_env, make_org, wait_until

MiB = 1024 * 1024


def huge_vision_body(size=16 * MiB - 4096):
    """Just under ``size`` bytes of tiny messages for the vision model: parsed in full (the
    slowest JSON to parse), then refused by the contract (more messages than its window)."""
    one = b'{"role":"user","content":"x"},'
    return (b'{"model":"fake-vision","messages":[' + one * ((size - 64) // len(one))
            + b'{"role":"user","content":"x"}]}')


def image_body(size=400_000):
    """A valid chat request of about ``size`` bytes: one PNG as a data: URL."""
    png = b"\x89PNG\r\n\x1a\n" + bytes(size * 3 // 4)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return json.dumps({"model": "fake-vision", "max_tokens": 8, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "what is this?"},
                                    {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def post(url, body, org):
    """POST ``body`` with ``org``'s key; return the answer's status and error code."""
    r = requests.post(url, data=body, timeout=120,
                      headers={**org.headers, "Content-Type": "application/json"})
    return r.status_code, r.json().get("error", {}).get("code") if r.status_code != 200 else None


class Flood:
    """Threads posting one body over and over with one key until stopped; answers counted."""

    def __init__(self, url, key, body, threads):
        """:param body: bytes, or a function making each request's body."""
        self.url, self.key, self.body = url, key, body
        self.stop = threading.Event()
        self.answers = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _loop(self):
        with requests.Session() as session:
            while not self.stop.is_set():
                try:
                    body = self.body() if callable(self.body) else self.body
                    r = session.post(self.url, data=body, timeout=120, headers={
                        "Authorization": f"Bearer {self.key}",
                        "Content-Type": "application/json"})
                    self.answers.append(r.status_code)
                except requests.RequestException as err:
                    self.answers.append(type(err).__name__)


@pytest.fixture
def pays_nothing(engine):
    return make_org(engine, f"zero-{uuid.uuid4().hex[:8]}", usd="0", limit=1000)


def test_a_flood_of_huge_bodies_leaves_another_orgs_image_requests_served(
        start_gateway, fake, org, pays_nothing):
    gw = start_gateway(workers=1)
    url = gw.base_url + "/v1/chat/completions"
    body, served = image_body(), []
    with Flood(url, pays_nothing.key, huge_vision_body(), threads=3) as flood:
        # Under way: the flood holds the budget and has had a body parsed.
        while not flood.answers:
            served.append(post(url, body, org))
        served += [post(url, body, org) for _ in range(20)]
    assert served == [(200, None)] * len(served)
    # The flood's bodies were parsed and refused (400), or got a fast 503 for want of its share.
    assert flood.answers and set(flood.answers) <= {400, 503}, flood.answers
    assert 400 in flood.answers


DNS_CATALOG = """
[[models]]
id = "vision-named"
context_window = 32768
max_output_tokens = 1024
input = ["text", "image"]
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "http://localhost:{port}/v1", model = "upstream-vision", server = "openai" }}]
"""


def image_url_body(url):
    return json.dumps({"model": "vision-named", "max_tokens": 8, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "what is this?"},
                                    {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def test_slow_image_hosts_of_one_org_leave_another_orgs_requests_served(
        pg_url, fake, org, pays_nothing, tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(DNS_CATALOG.format(port=fake.port))
    with DnsServer({"images.example.com": ["93.184.216.34"]},
                   slow={".slow.example": 60}) as dns:
        # No flood lookup times out while the victim is served (20 s): the lookups the name
        # server is answering are those the gateway waits for.
        gw = Gateway(gateway_env(pg_url, catalog, image_nameservers=dns.nameserver,
                                 image_lookups_per_org=2, image_resolve_timeout_s=20),
                     workers=1).start()
        try:
            url = gw.base_url + "/v1/chat/completions"
            victim = image_url_body("https://images.example.com/cat.png")
            flood_body = lambda: image_url_body(  # noqa: E731 - a new slow name each time
                f"https://{uuid.uuid4().hex}.slow.example/cat.png")
            with Flood(url, pays_nothing.key, flood_body, threads=12) as flood:
                # The flood's lookups are under way, at the name server Kiln was given.
                wait_until(lambda: dns.in_flight >= 2, timeout_s=30)
                served = [post(url, victim, org) for _ in range(10)]
                in_flight = dns.max_in_flight
            assert served == [(200, None)] * 10
            # The flood got its lookups' timeouts (400) or no slot in time (503), its org
            # asking at most its 2 lookups at once.
            assert flood.answers and set(flood.answers) <= {400, 503}, flood.answers
            assert in_flight == 2
            assert fake.requests and all(r.json["model"] == "upstream-vision"
                                         for r in fake.requests)
        finally:
            gw.stop()
