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


@dataclass(frozen=True)
class Family:
    """How one kind of model server reads a chat request."""

    name: str
    params: frozenset            # optional OpenAI (or reference) parameters it reads
    length_fields: tuple         # where it reads the completion cap; Kiln writes each
    developer_role: bool = False  # its chat templates know the ``developer`` role
    text_parts: bool = True       # it reads text content as an array of parts for every role
    running_usage: bool = False   # it can send the running usage in every stream chunk

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
        out = message
        if role == "developer" and not self.developer_role:
            out = {**out, "role": "system"}
        elif role == "function":  # deprecated: the answer to a function_call, by name
            out = {"role": "tool", "tool_call_id": message["name"],
                   "content": message.get("content") or ""}
        if role == "assistant":
            out = _assistant(out)
        content = out.get("content")
        if isinstance(content, list) and not self.text_parts and _only_text(content):
            out = {**out, "content": "".join(p["text"] for p in content)}
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


def _only_text(parts):
    return all(isinstance(p, dict) and p.get("type") == "text" for p in parts)


FAMILIES = {f.name: f for f in (
    # A server that implements OpenAI's chat API as published.
    Family("openai", SAMPLING | {"reasoning_effort"}, ("max_tokens", "max_completion_tokens"),
           developer_role=True),
    # Any OpenAI-compatible server: OpenAI's parameters, both length fields, no developer role.
    Family("generic", SAMPLING | {"reasoning_effort"}, ("max_tokens", "max_completion_tokens")),
    Family("vllm", SAMPLING | {"reasoning_effort", "ignore_eos", "min_tokens"},
           ("max_tokens", "max_completion_tokens"), running_usage=True),
    Family("sglang", SAMPLING | {"reasoning_effort", "ignore_eos", "min_tokens"},
           ("max_tokens", "max_completion_tokens")),
    # llama-cpp-python's server: reads max_tokens only; its templates want string content;
    # one choice per request whatever n asks.
    Family("llama-cpp-python", SAMPLING - {"n"}, ("max_tokens",), text_parts=False),
    # llama.cpp's own server (llama-server): n_predict overrides max_tokens; n must be 1.
    Family("llama.cpp", SAMPLING - {"n"} | {"ignore_eos"}, ("max_tokens", "n_predict"),
           text_parts=False),
)}


def family_of(name):
    """Return the :class:`Family` called ``name`` (the catalog checks names at load)."""
    return FAMILIES[name]
