"""How large an answer a request may ask for, and how large a whole reply to it can be
(docs/RELIABILITY.md, "Big answers"; gateway/contract/replies.py), in process: ``n ×
max_tokens × (1 + top_logprobs)`` (completions: ``max_tokens × best_of × prompts × (1 +
logprobs)``) above the model's ``max_reply_tokens`` is refused before admission, 400
``invalid_value`` naming the field; the bytes a reply may take follow from the request's own
limits."""
from types import SimpleNamespace

import pytest

from factories import model_entry
from gateway.config import Config
from gateway.contract import replies
from gateway.contract.catalog import CatalogError, _entry
from gateway.contract.legacy import validate_completion, validate_embeddings
from gateway.contract.validation import validate_chat
from gateway.errors import InvalidRequest
from gateway.flow.life import _reply_bound

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]
RAW = {"id": "m", "context_window": 4096, "max_output_tokens": 64,
       "pricing": {"input": "0.1", "cached_input": "0.05", "output": "0.3"},
       "backends": [{"url": "http://x/v1", "model": "m"}]}


def chat(entry=None, **fields):
    entry = entry or model_entry(max_output_tokens=16384)
    return validate_chat({"model": "m", "messages": MESSAGES, **fields}, {"m": entry}, 100)


def completion(entry=None, **fields):
    entry = entry or model_entry(max_output_tokens=16384, endpoints=("chat", "completions"))
    return validate_completion({"model": "m", "prompt": "hi", **fields}, {"m": entry}, 100)


def refusal(call, **fields):
    with pytest.raises(InvalidRequest) as err:
        call(**fields)
    assert err.value.status == 400 and err.value.code == "invalid_value"
    return err.value


# -- chat ---------------------------------------------------------------------------------

def test_n_times_top_logprobs_times_max_tokens_is_refused_naming_top_logprobs():
    err = refusal(chat, n=128, logprobs=True, top_logprobs=20, max_tokens=16384)
    assert err.param == "top_logprobs"
    assert "128 × 16384 × 21 = 44,040,192 tokens" in err.message
    assert "1,048,576" in err.message


def test_n_alone_and_the_model_maximum_are_refused_naming_n():
    err = refusal(chat, n=128)  # max_tokens: the model's 16,384
    assert err.param == "n" and "128 × 16384 × 1" in err.message


def test_requests_within_the_bound_pass_stream_or_not():
    assert chat(n=1, logprobs=True, top_logprobs=20, max_tokens=16384).n == 1
    assert chat(n=64, max_tokens=16384, stream=True).stream
    assert chat(n=128, logprobs=True, top_logprobs=20, max_tokens=390).n == 128


def test_top_logprobs_counts_only_with_logprobs():
    # logprobs without top_logprobs: one entry per token, as without them
    assert chat(n=64, logprobs=True, max_tokens=16384).n == 64
    refusal(chat, n=64, logprobs=True, top_logprobs=1, max_tokens=16384)


def test_the_bound_is_the_catalog_s():
    small = model_entry(max_output_tokens=4096, max_reply_tokens=1000)
    assert chat(small, max_tokens=1000).max_tokens == 1000
    err = refusal(chat, entry=small, max_tokens=1001)
    assert err.param == "max_tokens" and "above the 1,000 model 'm' allows" in err.message
    assert _entry({**RAW, "max_reply_tokens": 5}).max_reply_tokens == 5
    assert _entry(dict(RAW)).max_reply_tokens == replies.MAX_REPLY_TOKENS == 1 << 20
    for bad in (0, -1, "many", True, 1.5):
        with pytest.raises(CatalogError, match="max_reply_tokens"):
            _entry({**RAW, "max_reply_tokens": bad})


def test_the_reply_bound_follows_the_request_s_own_limits():
    plain = chat(n=2, max_tokens=100)
    assert plain.reply_bound == (replies.REPLY_BASE_BYTES + 2 * replies.CHOICE_BYTES
                                 + 200 * replies.TEXT_BYTES_PER_TOKEN)
    scored = chat(n=2, max_tokens=100, logprobs=True, top_logprobs=5)
    assert scored.reply_bound == plain.reply_bound + 200 * 6 * replies.LOGPROB_BYTES_PER_ENTRY
    # every token at its widest (64 bytes, each escaped as \u00XX) fits
    assert replies.TEXT_BYTES_PER_TOKEN >= 64 * len("\\u0000")


def test_extra_parameters_leave_the_setting_alone_to_bound_the_reply():
    entry = model_entry(max_output_tokens=16384, extra_params=("top_k",))
    assert chat(entry, top_k=5).reply_bound is None


def test_the_exchange_reads_the_smaller_of_the_request_s_bound_and_the_setting():
    services = SimpleNamespace(config=Config.from_mapping({"max_reply_bytes": 10 ** 6}))
    assert _reply_bound(services, chat(max_tokens=10)) == chat(max_tokens=10).reply_bound
    assert _reply_bound(services, chat(max_tokens=16384)) == 10 ** 6
    assert _reply_bound(services, SimpleNamespace(reply_bound=None)) == 10 ** 6


def test_the_default_setting_is_the_documented_one():
    assert Config().max_reply_bytes == 16 * 1024 * 1024


# -- legacy completions -------------------------------------------------------------------

def test_completions_logprobs_best_of_and_prompts_are_bounded_alike():
    err = refusal(completion, max_tokens=16384, best_of=20, n=1, logprobs=5)
    assert err.param == "logprobs" and "16384 × 20 × 1 × 6" in err.message
    err = refusal(completion, max_tokens=16384, n=128)
    assert err.param == "n"
    err = refusal(completion, max_tokens=16384, prompt=["a"] * 100)
    assert err.param == "prompt"
    assert completion(max_tokens=8192, best_of=20, logprobs=5).best_of == 20


def test_a_completions_reply_bound_covers_every_candidate_and_the_echo():
    plain = completion(max_tokens=100, best_of=4, n=2)
    assert plain.reply_bound == (replies.REPLY_BASE_BYTES + 2 * replies.CHOICE_BYTES
                                 + 400 * replies.TEXT_BYTES_PER_TOKEN)
    echoed = completion(max_tokens=100, best_of=4, n=2, echo=True, logprobs=0)
    assert echoed.reply_bound > plain.reply_bound


def test_embeddings_are_bounded_by_the_setting_alone():
    entry = model_entry(endpoints=("embeddings",))
    request = validate_embeddings({"model": "m", "input": "hi"}, {"m": entry}, 30)
    assert request.reply_bound is None
