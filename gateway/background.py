"""A worker's background greenlets (the ledger's admitter, settlement writer and renewer, the
sweeper, the backend prober, the webhook deliverer), kept running whatever they raise.

Each runs a function meant to run forever. If it raises anything (a driver error, a bug), the
failure is logged and counted, the greenlet is *down* for a backoff that doubles up to
:data:`BACKOFF_S`'s second value, then the function runs again. ``GET /readyz`` answers 503
while one is down, naming it (docs/RELIABILITY.md, "A worker never stops settling"). Imports
nothing of Kiln: the ledger and the fleet use it as they are.
"""
import logging
import time

import gevent

log = logging.getLogger(__name__)
BACKOFF_S = (0.1, 10.0)  # first and longest wait before a failed greenlet runs again


class Background:
    """The greenlets one worker keeps running, by name.

    :param on_restart: ``name -> None``, called at each restart (the metric).
    """

    def __init__(self, on_restart=None):
        self.on_restart = on_restart
        self.down = {}  # name -> what it last raised, while it waits to run again
        self._greenlets = {}

    def spawn(self, name, run, *args):
        """Run ``run(*args)`` in a greenlet named ``name`` (once: a second call while it runs
        returns the same greenlet); restart it whenever it raises."""
        greenlet = self._greenlets.get(name)
        if greenlet is None or greenlet.dead:
            greenlet = self._greenlets[name] = gevent.spawn(self._keep, name, run, args)
        return greenlet

    def _keep(self, name, run, args):
        wait_s = BACKOFF_S[0]
        while True:
            started = time.monotonic()
            try:
                run(*args)
                return  # finished on purpose
            except Exception as err:  # noqa: BLE001 - a background greenlet must not die of it
                log.exception("background %s failed; restarting in %.1f s", name, wait_s)
                self.down[name] = f"{type(err).__name__}"
            if self.on_restart is not None:
                self.on_restart(name)
            gevent.sleep(wait_s)
            self.down.pop(name, None)
            # A greenlet that ran a while before failing starts its backoff over.
            ran_s = time.monotonic() - started
            wait_s = BACKOFF_S[0] if ran_s > BACKOFF_S[1] else min(wait_s * 2, BACKOFF_S[1])

    def stop(self):
        """Kill every greenlet (tests, shutdown)."""
        gevent.killall(list(self._greenlets.values()), block=False)
