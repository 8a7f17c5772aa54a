"""The OpenAPI description of ``POST /v1/completions`` and ``POST /v1/embeddings``
(docs/PARAMETERS.md, "Completions" and "Embeddings"; OpenAI's API reference for the shapes).
Model-dependent rules (the endpoints a model serves, ``suffix``, ``best_of``, ``dimensions``,
the input limits) follow ``GET /v1/models`` and the catalog, and are stated in descriptions."""
from ..contract.legacy import ENCODING_FORMATS, MAX_LOGPROBS, MAX_PROMPTS
from .openapi_common import error_responses, json_response
from .openapi_request import ref

TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                          "minItems": 1, "maxItems": MAX_PROMPTS},
                    TOKENS, {"type": "array", "items": TOKENS, "minItems": 1}]}
COUNT = {"type": "integer", "minimum": 0}


def legacy_paths():
    """Return the ``paths`` entries of the two endpoints."""
    errors = error_responses(400, 401, 402, 403, 404, 413, 429, 500, 502, 503)
    return {
        "/v1/completions": {"post": {
            "operationId": "createCompletion",
            "summary": "Create a text completion from raw prompts; JSON or an SSE stream. "
                       "Only on models whose `endpoints` list `completions` (else 400 "
                       "`unsupported_endpoint`).",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("CompletionRequest")}}},
            "responses": {"200": {"description": "A text_completion object, or its chunks as "
                                                 "an event stream.",
                                  "content": {"application/json": {
                                      "schema": ref("TextCompletion")},
                                      "text/event-stream": {"schema": {"type": "string"}}}},
                          **errors}}},
        "/v1/embeddings": {"post": {
            "operationId": "createEmbedding",
            "summary": "Create embeddings of the inputs, billed on their tokens; JSON only. "
                       "Only on models whose `endpoints` list `embeddings`.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("EmbeddingRequest")}}},
            "responses": {"200": json_response("The embeddings, in the inputs' order.",
                                               "EmbeddingList"), **errors}}},
    }


def legacy_schemas():
    """Return the schemas of the two endpoints' bodies and answers."""
    usage = {"type": "object", "required": ["prompt_tokens", "total_tokens", "cost"],
             "properties": {"prompt_tokens": COUNT, "completion_tokens": COUNT,
                            "total_tokens": COUNT, "cost": {"type": "number"},
                            "estimated": {"type": "boolean"}}}
    return {
        "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
            "model": {"type": "string"}, "prompt": PROMPT,
            "suffix": {"type": ["string", "null"]},
            "max_tokens": {"type": ["integer", "null"], "minimum": 0,
                           "description": "At most the model's max output (its default); 0 "
                                          "only with echo."},
            "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128},
            "best_of": {"type": ["integer", "null"], "minimum": 1},
            "echo": {"type": ["boolean", "null"]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "string"}, "maxItems": 4}, {"type": "null"}]},
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
            "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "seed": {"type": ["integer", "null"]},
            "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
            "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
            "logit_bias": {"type": ["object", "null"]}, "user": {"type": ["string", "null"]},
            "stream": {"type": ["boolean", "null"]},
            "stream_options": {"type": ["object", "null"], "properties": {
                "include_usage": {"type": "boolean"}}}}},
        "TextCompletion": {"type": "object", "required": ["object", "choices", "usage"],
                           "properties": {"id": {"type": "string"},
                                          "object": {"const": "text_completion"},
                                          "choices": {"type": "array"}, "usage": usage}},
        "EmbeddingRequest": {"type": "object", "required": ["model", "input"],
                             "additionalProperties": False, "properties": {
                                 "model": {"type": "string"}, "input": PROMPT,
                                 "encoding_format": {"enum": list(ENCODING_FORMATS)},
                                 "dimensions": {"type": "integer", "minimum": 1},
                                 "user": {"type": "string"}}},
        "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"],
                          "properties": {
                              "object": {"const": "list"}, "model": {"type": "string"},
                              "data": {"type": "array", "items": {
                                  "type": "object", "required": ["object", "index", "embedding"],
                                  "properties": {"object": {"const": "embedding"},
                                                 "index": COUNT,
                                                 "embedding": {"anyOf": [
                                                     {"type": "array",
                                                      "items": {"type": "number"}},
                                                     {"type": "string"}]}}}},
                              "usage": usage}},
    }
