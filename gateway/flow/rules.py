"""The rules Kiln owns in a generation's output, whatever the client's dialect: the budget (the
meter), stop strings and the single-tool-call rule, applied to each chat chunk of a backend's
stream or to a whole chat completion.

A chunk that Kiln does not need to change keeps its ``data`` payload unchanged, byte for byte;
Kiln changes only usage (a running usage member is removed; the usage-only chunk is held for
the end, where the codec writes the billed usage), stop strings, and the single-tool-call rule.
A stop cut or a dropped tool call re-serialises the chunk. What the client's dialect makes of
the chunks is its codec's (:mod:`gateway.dialects`).
"""
import json
import re

from ..backends.sse import DONE, ErrorEvent, dumps, loads, without_member
from .metering import EchoSkip


class StopStrings:
    """An Aho-Corasick automaton over a request's stop strings (A. V. Aho and M. J. Corasick,
    "Efficient string matching", Communications of the ACM 18(6), 1975): text is read once,
    character by character, whatever the number of stop strings and however it is cut.

    A state is the longest end of the text read so far that begins some stop string; its depth
    is that end's length (below the longest stop string's, or a stop string ended there). Each
    character read costs one step, plus one per failure link followed, and a failure link
    shortens the state: the steps of a read are at most twice its characters plus the depth it
    started at (less than the longest stop string). At the root, characters that begin no stop
    string are skipped by one regular-expression search, counted as examined all the same.

    :attr:`examined`: the steps taken so far, characters skipped included (for the tests that
    hold the bound, docs/RELIABILITY.md).
    """

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.examined = 0
        goto, fail, self.depth, ends = [{}], [0], [0], [[]]
        for order, stop in enumerate(self.stops):
            state = 0
            for ch in stop:
                if ch not in goto[state]:
                    goto[state][ch] = len(goto)
                    goto.append({})
                    fail.append(0)
                    self.depth.append(self.depth[state] + 1)
                    ends.append([])
                state = goto[state][ch]
            ends[state].append((order, stop))
        queue = list(goto[0].values())
        for state in queue:  # breadth first: a failure link points to a shallower state
            for ch, child in goto[state].items():
                link = fail[state]
                while link and ch not in goto[link]:
                    link = fail[link]
                fail[child] = goto[link][ch] if state and ch in goto[link] else 0
                ends[child] = ends[child] + ends[fail[child]]  # the stop strings ending here
                queue.append(child)
        self._goto, self._fail, self._ends = goto, fail, ends
        self._first = re.compile("[" + "".join(re.escape(c) for c in goto[0]) + "]") \
            if goto[0] else None

    def search(self, text, state=0):
        """Read ``text`` from ``state``; return ``(state after it, hit)``.

        ``hit`` is ``(start, stop string)`` of the stop string that begins first (the earlier
        listed of two at one place), ``start`` relative to ``text``: negative when it began in
        what was read before (at most the depth of ``state`` back); or None. After a hit the
        text is read only as far as a stop string that begins earlier could end.
        """
        goto, fail, ends, first = self._goto, self._fail, self._ends, self._first
        best, limit, i, n = None, len(text), 0, len(text)
        while i < limit:
            if not state:
                found = first.search(text, i, limit) if first else None
                if found is None:
                    self.examined += limit - i
                    break
                self.examined += found.start() - i
                i = found.start()
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
                self.examined += 1
            state = goto[state].get(ch, 0)
            self.examined += 1
            for order, stop in ends[state]:
                hit = (i + 1 - len(stop), order)
                if best is None or hit < best:
                    best = hit
                    limit = min(n, best[0] + self.longest)
            i += 1
        return state, (None if best is None else (best[0], self.stops[best[1]]))


