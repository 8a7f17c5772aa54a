"""The ledger's greenlets in one worker process: they group the statements of many requests.

- :class:`Admitter`: the admissions that arrive while one is being decided go to the database
  together, in one statement (one lock of each org row, one commit); alone, a request is
  admitted at once.
- :class:`SettlementWriter`: settlements are committed in batches (one durable commit for
  all of them), retried on any database error until they commit.
- :class:`Renewer`: every live lease of the worker is renewed in one statement, with progress.

An admission never waits for a timer: each batch takes what is queued when the previous one is
done, so at low load nothing is delayed and at high load the statements per request fall. A
settlement batch, which no client waits for unless it says so (``urgent``), first lets this
worker's next admission go (at most :data:`SETTLE_DEFER_S`): the next request of a client is
admitted while the database is free, instead of behind the settlement of its last answer, whose
org row the admission needs and whose work would share the database's core with it
(bench/RESULTS.md, "The settlement after the next admission").

A statement the database refuses for the values it carries (:func:`refused_for_its_data`) is
never retried as it is: its batch is split until the one settlement or lease at fault stands
alone, so that it cannot hold up the worker's others (docs/RELIABILITY.md, "A worker never
stops settling").
"""
import logging
import random
import time

import gevent
import sqlalchemy as sa
from gevent.event import AsyncResult, Event
from gevent.queue import Empty, Queue

from ..background import Background

log = logging.getLogger("gateway.ledger")

MAX_BATCH = 256                # statements' rows grouped at most
RENEW_EVERY_MAX_S = 5.0        # progress recorded at least this often (what a kill can lose)
RETRY_BACKOFF_S = (0.05, 2.0)  # first and longest wait between attempts of a failed write
# The longest a settlement batch waits for the worker's next admission to be answered. About one
# client's turn at one connection (its next request arrives a fraction of a millisecond after
# the answer, and is admitted in under one); a worker with no next request writes then.
SETTLE_DEFER_S = 0.002
# SQLSTATE classes of a statement refused for its values (SQL standard; PostgreSQL manual,
# Appendix A): 22 data exception (a value out of its column's range or length), 23 integrity
# constraint violation. No retry can make such a statement commit.
REFUSED_CLASSES = ("22", "23")


def refused_for_its_data(err):
    """Tell whether ``err`` (a driver's or SQLAlchemy's) is the database refusing the values a
    statement carried, rather than failing to run it (a lost connection, a timeout, a restart:
    those are retried)."""
    orig = getattr(err, "orig", None) or err
    state = getattr(orig, "sqlstate", None)
    if isinstance(state, str):
        return state[:2] in REFUSED_CLASSES
    return isinstance(err, (sa.exc.DataError, sa.exc.IntegrityError))


def take_batch(queue, first):
    """Return ``[first]`` and whatever else is queued now, up to :data:`MAX_BATCH`."""
    batch = [first]
    while len(batch) < MAX_BATCH:
        try:
            batch.append(queue.get_nowait())
        except Empty:
            break
    return batch


class Admitter:
    """Decides admissions in batches (``store.admit_batch``); :meth:`admit` waits for its own.

    A batch is ordered by org, so that every batch locks org rows in the same order. A request
    that stops waiting (its deadline passed while the database was stalled) and is admitted
    after all, or in the same turn of the event loop, is handed to ``on_orphan(request, row)``,
    which settles it at once.
    """

    def __init__(self, store, on_orphan=None, background=None, on_answered=None):
        self.store = store
        self.on_orphan = on_orphan
        self.on_answered = on_answered  # () -> None, once each batch is answered
        self._queue = Queue()
        self._background = background or Background()

    def admit(self, request, timeout_s=None):
        """Return the admission row for ``request`` (see ``kiln_admit``); raise what the
        database call raised, or :class:`gevent.Timeout` after ``timeout_s``."""
        self._background.spawn("ledger.admitter", self._run)
        waiter = _Waiter(request)
        self._queue.put(waiter)
        try:
            return waiter.result.get(timeout=timeout_s)
        except BaseException:
            waiter.orphaned = True
            # The deadline and the answer can fall in one turn of the event loop: the result
            # is then set, yet the timeout is raised (gevent's AsyncResult.get).
            if waiter.result.ready() and waiter.result.successful():
                self._orphan(waiter.request, waiter.result.value)
            raise

    def _run(self):
        while True:
            batch = sorted(take_batch(self._queue, self._queue.get()),
                           key=lambda w: (w.request.org_id, w.request.gid))
            try:
                rows = self.store.admit_batch([w.request for w in batch])
            except Exception as err:  # noqa: BLE001 - handed to each waiting request
                for waiter in batch:
                    waiter.result.set_exception(err)
            else:
                for waiter, row in zip(batch, rows, strict=True):
                    if not waiter.orphaned:
                        waiter.result.set(row)
                    else:
                        self._orphan(waiter.request, row)
            if self.on_answered is not None:
                self.on_answered()

    def _orphan(self, request, row):
        if row is not None and row[0] is not None and self.on_orphan is not None:
            self.on_orphan(request, row)


