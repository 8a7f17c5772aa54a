"""A model's own tokenizer, run by Kiln: exact token counts without asking a backend
(docs/METERING.md, "Kiln's own counts").

The catalog may give a model ``tokenizer = "PATH"``: a Hugging Face ``tokenizer.json`` (as vLLM
and SGLang models ship) or a GGUF model file (llama.cpp), whose vocabulary is built into the same
kind of tokenizer (the ``tokenizers`` library). Only the file's kind is checked when the catalog
is loaded (:func:`check_file`); the tokenizer itself is built once per worker, lazily, in a
thread of the worker's pool so that its event loop keeps serving (:class:`LocalTokenizers`).

GGUF vocabularies supported are llama.cpp's byte-level BPE (``tokenizer.ggml.model`` "gpt2")
with a pre-tokenizer whose rules are known here (:data:`PRE_TOKENIZERS`); any other is refused
when it is built, naming what it found. Counts take special tokens (``<|im_start|>``, ...) as
the single tokens they are, as llama.cpp's ``tokenize`` does with ``special=True``.
"""
import json
import logging

import gevent
from gevent.lock import Semaphore

log = logging.getLogger("kiln.tokenizers")

GGUF_MAGIC = b"GGUF"
# llama.cpp's token types (llama_token_type): control and user-defined tokens are matched whole.
CONTROL, USER_DEFINED = 3, 4
# GPT-2's split, as llama.cpp writes it (llama-vocab.cpp), and SmolLM's: digits one by one, then
# GPT-2's split (the same as Hugging Face's Digits(individual_digits) + ByteLevel).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIGITS_THEN_GPT2 = "digits-then-gpt2"
# tokenizer.ggml.pre -> how the text is split before BPE (llama.cpp's llm_tokenizer_bpe groups).
PRE_TOKENIZERS = {"gpt-2": "gpt2", "smollm": DIGITS_THEN_GPT2, "starcoder": DIGITS_THEN_GPT2,
                  "refact": DIGITS_THEN_GPT2, "codeshell": DIGITS_THEN_GPT2}


# A text this long or longer is counted in the worker's thread pool, so that the event loop
# keeps serving the other streams meanwhile (a megabyte takes a good part of a second).
THREAD_CHARS = 64 * 1024


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be used: missing, unreadable, or not a tokenizer."""


def check_file(path):
    """Check that ``path`` can be read and is a GGUF file or a JSON object; return its kind,
    ``"gguf"`` or ``"json"``. Cheap: the first bytes only.

    :raises TokenizerFileError: missing or unreadable file, or neither kind.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as err:
        raise TokenizerFileError(f"tokenizer {path} cannot be read ({err.strerror})") from None
    if head.startswith(GGUF_MAGIC):
        return "gguf"
    if head.lstrip().startswith(b"{"):
        return "json"
    raise TokenizerFileError(f"tokenizer {path} is neither a tokenizer.json nor a GGUF file")


def load(path):
    """Build the tokenizer in ``path`` (slow: seconds for a GGUF file; run it off the event
    loop). Return a ``tokenizers.Tokenizer``.

    :raises TokenizerFileError: the file cannot be read or parsed, or its vocabulary is not
        one Kiln can rebuild exactly.
    """
    from tokenizers import Tokenizer
    kind = check_file(path)
    try:
        if kind == "json":
            return Tokenizer.from_file(str(path))
        return from_gguf(path)
    except TokenizerFileError:
        raise
    except Exception as err:  # noqa: BLE001 - the libraries raise anything on a bad file
        raise TokenizerFileError(f"tokenizer {path} cannot be loaded: {err}") from err


def from_gguf(path):
    """Build a ``tokenizers.Tokenizer`` equal to llama.cpp's for the byte-level BPE vocabulary
    of a GGUF file: its tokens, merges, pre-tokenizer and special tokens.

    :raises TokenizerFileError: a vocabulary other than "gpt2", or an unknown pre-tokenizer.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    fields = GGUFReader(path).fields

    def value(name, default=None):
        return fields[name].contents() if name in fields else default
    model, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise TokenizerFileError(f"tokenizer {path}: GGUF vocabulary {model!r} is not supported "
                                 f"(byte-level BPE, \"gpt2\", is); give its tokenizer.json")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerFileError(f"tokenizer {path}: GGUF pre-tokenizer {pre!r} is not one of "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}; give its tokenizer.json")
    tokens, types = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = pre_tokenizers.Split(Regex(GPT2_SPLIT), behavior="isolated")
    steps = [split, byte_level]
    if PRE_TOKENIZERS[pre] == DIGITS_THEN_GPT2:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED)])
    return tokenizer


def _count(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


class LocalTokenizers:
    """The catalog's local tokenizers for one worker: each built once, on first use or by
    :meth:`warm`, in the worker's thread pool; counts are exact.

    :param paths: ``{model id: tokenizer path}`` of the models that have one.
    :param on_failure: ``(model id, reason) -> None``, called when a count cannot be made
        (the metric).
    """

    def __init__(self, paths, on_failure=None):
        self.paths = dict(paths)
        self.on_failure = on_failure
        self._built = {}  # path -> Tokenizer, or the TokenizerFileError it raised
        self._lock = Semaphore()

    def has(self, model):
        """Whether ``model`` has a local tokenizer in the catalog."""
        return model in self.paths

    def count(self, model, text):
        """Return the exact token count of ``text`` by ``model``'s local tokenizer, or None
        when it has none or it could not be built (logged and counted once per worker)."""
        tokenizer = self.get(model)
        if tokenizer is None:
            return None
        if len(text) < THREAD_CHARS:
            return _count(tokenizer, text)
        return gevent.get_hub().threadpool.apply(_count, (tokenizer, text))

    def get(self, model):
        """Return ``model``'s tokenizer (built now if it was not yet), or None."""
        path = self.paths.get(model)
        if path is None:
            return None
        built = self._built.get(path)
        if built is None:
            with self._lock:  # one build per path; other greenlets wait for it
                built = self._built.get(path)
                if built is None:
                    built = self._built[path] = self._build(model, path)
        return None if isinstance(built, TokenizerFileError) else built

    def warm(self):
        """Build every tokenizer now (at worker start, in the background)."""
        for model in self.paths:
            self.get(model)

    def _build(self, model, path):
        try:
            return gevent.get_hub().threadpool.apply(load, (path,))
        except TokenizerFileError as err:
            log.error(json.dumps({"event": "tokenizer_unavailable", "model": model,
                                  "error": str(err)}))
            if self.on_failure is not None:
                self.on_failure(model, "load")
            return err