class StopCutter:
    """Cut generated text before the first stop string, across chunk boundaries.

    Model servers may generate past ``stop``; Kiln enforces it (README, "Request contract").
    Text that could be the start of a stop string is held back until the next delta decides.
    Each choice keeps its place in :class:`StopStrings`, so a delta costs steps linear in its
    length plus the longest stop string, however long the stream and however many near misses.
    """

    def __init__(self, stops):
        self.stops = stops
        self.automaton = StopStrings(stops)
        self._pending = {}  # choice index -> the text held back
        self._state = {}    # choice index -> the automaton's state after it
        self.finished = set()
        self.matched = {}  # choice index -> the stop string that ended it

    def feed(self, index, text):
        """Return ``(text to emit, hit)`` for a content delta of choice ``index``."""
        held = self._pending.pop(index, "")
        state, hit = self.automaton.search(text, self._state.pop(index, 0))
        text = held + text
        if hit is not None:
            start, stop = hit
            self.finished.add(index)
            self.matched[index] = stop
            return text[:len(held) + start], True
        keep = self.automaton.depth[state]
        if keep:
            self._pending[index], self._state[index] = text[-keep:], state
            text = text[:-keep]
        return text, False

    def flush(self, index):
        """Return the text held back for choice ``index`` (its stream ended)."""
        self._state.pop(index, None)
        return self._pending.pop(index, "")


def first_stop(text, stops):
    """Return ``(position, stop string)`` of the first stop string in ``text`` (the earlier
    listed of two at one position), or ``(-1, None)``; in one pass over ``text``."""
    _, hit = StopStrings(stops).search(text)
    return hit if hit is not None else (-1, None)


def cut_at_stop(text, stops):
    """Return ``(text before the first stop string, the stop string or None)``."""
    cut, stop = first_stop(text, stops)
    return (text[:cut], stop) if cut >= 0 else (text, None)


