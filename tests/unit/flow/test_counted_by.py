"""Which count a generation bills, in process (docs/METERING.md, "Which count applies"): with
the model's local tokenizer, a stream without usage is billed its exact count even when the
backend's tokenize route fails, and the progress the lease renewer records (what the sweeper
bills for a lost worker) is the same count, so a generation costs the same whether it was
settled or abandoned; without any tokenizer, the bound."""
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from factories import model_entry
from gateway.contract.tokenizers import LocalTokenizers
from gateway.contract.validation import validate_chat
from gateway.flow.generation import Admission, Generation

MESSAGES = [{"role": "user", "content": "tell me a story please"}]
DELTAS = ["once upon ", "a time ", "there was ", "a dragon"]  # 8 words, 35 bytes


@pytest.fixture
def words(tmp_path):
    """A local tokenizer.json: one token per word."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def streamed(tokenizers):
    """A generation whose backend sent DELTAS and no usage, and whose tokenize route fails."""
    request = validate_chat({"model": "m", "messages": MESSAGES, "stream": True,
                             "max_tokens": 100}, {"m": model_entry()}, 100)
    exchange = SimpleNamespace(accepted=True, oversized_bytes=None,
                               count_tokens=lambda text: None)
    services = SimpleNamespace(ledger=SimpleNamespace(track=lambda gid, progress: None),
                               tokenizers=tokenizers)
    gen = Generation(services, SimpleNamespace(), request, Admission("gen-1", None, 0, 0.0),
                     exchange, None)
    for delta in DELTAS:
        assert gen.meter.admit_chunk({"choices": [{"index": 0, "delta": {"content": delta}}]})
    return gen


def test_a_local_tokenizer_bills_the_exact_count_and_records_it_as_progress(words):
    gen = streamed(LocalTokenizers({"m": words}))
    progress = gen.progress()  # what a renewal records before the settlement
    usage = gen.final_usage()
    assert usage.completion == 8 and usage.completion_by == "tokenizer"
    assert usage.prompt == 5 + 8 + 32 and usage.prompt_by == "bound"  # words + allowance
    assert (progress.prompt, progress.completion) == (usage.prompt, usage.completion)


def test_without_a_tokenizer_the_bound_is_billed_and_said():
    gen = streamed(LocalTokenizers({}))
    usage = gen.final_usage()
    assert usage.completion == len("".join(DELTAS)) == 35 and usage.completion_by == "bound"
    assert usage.prompt == len(MESSAGES[0]["content"]) + 8 + 32 and usage.prompt_by == "bound"
