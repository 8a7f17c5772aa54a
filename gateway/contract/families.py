"""Backend families: what each kind of model server reads, so that Kiln sends it only that.

A catalog backend names its family with ``server`` (default ``generic``). Model servers disagree
on length fields (llama-cpp-python ignores ``max_completion_tokens``; SGLang and vLLM take
``max_completion_tokens or max_tokens``; llama.cpp's own server lets ``n_predict`` override
``max_tokens``), on roles (chat templates that know no ``developer``) and on content shapes
(templates that expect a string where OpenAI allows an array of text parts). docs/PARAMETERS.md
has the table.
"""
from dataclasses import dataclass

SAMPLING = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                      "n", "stop", "logit_bias", "logprobs", "top_logprobs", "tools",
                      "tool_choice", "response_format"})

# What a backend is sent of each message, by role (an assistant's ``refusal``, ``audio`` and
# ``function_call`` are first rewritten by :func:`_assistant`), and of the object each content
# part carries. Messages are built anew from these keys: nothing Kiln did not check reaches a
# backend, and the client's objects are never modified.
# What a family reads of a legacy completions request besides ``prompt`` and the length
# (docs/PARAMETERS.md, "Completions").
TEXT_SAMPLING = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty",
                           "seed", "n", "stop", "logit_bias", "logprobs", "echo"})

SENT_KEYS = {"developer": ("role", "content", "name"), "system": ("role", "content", "name"),
             "user": ("role", "content", "name"),
             "assistant": ("role", "content", "name", "tool_calls"),
             "tool": ("role", "content", "tool_call_id")}
SENT_PART_KEYS = {"image_url": ("url", "detail"), "input_audio": ("data", "format"),
                  "file": ("file_data", "file_id", "filename")}


@dataclass(frozen=True)
class Family:
    """How one kind of model server reads a chat request."""

    name: str
    params: frozenset            # optional parameters it reads (docs/PARAMETERS.md)
    length_fields: tuple         # where it reads the completion cap; Kiln writes each
    developer_role: bool = False  # its chat templates know the ``developer`` role
    text_parts: bool = True       # it reads text content as an array of parts for every role
    running_usage: bool = False   # it can send the running usage in every stream chunk
    # It reads a named function as ``tool_choice`` (else only the strings: Kiln sends a named
    # choice as "required" with only that function in ``tools``, which forces the same call).
    named_tool_choice: bool = True
    # Legacy completions and embeddings (docs/PARAMETERS.md, "Completions", "Embeddings").
    completion_params: frozenset = TEXT_SAMPLING  # what it reads of a completions request
    prompt_arrays: bool = True    # it reads several completions prompts in one request
    token_prompts: bool = True    # it reads prompts and inputs given as token ids
    base64_embeddings: bool = True  # it answers ``encoding_format: "base64"``
    pooled_embeddings: bool = True  # one vector per input (else one per token: Kiln pools)
    # It fetches image URLs itself, from the operator's network, following redirects (vLLM,
    # SGLang, llama.cpp, llama-cpp-python; a server of unknown kind is taken to): a public
    # URL may redirect it to a private address, which Kiln cannot see. Such a model is sent
    # only URLs of the hosts its catalog vouches for (``image_hosts``); ``openai`` fetches
    # them from OpenAI's network, outside the operator's.
    follows_image_redirects: bool = True

    @property
    def completion_length_fields(self):
        """Where it reads the completions cap (``max_completion_tokens`` is chat's only)."""
        return tuple(f for f in self.length_fields if f != "max_completion_tokens")

    @property
    def stream_options(self):
        """The ``stream_options`` Kiln sends: usage always; vLLM's running usage where read."""
        options = {"include_usage": True}
        if self.running_usage:
            options["continuous_usage_stats"] = True
        return options

    def messages(self, messages):
        """Return ``messages`` in shapes this family reads (new dicts where changed; the
        client's objects are never modified)."""
        return [self._message(m) for m in messages]

    def _message(self, message):
        role = message["role"]
        if role == "function":  # deprecated: the answer to a function_call, by name
            return {"role": "tool", "tool_call_id": message["name"],
                    "content": message.get("content") or ""}
        if role == "assistant":
            message = _assistant(message)
        out = {k: message[k] for k in SENT_KEYS[role] if k in message}
        if role == "developer" and not self.developer_role:
            out["role"] = "system"
        content = out.get("content")
        if isinstance(content, list):
            out["content"] = ("".join(p["text"] for p in content)
                              if not self.text_parts and _only_text(content)
                              else [_part(p) for p in content])
        if out.get("tool_calls"):
            out["tool_calls"] = [_tool_call(c) for c in out["tool_calls"]]
            if out.get("content") is None and not self.text_parts:
                # OpenAI's tool-call turn has null content; llama-cpp-python's server refuses
                # it (500) and string templates render it as "None": an empty turn instead.
                out["content"] = ""
        return out


