"""A backend's chunked body, read as its bytes arrive, many chunks a read (RFC 9112, section
7.1, "Chunked Transfer Coding").

A streaming backend sends each event in an HTTP chunk of its own. urllib3's ``read1`` returns
one chunk (or part of one) per call, through http.client's chunk reader: 5.7 to 6.0 µs of CPU
per chunk in a worker, and then a pass through the pump's queue per chunk; urllib3's
``read_chunked`` costs less but returns a chunk only once all of it has arrived, so a backend
that sends one chunk slowly would be relayed late (bench/RESULTS.md, the relay). Here each read
takes whatever the connection has received, however many chunks, and :class:`Dechunker` strips
their framing in one pass: one read and one queued item for all the events that arrived
together, and what has arrived of a chunk is never held back.

Only a body that nothing has read yet, chunked, with no content coding, is read here
(:func:`chunked_reader`); any other is read by the caller with ``read1``. Once the last chunk
and its trailer section are in, :class:`ChunkedBody` closes http.client's response, as urllib3
does at the end of its own chunk reader, so that the connection can serve another request.
"""
import http.client

MAX_LINE = 65536  # a chunk's size line or a trailer line, extensions included (http.client's)
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class ChunkedBodyError(http.client.HTTPException):
    """The backend's chunked body is malformed or ended before its last chunk."""


def chunked_reader(resp):
    """The buffered reader of ``resp``'s connection (a ``requests`` response read with
    ``stream=True``) when its body is chunked, has no content coding and has not been read
    from; else None (read it with urllib3's ``read1``)."""
    raw = resp.raw
    original = getattr(raw, "_original_response", None)
    fp = getattr(original, "fp", None)
    if not raw.chunked or fp is None or getattr(original, "chunk_left", 0) is not None:
        return None
    if resp.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        return None
    return fp


class ChunkedBody:
    """``resp``'s chunked body (a ``requests`` response read with ``stream=True``), read as it
    arrives from its connection's buffered reader ``fp`` (:func:`chunked_reader`) by whichever
    greenlet calls :meth:`read`.

    An exception raised into that greenlet while it waits for the backend (a
    :class:`gevent.Timeout`, a kill) leaves the body as it was: nothing is taken from the
    connection before the wait ends, so the next :meth:`read` goes on where this one stopped
    (the relay waits this way, with its keepalive timer: :mod:`.reader`).

    :param read_size: the most bytes taken at once (also bounded by the reader's buffer).
    """

    __slots__ = ("_resp", "_fp", "_read_size", "_body")

    def __init__(self, resp, fp, read_size):
        self._resp, self._fp, self._read_size = resp, fp, read_size
        self._body = Dechunker()

    def fileno(self):
        """The connection's socket descriptor (to wait for it to be readable)."""
        return self._fp.fileno()

    @property
    def done(self):
        """The last chunk and its trailer section are in."""
        return self._body.done

    def read(self):
        """Read the connection once, waiting for it if nothing has arrived; return the data of
        the chunks, or parts of chunks, that read completes (bytes: empty when it held only
        framing, or at the end, :attr:`done`). At the end, close http.client's response (the
        connection may be reused).

        :raises ChunkedBodyError: malformed framing, or the connection closed before the end.
        :raises TimeoutError: the socket's read timeout passed with nothing read.
        """
        body, fp = self._body, self._fp
        if body.done:
            return b""
        # A quiet backend is waited for in the reader's own buffer (``peek``: one read of the
        # connection into it), then what it holds is taken. ``read1`` alone, on an empty
        # buffer, reads into a new object of ``read_size`` bytes, held as long as the backend
        # is quiet: 10 KiB more memory per open stream (bench/RESULTS.md, bursts).
        if not fp.peek(1):
            raise ChunkedBodyError("the connection closed before the body's last chunk")
        data = body.feed(fp.read1(self._read_size))
        if body.done:
            self._end()
        return data

    def _end(self):
        if self._body.extra:  # bytes after the body's end: the connection serves no other
            self._resp.raw.close()
        else:
            self._resp.raw._original_response.close()


class Dechunker:
    """The chunked coding's framing stripped from bytes fed in any pieces: :meth:`feed`
    returns the chunks' data they complete or continue. :attr:`done` once the last chunk and
    the trailer section (whose fields are dropped) are in; :attr:`extra` holds what came after.
    """

    __slots__ = ("done", "extra", "_pending", "_left", "_state")

    SIZE, DATA, DATA_END, TRAILER = range(4)

    def __init__(self):
        self.done, self.extra = False, b""
        self._pending = b""  # an unfinished line (a size line, a chunk's CRLF, a trailer)
        self._left = 0       # bytes of the current chunk's data still to come
        self._state = self.SIZE

    def feed(self, data):
        """Take ``data`` (bytes); return the chunk data it holds (bytes, maybe empty).

        :raises ChunkedBodyError: malformed framing.
        """
        if self.done:
            self.extra += data
            return b""
        if self._pending:
            data, self._pending = self._pending + data, b""
        out, pos, end = [], 0, len(data)
        while pos < end:
            state = self._state
            if state == self.DATA:
                take = min(self._left, end - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._state = self.DATA_END
                continue
            eol = data.find(b"\n", pos)
            if eol < 0:
                if end - pos > MAX_LINE:
                    raise ChunkedBodyError("a line of the chunked coding is too long")
                self._pending = data[pos:]
                break
            line, pos = data[pos:eol + 1], eol + 1
            if state == self.SIZE:
                size = _chunk_size(line)
                self._left, self._state = size, self.DATA if size else self.TRAILER
            elif state == self.DATA_END:
                if line not in (b"\r\n", b"\n"):
                    raise ChunkedBodyError("a chunk is not followed by CRLF")
                self._state = self.SIZE
            elif line in (b"\r\n", b"\n"):  # the trailer section's end: the body's
                self.done, self.extra = True, data[pos:]
                break
        if len(out) == 1:
            return out[0]
        return b"".join(out)


def _chunk_size(line):
    """The size of the chunk whose size line is ``line`` (hex digits, then extensions after a
    semicolon, which are ignored)."""
    if len(line) > MAX_LINE:
        raise ChunkedBodyError("a chunk size line is too long")
    digits = line.split(b";", 1)[0].strip(b" \t\r\n")
    if not digits or digits.strip(_HEX_DIGITS):  # empty, or more than hex digits
        raise ChunkedBodyError("a chunk size line is not a size")
    return int(digits, 16)
