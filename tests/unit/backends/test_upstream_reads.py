"""Reading a backend's error answer (gateway/backends/upstream.py), in process: a compressed body
is inflated only up to the bound Kiln reads, however much it would inflate to. Through gunicorn:
functional/flow/test_upstream.py."""
import io
import tracemalloc
import zlib

import pytest

pytestmark = pytest.mark.unit


def test_a_compressed_error_body_is_inflated_only_to_the_bound():
    # 256 MiB of zeros in 256 KiB of gzip: what is read is 64 KiB, and so is what is inflated.
    import requests
    import urllib3

    from gateway.backends import upstream

    packer = zlib.compressobj(wbits=31)
    chunk = bytes(1 << 20)
    bomb = b"".join(packer.compress(chunk) for _ in range(256)) + packer.flush()
    resp = requests.Response()
    resp.headers["Content-Encoding"] = "gzip"
    resp.raw = urllib3.HTTPResponse(body=io.BytesIO(bomb), headers=resp.headers,
                                    preload_content=False, decode_content=False)  # as requests
    tracemalloc.start()
    try:
        body = upstream._read_small(resp)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert body == bytes(65536)
    assert peak < 8 << 20, peak