class StreamRules:
    """Apply Kiln's rules to each backend data payload of a chat stream, counting it.

    One JSON parse per event (:func:`gateway.backends.sse.loads`); a chunk keeps its exact
    bytes unless Kiln changes it (a stop cut, a dropped tool call, a usage member removed).
    Usage is Kiln's to tell: a usage-only chunk is held (:attr:`usage_payload`) for the codec to
    write at the end with the billed usage; a running usage member on a chunk with choices is
    removed.

    :param meter: :class:`gateway.flow.metering.Meter`; a chunk past its budget is not relayed and
        sets :attr:`cut`.
    :param stops: stop strings to enforce (may be empty).
    :param single_tool_call: keep only the first tool call (``index`` 0).
    :param echoed: ``{choice index: prompt text}`` a text completion echoes first: never cut.

    A text completion's chunks carry their text in ``choices[].text``; the same rules apply.
    """

    def __init__(self, meter, stops, single_tool_call, echoed=None):
        self.meter = meter
        self._echo = EchoSkip(echoed)
        self.cutter = StopCutter(stops) if stops else None
        self.single_tool_call = single_tool_call
        self.usage_payload = None  # the backend's usage-only chunk, held for the end
        self.indexes = set()       # choice indexes seen
        self.done = False          # the backend sent [DONE]
        self.error = None          # an error frame inside the stream, or a malformed event
        self.chunk_id, self.created, self.model = None, 0, None  # for chunks a codec writes
        self._calls = {}           # choice index -> CallNumbers
        self.events = 0            # data payloads received (empty ones and [DONE] included)

    @property
    def cut(self):
        """Kiln stopped the generation at its budget."""
        return self.meter.cut

    def _ended(self):
        return self.meter.finished | (self.cutter.finished if self.cutter else set())

    @property
    def finished(self):
        """Every choice seen carried a finish_reason (or was ended at a stop string)."""
        return bool(self.indexes) and self.indexes <= self._ended()

    def apply(self, payload):
        """Return ``(payload to relay, its object)`` for a backend data ``payload`` (bytes), or
        None to relay nothing. The returned payload is the backend's bytes when Kiln changed
        nothing."""
        self.events += 1
        if isinstance(payload, ErrorEvent):
            self._backend_error(_error_event(payload))
            return None
        if payload == DONE:
            self.done = True
            return None
        try:
            obj = loads(payload)
        except ValueError:
            obj = None
        if type(obj) is not dict:
            if not payload.strip(b" \t\n"):
                return None  # an empty message event (a bare ``data`` line) carries no chunk
            self.error = {"message": "the model backend sent an event that is not a JSON object"}
            return None
        if ("error" in obj or obj.get("object") == "error") and not obj.get("choices"):
            # {"error": {...}} (vLLM, SGLang, llama.cpp) or a bare {"object": "error", ...}
            self._backend_error(obj.get("error") or obj)
            return None
        choices = obj.get("choices")
        if type(choices) is list and not indexes_are_integers(choices):
            # A choice's index keys the rules' state and the meter's: a chunk that does not
            # say which choice it continues is malformed, as one that is not an object.
            self.error = {"message": "the model backend sent a choice whose index is not an "
                                     "integer"}
            return None
        if b"\n" in payload:
            # Several data lines joined (WHATWG HTML, "Server-sent events"): the client gets
            # one data line. A JSON text has no raw newline inside a string, so each one is
            # whitespace between tokens; a space keeps every other byte.
            payload = payload.replace(b"\n", b" ")
        if self.chunk_id is None:
            self.chunk_id, self.created, self.model = (obj.get("id"), obj.get("created"),
                                                       obj.get("model"))
        if not self.meter.admit_chunk(obj):
            return None  # past the budget: the caller ends the stream
        return self._apply(obj, payload)

    def failed(self, kind):
        """The stream failed (``kind``: :class:`gateway.backends.relay.StreamFailed`'s). One that
        the backend ended or broke off before any event is its refusal, like one whose first
        event is an error (llama-cpp-python answers a prompt over its context with an empty
        stream): nothing was generated, nothing is billed (docs/METERING.md). One Kiln gave up
        on (the idle timeout, an event too large) is billed as before: the backend was at work."""
        if not self.events and kind == "upstream_error":
            self.meter.refused = True

    def _backend_error(self, error):
        self.error = error
        if self.chunk_id is None and not self.meter.deltas:
            # Its first event, before any token: the backend refused the request
            # (docs/METERING.md): nothing is billed.
            self.meter.refused = True

    def _apply(self, obj, payload):
        choices = obj.get("choices")
        if not choices:
            if obj.get("usage") is not None:
                self.usage_payload = payload
                return None
            return payload, obj
        rewritten = False
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    self.indexes.add(choice.get("index", 0))
            if self.cutter or self.single_tool_call or _has_tool_calls(choices):
                rewritten = self._rewrite(obj, choices)
                if not obj["choices"]:
                    return None  # every choice of this chunk was already ended at a stop string
        if "usage" in obj:  # running usage, asked for by Kiln: not the client's
            stripped = None if rewritten else without_member(payload, b"usage")
            if stripped is not None:
                return stripped, obj
            del obj["usage"]
            rewritten = True
        return (dumps(obj), obj) if rewritten else (payload, obj)

    @property
    def matched_stops(self):
        """``{choice index: the stop string Kiln ended it at}``."""
        return self.cutter.matched if self.cutter else {}

    def open_choices(self):
        """Return the indexes of the choices seen that no finish reason or stop string ended
        (those Kiln's cut at the budget ends with ``finish_reason: "length"``)."""
        return sorted(self.indexes - self._ended()) or [0]

    def _rewrite(self, obj, choices):
        """Apply stop strings and the single-tool-call rule; return whether anything changed."""
        changed, kept = False, []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            index = choice.get("index", 0)
            if self.cutter and index in self.cutter.finished:
                changed = True
                continue  # Kiln already ended this choice at a stop string
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if self.cutter:
                    changed |= self._cut(choice, delta, index)
                if isinstance(delta.get("tool_calls"), list):
                    changed |= self._calls.setdefault(index, CallNumbers()).renumber(delta)
                if self.single_tool_call:
                    changed |= _first_tool_call_only(delta)
            elif self.cutter and isinstance(choice.get("text"), str):
                changed |= self._cut_text(choice, index)
            kept.append(choice)
        if changed:
            obj["choices"] = kept
        return changed

    def _cut(self, choice, delta, index):
        changed = False
        content = delta.get("content")
        if isinstance(content, str) and content:
            text, hit = self.cutter.feed(index, content)
            if hit:
                delta["content"], choice["finish_reason"] = text, "stop"
                return True
            if text != content:
                delta["content"], changed = text, True
        if choice.get("finish_reason"):
            rest = self.cutter.flush(index)
            if rest:
                delta["content"], changed = (delta.get("content") or "") + rest, True
        return changed


    def _cut_text(self, choice, index):
        """Apply the stop strings to a text completion's ``text``, after its echoed prompt."""
        echo, generated = self._echo.split(index, choice["text"])
        out, hit = self.cutter.feed(index, generated) if generated else ("", False)
        if hit:
            choice["text"], choice["finish_reason"] = echo + out, "stop"
            return True
        if choice.get("finish_reason"):
            out += self.cutter.flush(index)
        if out != generated:
            choice["text"] = echo + out
            return True
        return False


