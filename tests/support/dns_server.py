"""A tiny authoritative DNS server over UDP on 127.0.0.1, for the image-host resolver's tests
and bench/isolation.py: it answers A and AAAA queries from a table, NXDOMAIN for any other
name, and can be told to answer some names only after a delay (a slow name server).

    with DnsServer({"images.example.com": ["93.184.216.34"]}, slow={"slow.example.com": 5})
            as dns:
        dns.nameserver  # "127.0.0.1:PORT", for KILN_IMAGE_NAMESERVERS
"""
import socket
import threading
import time

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

TTL_S = 60


class DnsServer:
    """Answers from ``records`` (name -> addresses, IPv4 and IPv6 mixed); names in ``slow``
    (name -> seconds, or a suffix ``.example`` matching every name under it) are answered
    after that delay, each on its own thread so one slow query holds up no other."""

    def __init__(self, records=None, slow=None):
        self.records = {k.lower().rstrip("."): v for k, v in (records or {}).items()}
        self.slow = dict(slow or {})
        self.queries = []  # names asked, in order
        self.in_flight = self.max_in_flight = 0  # slow queries being answered, and the peak
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.nameserver = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._sock.close()
        self._thread.join(5)

    def asked(self, name):
        """How many queries named ``name`` (A and AAAA count apart)."""
        with self._lock:
            return sum(1 for q in self.queries if q == name)

    def _serve(self):
        while True:
            try:
                data, peer = self._sock.recvfrom(4096)
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(data, peer), daemon=True).start()

    def _delay_s(self, name):
        for key, seconds in self.slow.items():
            if name == key or key.startswith(".") and name.endswith(key):
                return seconds
        return 0

    def _answer(self, data, peer):
        try:
            query = dns.message.from_wire(data)
        except Exception:  # noqa: BLE001 - not DNS: ignored, as a server would
            return
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        with self._lock:
            self.queries.append(name)
        delay_s = self._delay_s(name)
        if delay_s:
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            time.sleep(delay_s)
            with self._lock:
                self.in_flight -= 1
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        if name not in self.records:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        else:
            kind = dns.rdatatype.to_text(question.rdtype)
            found = [a for a in self.records[name] if (":" in a) == (kind == "AAAA")]
            if found and kind in ("A", "AAAA"):
                reply.answer.append(dns.rrset.from_text_list(question.name, TTL_S, "IN", kind,
                                                             found))
        try:
            self._sock.sendto(reply.to_wire(), peer)
        except OSError:
            pass
