"""Checks shared by the Responses API's functional tests (docs/RESPONSES.md): its typed event
stream read back, a response billed exactly once on the meter chat uses, and the stored rows of
an org."""
import json
import time
from decimal import Decimal

import sqlalchemy as sa

from gateway_proc import balance_nanos, settled_event


def response_events(body):
    """The typed events of a relayed Responses stream (bytes), in order, as dicts; each
    ``event:`` line names its data's ``type``."""
    out = []
    for block in body.split(b"\n\n"):
        lines = block.split(b"\n")
        data = [line[6:] for line in lines if line.startswith(b"data: ")]
        if not data:
            continue
        obj = json.loads(b"\n".join(data), parse_float=Decimal)
        kind = [line[7:].decode() for line in lines if line.startswith(b"event: ")]
        assert kind == [obj["type"]], block
        out.append(obj)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def org_events(engine, org_id):
    """The org's usage events, oldest first."""
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT * FROM usage_events WHERE org_id = :o ORDER BY started_at"), {"o": org_id})
            .mappings()]


def assert_billed_once(engine, org, gids, costs, before):
    """Each generation id has one settled usage event of endpoint ``responses`` whose cost is
    what its answer's ``usage.cost`` told (``costs``, USD), the org has no other event, and
    its balance moved by exactly their sum (no hold, no lease left).

    :param before: the org's balance (nano-dollars) before these requests.
    :return: the events, in the order of ``gids``.
    """
    events = [settled_event(engine, gid) for gid in gids]
    assert sorted(e["id"] for e in org_events(engine, org.id)) == sorted(gids)
    for event, cost in zip(events, costs, strict=True):
        assert event["endpoint"] == "responses"
        assert Decimal(event["cost_nanos"]) / 10**9 == Decimal(str(cost))
    balance, held, in_flight = balance_nanos(engine, org.id)
    assert before - balance == sum(e["cost_nanos"] for e in events)
    assert (held, in_flight) == (0, 0)
    return events


def stored_ids(engine, org_id, expect=None, live=False):
    """The ids of the org's stored responses (table ``stored_responses``). With ``expect`` (a
    set), first wait up to 10 s for them to be that: a worker writes a response's row after its
    answer has left (docs/RESPONSES.md, "Stored responses"). With ``live``, only the rows not
    expired: a deleted response's row stays, expired, until the sweep."""
    live_only = " AND expires_at > now()" if live else ""

    def read():
        with engine.connect() as conn:
            return {r[0] for r in conn.execute(sa.text(
                "SELECT id FROM stored_responses WHERE org_id = :o" + live_only),
                {"o": org_id})}
    if expect is not None:
        deadline = time.monotonic() + 10
        while read() != expect and time.monotonic() < deadline:
            time.sleep(0.02)
    return read()


def stored_generations(engine, org_id, ids=()):
    """``{response id: generation id}`` of the org's stored responses: the usage event each
    stored response was billed as; first waiting up to 10 s for the rows of ``ids``, as
    :func:`stored_ids` does."""
    def read():
        with engine.connect() as conn:
            return dict(conn.execute(sa.text(
                "SELECT id, generation_id FROM stored_responses WHERE org_id = :o"),
                {"o": org_id}).all())
    deadline = time.monotonic() + 10
    while not set(ids) <= set(found := read()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def run_agent(base_url, key, model, prompt, tools=(), stream=False, instructions=None,
              **settings):
    """Run an ``openai-agents`` Agent against Kiln (its Responses model on an ``AsyncOpenAI``
    client with Kiln's base URL and key, tracing off); return the run's result, or raise what
    the run raised.

    :param settings: the Agent's ``ModelSettings`` (``temperature``, ``max_tokens``, ...)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def go():
        async with AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0,
                               timeout=120) as client:
            agent = Agent(name="assistant", instructions=instructions, tools=list(tools),
                          model=OpenAIResponsesModel(model=model, openai_client=client),
                          model_settings=ModelSettings(**settings))
            if not stream:
                return await Runner.run(agent, prompt, max_turns=4)
            result = Runner.run_streamed(agent, prompt, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result
    return asyncio.run(go())
