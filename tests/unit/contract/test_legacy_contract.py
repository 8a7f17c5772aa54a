"""The completions and embeddings contracts, in process: the catalog's endpoints and prices,
the fields each endpoint has (against the openai SDK's own parameter types), the refusals, and
the body each backend family is sent."""
import typing

import pytest
from openai.types import completion_create_params, embedding_create_params

from factories import model_entry, pricing
from gateway.contract.catalog import CatalogError, _entry
from gateway.contract.catalog import Backend
from gateway.contract.legacy import (COMPLETION_PARAMETERS, EMBEDDING_PARAMETERS,
                                     validate_completion, validate_embeddings)
from gateway.contract.validation import validate_chat
from gateway.errors import InvalidRequest

pytestmark = pytest.mark.unit

RAW = {"id": "m", "context_window": 4096, "max_output_tokens": 64,
       "pricing": {"input": "0.1", "cached_input": "0.05", "output": "0.3"},
       "backends": [{"url": "http://x/v1", "model": "m"}]}


def catalog(server="generic", **changes):
    entry = model_entry(server=server, endpoints=("chat", "completions", "embeddings"),
                        **changes)
    return {"m": entry}


def test_the_tables_have_every_field_of_the_sdks_params():
    sdk = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    assert set(COMPLETION_PARAMETERS) == sdk | {"stream"}
    assert set(EMBEDDING_PARAMETERS) == set(
        typing.get_type_hints(embedding_create_params.EmbeddingCreateParams))


def test_catalog_endpoints_default_to_chat_and_are_checked():
    assert _entry(dict(RAW)).endpoints == ("chat",)
    assert _entry({**RAW, "endpoints": ["completions", "chat"]}).endpoints == (
        "completions", "chat")
    for bad in ([], ["chat", "chat"], ["images"], "chat"):
        with pytest.raises(CatalogError, match="endpoints"):
            _entry({**RAW, "endpoints": bad})


def test_an_embeddings_model_is_priced_on_input_only():
    entry = _entry({**RAW, "endpoints": ["embeddings"], "pricing": {"input": "0.02"}})
    assert (str(entry.pricing.input), str(entry.pricing.cached_input),
            str(entry.pricing.output)) == ("0.02", "0.02", "0")
    del_output = {k: v for k, v in RAW.items() if k != "max_output_tokens"}
    assert _entry({**del_output, "endpoints": ["embeddings"],
                   "pricing": {"input": "1"}}).max_output_tokens == 0
    with pytest.raises(CatalogError, match="output"):
        _entry({**RAW, "endpoints": ["embeddings"],
                "pricing": {"input": "0.02", "output": "1"}})
    with pytest.raises(CatalogError):  # a generating model needs its output price
        _entry({**RAW, "endpoints": ["completions"], "pricing": {"input": "0.02"}})


@pytest.mark.parametrize("endpoints, validate, body, message", [
    (("completions",), validate_chat, {"messages": [{"role": "user", "content": "x"}]},
     "This is not a chat model and thus not supported in the v1/chat/completions endpoint. "
     "Did you mean to use v1/completions?"),
    (("chat",), validate_completion, {"prompt": "x"},
     "This is a chat model and not supported in the v1/completions endpoint. Did you mean "
     "to use v1/chat/completions?"),
    (("chat",), validate_embeddings, {"input": "x"},
     "This model does not support the v1/embeddings endpoint. Did you mean to use "
     "v1/chat/completions?"),
])
def test_an_endpoint_the_model_does_not_serve_is_refused(endpoints, validate, body, message):
    cat = {"m": model_entry(endpoints=endpoints)}
    with pytest.raises(InvalidRequest) as err:
        validate({"model": "m", **body}, cat, 100)
    assert err.value.envelope()["error"] == {"message": message, "type": "invalid_request_error",
                                             "param": "model", "code": "unsupported_endpoint"}


def test_completion_body_per_family():
    body = {"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "suffix": "s", "stop": "x",
            "user": "u", "logprobs": 1, "stream": True}
    req = validate_completion(body, catalog("generic"), 200)
    assert req.path == "/completions" and req.completion_cap == 10
    sent = req.body_for(Backend(url="u", model="up", server="generic"))
    assert sent == {"model": "up", "prompt": ["a", "b"], "suffix": "s", "stop": "x",
                    "logprobs": 1, "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
    one = validate_completion({"model": "m", "prompt": "a", "max_tokens": 5},
                              catalog("llama.cpp"), 100)
    assert one.body_for(Backend(url="u", model="up", server="llama.cpp"))["n_predict"] == 5


@pytest.mark.parametrize("server, body, param", [
    ("vllm", {"prompt": "a", "suffix": "s"}, "suffix"),
    ("llama.cpp", {"prompt": "a", "echo": True}, "echo"),
    ("llama-cpp-python", {"prompt": ["a", "b"]}, "prompt"),
    ("llama-cpp-python", {"prompt": [1, 2]}, "prompt"),
    ("llama-cpp-python", {"prompt": "a", "n": 2}, "n"),
    ("vllm", {"prompt": "a", "best_of": 2}, "best_of"),
    ("generic", {"prompt": "a", "best_of": 2, "stream": True}, "best_of"),
    ("generic", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("generic", {"prompt": "a", "max_tokens": 1025}, "max_tokens"),
    ("generic", {"prompt": "a", "top_k": 3}, "top_k"),
])
def test_completion_refusals(server, body, param):
    with pytest.raises(InvalidRequest) as err:
        validate_completion({"model": "m", **body}, catalog(server), 100)
    assert err.value.param == param


def test_best_of_is_held_for_and_max_tokens_zero_needs_echo():
    req = validate_completion({"model": "m", "prompt": ["a", "b"], "max_tokens": 4,
                               "best_of": 3, "n": 2}, catalog(), 100)
    assert req.completion_cap == 4 * 3 * 2 and req.n_choices == 4
    assert req.echoed == {}
    echo = validate_completion({"model": "m", "prompt": ["a", "b"], "max_tokens": 0,
                                "echo": True, "n": 2}, catalog(), 100)
    assert echo.completion_cap == 0 and echo.echoed == {0: "a", 1: "a", 2: "b", 3: "b"}
    tokens = validate_completion({"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 1,
                                  "echo": True}, catalog(), 100)
    assert tokens.completion_cap == 1 + 3  # the echo of token ids is counted, and held for


def test_embeddings_request_bounds_and_body():
    cat = catalog("llama-cpp-python", embedding_max_inputs=2, embedding_max_input_tokens=3)
    req = validate_embeddings({"model": "m", "input": ["ab", "c"],
                               "encoding_format": "base64"}, cat, 60)
    assert req.completion_cap == 0 and req.prompt_bound == 6  # 2 inputs x 3 tokens
    assert req.body_for(Backend(url="u", model="e", server="llama-cpp-python")) == {
        "model": "e", "input": ["ab", "c"], "encoding_format": "float"}
    assert req.body_for(Backend(url="u", model="e", server="vllm"))["encoding_format"] == \
        "base64"
    for body, param in (({"input": ["a", "b", "c"]}, "input"), ({"input": [[1, 2, 3, 4]]},
                                                                "input[0]"),
                        ({"input": "a", "dimensions": 3}, "dimensions")):
        with pytest.raises(InvalidRequest) as err:
            validate_embeddings({"model": "m", **body}, cat, 60)
        assert err.value.param == param
    dims = validate_embeddings({"model": "m", "input": "a", "dimensions": 3},
                               catalog(dimensions=True, pricing=pricing()), 60)
    assert dims.body_for(Backend(url="u", model="e"))["dimensions"] == 3