class _Waiter:
    """One request waiting for its admission."""

    __slots__ = ("request", "result", "orphaned")

    def __init__(self, request):
        self.request, self.result, self.orphaned = request, AsyncResult(), False


class AdmissionTurn:
    """A background writer's turn after this worker's admissions: :meth:`wait` returns once the
    worker's next admissions are answered (:meth:`answered`, called by the :class:`Admitter`),
    once someone waits for what the writer holds (:meth:`hurry`), or after ``defer_s``.

    :param defer_s: the longest wait, in seconds; 0: never wait.
    """

    def __init__(self, defer_s=0.0):
        self.defer_s = defer_s
        self._go = Event()     # set: the writer goes now
        self._urgent = False   # someone waits for what is queued: no deferring

    def hurry(self):
        """Write what is queued now."""
        self._urgent = True
        self._go.set()

    def answered(self):
        """The worker's admissions were answered: a waiting writer goes."""
        self._go.set()

    def wait(self):
        """Wait for the writer's turn (at once when hurried since its last turn)."""
        if self.defer_s and not self._urgent:
            self._go.clear()
            self._go.wait(self.defer_s)
        self._urgent = False


class SettlementWriter:
    """Commits settlements in batches, retrying each batch until it commits.

    :param turn: the ledger's :class:`AdmissionTurn` for this writer (``Ledger.admission_turn``):
        a batch waits for the worker's next admission to be answered; by default it is written
        at once.
    """

    def __init__(self, store, metrics=None, on_committed=None, background=None, turn=None):
        self.store = store
        self.metrics = metrics
        self.on_committed = on_committed  # gid -> None, once committed
        self.turn = turn or AdmissionTurn()
        self._queue = Queue()
        self._outstanding = {}  # gid -> Settlement, queued or being written
        self._idle = Event()
        self._idle.set()
        self._background = background or Background()

    def put(self, settlement, urgent=False):
        """Queue ``settlement``; ``urgent``: its caller waits for the commit, so the batch is
        not deferred."""
        self._background.spawn("ledger.settlements", self._write_forever)
        self._outstanding[settlement.gid] = settlement
        self._idle.clear()
        self._queue.put(settlement)
        if urgent:
            self.turn.hurry()

    def wait_idle(self, timeout_s):
        """Wait up to ``timeout_s`` until nothing is outstanding; return whether so."""
        if not self._idle.is_set():
            self.turn.hurry()
        return self._idle.wait(timeout_s)

    def wait_for(self, timeout_s, gid=None, org_id=None):
        """Wait up to ``timeout_s`` for the outstanding settlements of generation ``gid`` or of
        org ``org_id`` to commit; return whether there were any."""
        waiting = [s for s in list(self._outstanding.values())
                   if s.gid == gid or s.org_id == org_id]
        if waiting:
            self.turn.hurry()
        deadline = time.monotonic() + timeout_s
        for settlement in waiting:
            settlement.committed.wait(max(0.0, deadline - time.monotonic()))
        return bool(waiting)

    def _write_forever(self):
        while True:
            first = self._queue.get()
            self.turn.wait()
            batch = take_batch(self._queue, first)
            self._write(batch)
            for settlement in batch:
                self._outstanding.pop(settlement.gid, None)
            if not self._outstanding:
                self._idle.set()

    def _write(self, batch):
        """Commit ``batch``, retrying with backoff on any database error until it commits; a
        batch the database refuses for its values is split (:meth:`_isolate`)."""
        wait_s = RETRY_BACKOFF_S[0]
        while True:
            t0 = time.monotonic()
            try:
                debited = self.store.settle_batch(batch)
                break
            except Exception as err:  # noqa: BLE001 - the settlement guard: retried until it commits
                if refused_for_its_data(err):
                    self._isolate(batch, err)
                    return
                log.warning("settlement of %d generation(s) failed; retrying in %.2f s",
                            len(batch), wait_s, exc_info=True)
                gevent.sleep(wait_s * random.uniform(0.5, 1.0))
                wait_s = min(wait_s * 2, RETRY_BACKOFF_S[1])
        if self.metrics is not None:
            self.metrics.settlement.observe(time.monotonic() - t0)
            self.metrics.settlement_batch.observe(len(batch))
        self._done(batch, debited)

    def _done(self, batch, debited):
        for settlement in batch:
            if self.on_committed is not None:
                self.on_committed(settlement.gid)
            settlement.debited = debited.get(settlement.gid)
            settlement.committed.set()

    def _isolate(self, batch, err):
        """Write the halves of a refused batch apart, down to the one settlement at fault. That
        one is written once more within every column's range (``salvaged()``: what can be
        billed); refused again, it is given up: logged, counted, its lease no longer renewed,
        so that the sweeper closes it after the lease's TTL and bills the progress the lease
        recorded (``abandoned``)."""
        if len(batch) > 1:
            half = len(batch) // 2
            self._write(batch[:half])
            self._write(batch[half:])
            return
        settlement = batch[0]
        salvaged = settlement.salvaged()
        if salvaged is not None:
            log.error("settlement of %s refused by the database (%s); written again within "
                      "the columns' ranges", settlement.gid, type(err).__name__)
            try:
                debited = self.store.settle_batch([salvaged])
            except Exception as again:  # noqa: BLE001 - judged below like the first refusal
                if not refused_for_its_data(again):
                    self._write([salvaged])  # a transient failure: retried as any batch
                    self._done([settlement], {settlement.gid: salvaged.debited})
                    return
            else:
                self._done([settlement], debited)
                return
        log.error("settlement of %s refused by the database (%s); left to the sweeper",
                  settlement.gid, type(err).__name__)
        if self.metrics is not None:
            self.metrics.settlements_refused.inc()
        self._done([settlement], {})


