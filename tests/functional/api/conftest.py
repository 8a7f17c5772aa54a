"""Fixtures of the API tests through the real gateway."""
import pytest
import requests


@pytest.fixture(scope="module")
def document(gateway):
    """The OpenAPI document the shared gateway serves (fetched without an API key)."""
    r = requests.get(gateway.base_url + "/openapi.json", timeout=30)  # no API key
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    return r.json()
