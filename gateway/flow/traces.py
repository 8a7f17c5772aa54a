"""What a generation tells its request's span (docs/TRACES.md): the OpenTelemetry GenAI
semantic conventions' attributes ("Semantic conventions for generative client AI spans",
``gen_ai.*``) and Kiln's own (``kiln.*``). Counts, names, ids and codes only: never a prompt,
a completion, a message or a key.
"""
from ..contract.validation import CHAT_ANSWER, EMBEDDINGS_ANSWER
from ..endings import Status

# The conventions' well-known gen_ai.operation.name values, by the kind of answer.
OPERATIONS = {CHAT_ANSWER: "chat", EMBEDDINGS_ANSWER: "embeddings"}
TEXT_COMPLETION = "text_completion"
# gen_ai.provider.name says whose API the client spoke (the conventions' flavour of attributes);
# every endpoint but Anthropic's Messages speaks OpenAI's.
PROVIDERS = {"messages": "anthropic"}
ENDED_WELL = (Status.COMPLETED, Status.CLIENT_CANCELLED)


def request_attributes(request, endpoint):
    """The span attributes of a request, known before admission.

    :param request: the canonical request (:class:`~gateway.contract.validation.ChatRequest`,
        or one of :mod:`gateway.contract.legacy`).
    :param endpoint: the codec's name (``chat``, ``messages``, ``responses``, ...).
    :returns: ``{attribute: str | int | bool}``.
    """
    provider = PROVIDERS.get(endpoint, "openai")
    out = {"gen_ai.operation.name": OPERATIONS.get(request.kind, TEXT_COMPLETION),
           "gen_ai.provider.name": provider, "gen_ai.system": provider,
           "gen_ai.request.model": request.entry.id, "kiln.endpoint": endpoint,
           "kiln.stream": bool(request.stream)}
    max_tokens = getattr(request, "max_tokens", None)
    if isinstance(max_tokens, int):
        out["gen_ai.request.max_tokens"] = max_tokens
    n = getattr(request, "n", None)
    if isinstance(n, int) and n != 1:
        out["gen_ai.request.choice.count"] = n
    return out


def ending_attributes(gen, outcome):
    """The span attributes of a settled generation: its id, the usage billed (the usage event's
    prompt and completion tokens), the cost, the ending status and code, the time to its first
    token; an ``error.type`` (the ending's code) when it failed.

    :param gen: the settled :class:`~gateway.flow.generation.Generation`.
    :param outcome: its :class:`~gateway.flow.outcomes.Outcome`.
    :returns: ``{attribute: str | int | float | bool}``.
    """
    usage = gen.usage
    out = {"kiln.generation_id": gen.gid, "kiln.org_id": gen.principal.org_id,
           "kiln.status": outcome.status.value, "kiln.attempts": len(gen.exchange.attempts)}
    if usage is not None:
        out.update({"gen_ai.usage.input_tokens": usage.prompt,
                    "gen_ai.usage.output_tokens": usage.completion,
                    "kiln.usage.cached_input_tokens": usage.cached,
                    "kiln.usage.estimated": bool(usage.estimated)})
    if gen.charged_usd is not None:
        out["kiln.cost_usd"] = str(gen.charged_usd)
    if gen.exchange.backend is not None:
        out["kiln.backend"] = gen.exchange.backend.url
    if gen.first_token_s is not None:
        out["kiln.time_to_first_token_s"] = gen.first_token_s
    if outcome.code:
        out["kiln.error_code"] = outcome.code
    if outcome.status not in ENDED_WELL:
        out["error.type"] = outcome.code or outcome.status.value
    return out
