"""What a whole reply too large to relay is billed and how it ends (docs/METERING.md, "A reply
too large to relay"; docs/RELIABILITY.md, "Big answers"), in process: the backend answered and
generated, so the generation is billed Kiln's own counts (the prompt estimate, and at least one
token per 64 bytes read, never above the cap it held for), and it ends as
``upstream_error`` / 502 ``upstream_too_large``. A large reply under its bound gives the
worker's other greenlets a turn between the steps that hold the event loop."""
from types import SimpleNamespace

import gevent
import pytest

from factories import model_entry
from gateway.backends.spans import NO_SPANS
from gateway.billing import Usage
from gateway.dialects.chat import ChatCodec
from gateway.contract.validation import validate_chat
from gateway.endings import Status
from gateway.errors import UpstreamTooLarge
from gateway.flow.answers import LARGE_REPLY_BYTES, complete
from gateway.flow.generation import Admission, Generation
from gateway.contract.tokenizers import LocalTokenizers
from gateway.flow.metering import MAX_TOKEN_BYTES, Meter, oversized_completion
from gateway.flow.outcomes import outcome_for

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hello there"}]


def generation(oversized_bytes, accepted=True, **fields):
    request = validate_chat({"model": "m", "messages": MESSAGES, **fields},
                            {"m": model_entry()}, 100)
    exchange = SimpleNamespace(accepted=accepted, oversized_bytes=oversized_bytes,
                               count_tokens=lambda text: None)
    services = SimpleNamespace(ledger=SimpleNamespace(track=lambda gid, progress: None),
                               tokenizers=LocalTokenizers({}))
    return request, Generation(services, SimpleNamespace(), request,
                               Admission("gen-1", None, 0, 0.0), exchange, None)


@pytest.mark.parametrize("bytes_read, cap, billed", [
    (1, 100, 1),                                  # at least one token
    (MAX_TOKEN_BYTES * 10, 100, 10),              # one per 64 bytes read
    (MAX_TOKEN_BYTES * 10 + 1, 100, 11),
    (MAX_TOKEN_BYTES * 1000, 100, 100),           # never above the cap held for
    (10 ** 9, 0, 0),                              # nothing generated (embeddings)
])
def test_the_completion_billed_is_the_floor_of_the_bytes_read_within_the_cap(bytes_read, cap,
                                                                               billed):
    assert oversized_completion(bytes_read, cap) == billed


def test_an_oversized_reply_is_billed_the_prompt_and_what_its_bytes_hold():
    request, gen = generation(oversized_bytes=MAX_TOKEN_BYTES * 7, max_tokens=50)
    usage = gen.final_usage()
    assert usage.completion == 7 and usage.estimated
    assert usage.prompt_by == usage.completion_by == "bound"
    assert 0 < usage.prompt <= request.prompt_bound


def test_an_oversized_reply_over_its_own_bound_is_billed_its_cap():
    request, gen = generation(oversized_bytes=None, max_tokens=50, n=2)
    _, gen = generation(oversized_bytes=request.reply_bound + 1, max_tokens=50, n=2)
    assert gen.final_usage().completion == request.completion_cap == 100


def test_a_reply_not_taken_is_not_billed():
    _, gen = generation(oversized_bytes=None, accepted=False)
    usage = gen.final_usage()
    assert (usage.prompt, usage.completion) == (0, 0)


def test_it_ends_as_an_upstream_error_told_as_too_large():
    outcome = outcome_for(UpstreamTooLarge("too large", bytes_read=10))
    assert (outcome.status, outcome.http_status, outcome.code) == (
        Status.UPSTREAM_ERROR, 502, "upstream_too_large")


# -- a large reply under its bound gives the event loop turns --------------------------------

def run_complete(reply_bytes):
    """Drive gateway.flow.answers.complete over a tiny completion said to be
    ``reply_bytes`` long; return whether another greenlet ran before the head was yielded."""
    ran = []
    gevent.spawn(ran.append, True)
    gen = SimpleNamespace(meter=Meter(100), mark_first_token=lambda: None,
                          final_usage=lambda: Usage(prompt=1, completion=1))
    exchange = SimpleNamespace(reply_bytes=reply_bytes, spans=NO_SPANS,
                               send_and_read=lambda parse: parse(b'{"choices": []}'))
    path = complete(gen, exchange, SimpleNamespace(stop=(), single_tool_call=False),
                    ChatCodec())
    next(path)
    return bool(ran)


def test_a_large_reply_lets_the_worker_s_other_greenlets_run_between_its_steps():
    assert run_complete(LARGE_REPLY_BYTES)
    assert not run_complete(LARGE_REPLY_BYTES - 1)  # a small one costs no turn
