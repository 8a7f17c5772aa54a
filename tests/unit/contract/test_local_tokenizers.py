"""A model's local tokenizer (gateway/contract/tokenizers.py, docs/METERING.md): the GGUF
vocabulary rebuilt as a ``tokenizers`` Tokenizer counts exactly as llama.cpp itself does; a
tokenizer.json is read as it is; a tokenizer file that is missing or not a tokenizer fails the
catalog's load; one that cannot be built is logged, counted and leaves counting to the bound."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from gateway.contract.catalog import CatalogError, load_catalog
from gateway.contract.tokenizers import LocalTokenizers, TokenizerFileError, check_file, load
from model_server import gguf_path

# What a chat generation and its prompt hold: plain text, spaces at either end, digits,
# punctuation and contractions, code, every script and emoji (joiners, skin tones), invisible
# and odd spaces, long runs, and the chat template's special tokens, alone and inside text.
TEXTS = [
    "Hello, world!", "", " ", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\n\n\nx",
    "12345 67890 3.14159 1,000,000", "naïve café — ünïcödé", "日本語のテキスト、中文，한국어",
    "Ελληνικά и русский", "emoji 😀👍🏽 family 👨‍👩‍👧", "don't won't I'm we'll they've she'd",
    "code: def f(x):\n    return x**2  # comment", "\u200b\u00a0odd\u2028spaces\r\n",
    "a" * 300, "ÀÁÂ" * 20, "   \n  \n", "Ǆǅǆ ﬁ ﬂ", "x<|im_end|>y",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>x<file_sep>", "Once upon a time, in a land far away, there "
    "lived a dragon named Ember. 🐉 She guarded 3 golden eggs.",
]


@pytest.fixture(scope="module")
def smollm2():
    """``(our tokenizer, llama.cpp's vocabulary)`` of the SmolLM2 GGUF the model server uses."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the model server (make install-model)")
    path = gguf_path()
    return load(path), llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


@pytest.mark.parametrize("text", TEXTS)
def test_the_gguf_vocabulary_counts_as_llama_cpp_does(smollm2, text):
    ours, llama = smollm2
    theirs = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert ours.encode(text, add_special_tokens=False).ids == theirs


def test_the_special_tokens_are_one_token_each(smollm2):
    ours, _ = smollm2
    assert len(ours.encode("<|im_start|><|im_end|>", add_special_tokens=False).ids) == 2


def _word_level(path):
    """A small tokenizer.json: one token per word or punctuation mark."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "!": 3},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def _catalog(tmp_path, tokenizer):
    path = tmp_path / "models.toml"
    path.write_text(f'''[[models]]
id = "m"
context_window = 4096
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
tokenizer = {json.dumps(tokenizer)}
backends = [{{ url = "http://127.0.0.1:9/v1", model = "m" }}]
''')
    return path


def test_a_tokenizer_json_counts_its_own_tokens(tmp_path):
    _word_level(tmp_path / "tokenizer.json")
    entry = load_catalog(_catalog(tmp_path, "tokenizer.json"))["m"]  # relative to the catalog
    assert entry.tokenizer == str((tmp_path / "tokenizer.json").resolve())
    tokenizers = LocalTokenizers({"m": entry.tokenizer})
    assert tokenizers.count("m", "hello world ! ! unknown") == 5
    assert tokenizers.count("m", "hello " * 20_000) == 20_000  # a long text: in a thread
    assert tokenizers.count("other", "hello") is None  # no tokenizer: Kiln's bound applies


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    (b"# not a tokenizer\n", "neither a tokenizer.json nor a GGUF file"),
])
def test_a_missing_or_foreign_tokenizer_file_fails_the_catalog(tmp_path, content, message):
    if content is not None:
        (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(CatalogError, match=f"catalog entry 'm': tokenizer .*{message}"):
        load_catalog(_catalog(tmp_path, "tokenizer.json"))


def test_a_tokenizer_that_cannot_be_built_is_logged_counted_and_left_to_the_bound(tmp_path,
                                                                                   caplog):
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": "truncated')
    assert check_file(broken) == "json"  # what the catalog's load checks: it may pass
    with pytest.raises(TokenizerFileError, match="cannot be loaded"):
        load(broken)
    failures = []
    tokenizers = LocalTokenizers({"m": str(broken)}, on_failure=lambda *a: failures.append(a))
    assert tokenizers.count("m", "hello") is None
    assert tokenizers.count("m", "hello again") is None
    assert failures == [("m", "load")]  # built once per worker: tried once, counted once
    assert "tokenizer_unavailable" in caplog.text


def _gguf(path, model, pre):
    """A GGUF file holding only a vocabulary: ``a``, ``b``, ``ab`` (merged) and ``<s>``."""
    from gguf import GGUFWriter
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<s>"])
    writer.add_token_types([1, 1, 1, 3])  # <s>: a control token
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_small_gguf_vocabulary_is_rebuilt_with_its_merges_and_special_tokens(tmp_path):
    tokenizer = load(_gguf(tmp_path / "v.gguf", "gpt2", "smollm"))
    assert tokenizer.encode("ab<s>a", add_special_tokens=False).tokens == ["ab", "<s>", "a"]


@pytest.mark.parametrize("model, pre, message", [
    ("llama", "default", "GGUF vocabulary 'llama' is not supported"),
    ("gpt2", "qwen2", "GGUF pre-tokenizer 'qwen2' is not one of"),
])
def test_a_gguf_vocabulary_kiln_cannot_rebuild_exactly_is_refused_by_catalog_check(
        tmp_path, model, pre, message):
    from click.testing import CliRunner

    from gateway.ops.cli_catalog import catalog
    _gguf(tmp_path / "model.gguf", model, pre)
    path = _catalog(tmp_path, "model.gguf")
    assert load_catalog(path)["m"].tokenizer  # the load checks only the file's kind
    result = CliRunner().invoke(catalog, ["check", str(path)])
    assert result.exit_code == 1 and message in result.output
