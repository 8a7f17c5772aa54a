"""``GET /v1/models`` lists what the calling key may use: every model of the catalog for a key
without an allow-list, only the allow-list's for one with it (docs/ACTIVITY.md, keys)."""
import uuid

import requests

from gateway.api import auth
from gateway_proc import make_org


def listed(gateway, key):
    r = requests.get(gateway.base_url + "/v1/models", timeout=30,
                     headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return sorted(m["id"] for m in r.json()["data"])


def test_a_key_lists_only_the_models_it_may_use(gateway, engine):
    org = make_org(engine, f"models-{uuid.uuid4().hex[:8]}")
    every = listed(gateway, org.key)
    assert "fake-model" in every and len(every) > 1
    with engine.begin() as conn:
        narrow = auth.create_key(conn, org.id, name="narrow", allowed_models=["fake-model"])
    assert listed(gateway, narrow) == ["fake-model"]
    assert {"fake-vision", "gpt-oss-fake", "fake-embed"} <= set(every)
    refused = "fake-vision"
    r = requests.post(gateway.base_url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {narrow}"},
                      json={"model": refused, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403, r.text
