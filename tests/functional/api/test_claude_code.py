"""Claude Code (npm ``@anthropic-ai/claude-code``, print mode) against Kiln's ``/v1/messages``
and the scripted fake upstream: a session in which the model calls a tool and then answers
completes, and every request Claude Code sent is billed exactly once (docs/MESSAGES.md,
"Claude Code").

The fake upstream answers by what the chat body it is sent holds: a conversation with a tool
result gets the final answer, one whose tools include ``Read`` gets a ``Read`` tool call, any
other a short text; JSON or a stream, as asked.
"""
import json
from decimal import Decimal

import pytest

import claude_code
from factories import fake_model_nanos
from fake_upstream import chat_chunk, chat_completion, json_reply, make_usage, sse
from gateway_proc import balance_nanos, wait_until
from streams import GRANT, org_events

ANSWER = "The note says: kiln-tool-result-7341."
NOTE = "kiln-tool-result-7341"


@pytest.fixture(scope="module")
def claude():
    binary = claude_code.installed()
    if binary is None:
        pytest.skip("npm is absent: Claude Code cannot be installed")
    return binary


def tool_messages(chat):
    return [m for m in chat.get("messages", []) if m.get("role") == "tool"]


def reply(chat, content=None, tool_calls=None, usage=None):
    """The fake's answer to ``chat`` (a chat body): JSON or a stream, as it asked."""
    usage = usage or make_usage(prompt=900, completion=12)
    finish = "tool_calls" if tool_calls else "stop"
    if not chat.get("stream"):
        return json_reply(chat_completion(content, usage=usage, finish_reason=finish,
                                          tool_calls=tool_calls))
    events = [chat_chunk(content, role="assistant")] if content else []
    for k, call in enumerate(tool_calls or ()):
        head = {"index": k, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        args = call["function"]["arguments"]
        events += [chat_chunk(tool_calls=[head]),
                   chat_chunk(tool_calls=[{"index": k, "function": {"arguments": args[:9]}}]),
                   chat_chunk(tool_calls=[{"index": k, "function": {"arguments": args[9:]}}])]
    events.append(chat_chunk(finish_reason=finish))
    if (chat.get("stream_options") or {}).get("include_usage"):
        events.append(chat_chunk(choices=False, usage=usage))
    return sse(events)


def session_responder(note_path):
    def respond(record):
        chat = record.json if isinstance(record.json, dict) else {}
        if tool_messages(chat):
            return reply(chat, content=ANSWER)
        names = {t["function"]["name"] for t in chat.get("tools") or ()}
        if "Read" in names:
            call = {"id": "call_read_1", "type": "function",
                    "function": {"name": "Read",
                                 "arguments": json.dumps({"file_path": str(note_path)})}}
            return reply(chat, tool_calls=[call])
        return reply(chat, content="ok")
    return respond


def test_a_tool_call_session_completes_and_each_request_is_billed_once(
        claude, gateway, fake, org, engine, tmp_path):
    workdir = tmp_path / "project"
    workdir.mkdir()
    note = workdir / "note.txt"
    note.write_text(NOTE + "\n")
    fake.default = session_responder(note)
    done = claude_code.run(claude, gateway.base_url, org.key, "fake-model",
                           "Read note.txt and tell me what it says.", cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert ANSWER in done.stdout
    chats = [r.json for r in fake.requests if r.method == "POST"]
    # Claude Code asks for 32,000 or more output tokens whatever the model: lowered to
    # fake-model's maximum output, 1024, and held for at that
    assert chats and {c["max_tokens"] for c in chats} == {1024}
    results = [m for c in chats for m in tool_messages(c)]
    assert results and NOTE in json.dumps(results)  # the tool ran, its result went back
    events = wait_until(lambda: (es := org_events(engine, org.id))
                        and all(e["status"] != "pending" for e in es) and es)
    assert {e["endpoint"] for e in events} == {"messages"}
    assert len(events) == len(chats)  # one usage event per request the backend answered
    assert all(e["status"] == "completed" for e in events)
    for e in events:
        assert e["cost_nanos"] == fake_model_nanos(e["prompt_tokens"], e["completion_tokens"])
    assert balance_nanos(engine, org.id) == (GRANT - sum(e["cost_nanos"] for e in events), 0, 0)
    assert Decimal(0) < sum(Decimal(e["cost_nanos"]) for e in events)
    # Every request it sent to Kiln: each a generation of its own (no count_tokens call, no
    # refused request); the one other thing it sends is an unauthenticated HEAD / (a
    # reachability check that does not read the answer's status).
    logged = gateway.log_events(org_id=org.id)
    assert sorted(e["generation_id"] for e in logged if e["event"] == "generation") == \
        sorted(e["id"] for e in events)
    assert [e for e in logged if e["event"] == "request"] == []