class Renewer:
    """Renews the worker's live leases in one statement, recording each one's progress, every
    third of their TTL or every :data:`RENEW_EVERY_MAX_S`, whichever is sooner: the usage a
    SIGKILLed worker's generations are billed by the sweeper lags the real one by at most that."""

    def __init__(self, store, lease_ttl_s, background=None):
        self.store = store
        self.lease_ttl_s = lease_ttl_s
        self.live = {}  # gid -> Lease, until its settlement commits
        self._background = background or Background()

    def track(self, lease):
        self._background.spawn("ledger.renewer", self._run)
        self.live[lease.gid] = lease

    def forget(self, gid):
        self.live.pop(gid, None)

    def _run(self):
        while True:
            gevent.sleep(min(self.lease_ttl_s / 3, RENEW_EVERY_MAX_S))
            if self.live:
                self.renew_now()

    def renew_now(self):
        """Renew every live lease in one statement, recording progress; set ``lost`` on those
        the sweeper settled. A failure is logged and retried next time; a statement refused for
        its values is split until the lease at fault stands alone, which is then renewed
        without progress (its last recorded progress stands)."""
        leases = list(self.live.values())
        for lease, state in self._renew([(lease, lease.progress()) for lease in leases]):
            if state == "settled":
                lease.lost.set()

    def _renew(self, items):
        """Yield ``(lease, state)`` for the ``(lease, progress)`` items renewed."""
        try:
            states = self.store.renew([(lease.gid, usage) for lease, usage in items],
                                      self.lease_ttl_s)
        except Exception as err:  # noqa: BLE001 - renewal is retried at the next interval
            if not refused_for_its_data(err):
                log.warning("lease renewal of %d generation(s) failed", len(items),
                            exc_info=True)
                return
            if len(items) > 1:
                half = len(items) // 2
                yield from self._renew(items[:half])
                yield from self._renew(items[half:])
            elif items[0][1] is not None:
                log.error("lease renewal of %s refused by the database (%s); renewed without "
                          "its progress", items[0][0].gid, type(err).__name__)
                yield from self._renew([(items[0][0], None)])
            return
        for lease, _ in items:
            yield lease, states.get(lease.gid)