def _assistant(message):
    """Drop what only OpenAI's own platform reads (``refusal``, ``audio`` references); send a
    deprecated ``function_call`` as a tool call; a refusal part becomes text. A reply that was
    only a refusal or an audio reference keeps its turn: the refusal (or nothing) as content,
    since model servers' chat templates read an assistant turn's text from ``content``."""
    out = {k: v for k, v in message.items() if k not in ("refusal", "audio", "function_call")}
    call = message.get("function_call")
    if call is not None:
        out["tool_calls"] = list(out.get("tool_calls") or ()) + [
            {"id": call["name"], "type": "function",
             "function": {"name": call["name"], "arguments": call.get("arguments", "")}}]
    if out.get("content") is None and not out.get("tool_calls"):
        out["content"] = message.get("refusal") or ""
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [{"type": "text", "text": p["refusal"]} if p.get("type") == "refusal"
                          else p for p in content]
    return out


def _part(part):
    """A content part as sent: its type and the member carrying it, that member's own keys
    only (``prompt_cache_breakpoint``, OpenAI's cache hint, stays behind)."""
    kind = part["type"]
    value = part[kind]
    if isinstance(value, dict):
        value = {k: value[k] for k in SENT_PART_KEYS[kind] if k in value}
    return {"type": kind, kind: value}


def _tool_call(call):
    function = call["function"]
    return {"id": call["id"], "type": "function",
            "function": {k: function[k] for k in ("name", "arguments") if k in function}}


def _only_text(parts):
    return all(isinstance(p, dict) and p.get("type") == "text" for p in parts)


FAMILIES = {f.name: f for f in (
    # A server that implements OpenAI's chat API as published.
    Family("openai", SAMPLING | {"reasoning_effort"}, ("max_tokens", "max_completion_tokens"),
           developer_role=True, completion_params=TEXT_SAMPLING | {"suffix", "best_of"},
           follows_image_redirects=False),
    # Any OpenAI-compatible server: OpenAI's parameters, both length fields, no developer role.
    Family("generic", SAMPLING | {"reasoning_effort"}, ("max_tokens", "max_completion_tokens"),
           completion_params=TEXT_SAMPLING | {"suffix", "best_of"}),
    # vLLM: no suffix, and no best_of since its V1 engine.
    Family("vllm", SAMPLING | {"reasoning_effort", "ignore_eos", "min_tokens"},
           ("max_tokens", "max_completion_tokens"), running_usage=True,
           completion_params=TEXT_SAMPLING),
    Family("sglang", SAMPLING | {"reasoning_effort", "ignore_eos", "min_tokens"},
           ("max_tokens", "max_completion_tokens"),
           completion_params=TEXT_SAMPLING,
           base64_embeddings=False),
    # llama-cpp-python's server: reads max_tokens only; its templates want string content;
    # one choice per request whatever n asks. Completions and embeddings: one string prompt
    # per completions request, no token ids; embeddings as floats only, one vector per token
    # when the model has no pooling of its own (a chat model's GGUF).
    Family("llama-cpp-python", SAMPLING - {"n"}, ("max_tokens",), text_parts=False,
           completion_params=TEXT_SAMPLING - {"n"} | {"suffix"}, prompt_arrays=False,
           token_prompts=False, base64_embeddings=False, pooled_embeddings=False),
    # llama.cpp's own server (llama-server): n_predict overrides max_tokens; n must be 1; its
    # completions endpoint does not echo the prompt. It reads ``tool_choice`` as a string only
    # (tools/server/server-common.cpp, ``oaicompat_chat_params_parse``): a named function falls
    # back to "auto" with a warning in its log, and its own Messages endpoint sends Anthropic's
    # named choice as "required" (tools/server/server-chat.cpp).
    Family("llama.cpp", SAMPLING - {"n"} | {"ignore_eos"}, ("max_tokens", "n_predict"),
           text_parts=False, completion_params=TEXT_SAMPLING - {"n", "echo"},
           named_tool_choice=False),
)}


def family_of(name):
    """Return the :class:`Family` called ``name`` (the catalog checks names at load)."""
    return FAMILIES[name]