def _error_event(payload):
    """The error an ``event: error`` carries: its JSON's ``error`` object or the object itself
    (the Responses API's ``{"type": "error", "message": ...}``); data that is not a JSON object
    is not quoted."""
    try:
        obj = json.loads(payload)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return {"message": "the model backend sent an error event"}
    error = obj.get("error")
    return error if isinstance(error, dict) else obj


def indexes_are_integers(choices):
    """Whether every choice object of ``choices`` (a list) has an integer ``index`` (or
    none: 0)."""
    for choice in choices:
        if type(choice) is dict and type(choice.get("index", 0)) is not int:
            return False
    return True


def _has_tool_calls(choices):
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("tool_calls"):
            return True
    return False


class CallNumbers:
    """The ``index`` each streamed tool call of one choice has for the client.

    OpenAI numbers a choice's tool calls 0, 1, 2, ... and sends a call's ``id`` with its first
    fragment; clients (the openai SDKs) join fragments by ``index``. Some servers send every
    call at ``index`` 0, each with its own ``id``: relayed as they are, a client would join two
    calls into one. So a fragment with an ``id`` not seen before, at an index another call
    already has, is given the next free index, and the fragments after it (no ``id``) follow
    it; a server that numbers its calls keeps its numbers, byte for byte.
    """

    def __init__(self):
        self.by_id = {}    # call id -> client index
        self.current = {}  # backend index -> client index of the call now streamed there
        self.used = set()

    def renumber(self, delta):
        """Renumber ``delta``'s ``tool_calls`` in place; return whether any index changed."""
        changed = False
        for call in delta["tool_calls"]:
            if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
                continue
            given, call_id = call.get("index", 0), call.get("id")
            if isinstance(call_id, str) and call_id:
                index = self.by_id.get(call_id)
                if index is None:
                    index = given if given not in self.used else max(self.used) + 1
                    self.by_id[call_id] = index
                self.current[given] = index
            else:
                index = self.current.setdefault(given, given)
            self.used.add(index)
            if index != given:
                call["index"], changed = index, True
        return changed


def _first_tool_call_only(container):
    """Keep only the tool call of ``index`` 0; return whether ``container`` changed."""
    calls = container.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return False
    first = [c for c in calls if isinstance(c, dict) and c.get("index", 0) == 0]
    if len(first) == len(calls):
        return False
    if first:
        container["tool_calls"] = first
    else:
        del container["tool_calls"]
    return True


def apply_to_completion(obj, stops, single_tool_call, echoed=None):
    """Apply stop strings and the single-tool-call rule to a non-stream chat or text
    completion; return ``{choice index: the stop string Kiln cut it at}``.

    :param echoed: ``{choice index: prompt text}`` a text completion echoes first: never cut.
    """
    matched = {}
    for choice in obj.get("choices") or []:
        if stops and isinstance(choice, dict) and isinstance(choice.get("text"), str):
            index = choice.get("index", 0)
            echo, generated = EchoSkip(echoed).split(index, choice["text"])
            generated, stop = cut_at_stop(generated, stops)
            if stop is not None:
                choice["text"] = echo + generated
                choice["finish_reason"] = "stop"
                matched[index] = stop
            continue
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        if stops and isinstance(message.get("content"), str):
            message["content"], stop = cut_at_stop(message["content"], stops)
            if stop is not None:
                choice["finish_reason"] = "stop"
                matched[choice.get("index", 0)] = stop
        calls = message.get("tool_calls")
        if single_tool_call and isinstance(calls, list) and len(calls) > 1:
            message["tool_calls"] = calls[:1]
    return matched
