"""Many gateway hosts share one Postgres through pgbouncer in transaction mode (README "Scaling
out", deploy/RUNBOOK.md): two gunicorn masters reach the database only through a real pgbouncer
(Debian package), and the ledger stays exact: the in-flight limit holds across both, every
request is settled once, and ``kiln credits reconcile`` is clean.

The ledger's statements run server-side inside its PL/pgSQL functions, whose plans Postgres
prepares once per server connection; psycopg's protocol-level prepared statements are off, which
pgbouncer before 1.21 cannot carry across transactions. The server's
``pg_stat_user_functions`` shows the functions doing the work.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES
from fake_upstream import chat_chunk, chat_completion, json_reply, make_usage, sse
from gateway_proc import Gateway, free_port, make_org, wait_until

pytestmark = pytest.mark.postgres

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
KILN = str(Path(sys.executable).with_name("kiln"))


@pytest.fixture
def bouncer(pg_url):
    """pgbouncer in transaction mode in front of the session's test database."""
    if not os.path.exists(PGBOUNCER):
        pytest.fail("pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)")
    port, workdir = free_port(), Path(tempfile.mkdtemp(prefix="kiln-pgbouncer-"))
    dbname = pg_url.rsplit("/", 1)[1]
    (workdir / "users.txt").write_text('"postgres" ""\n')
    (workdir / "pgbouncer.ini").write_text(f"""[databases]
{dbname} = host=127.0.0.1 port=5432 dbname={dbname}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {workdir}/users.txt
pool_mode = transaction
default_pool_size = 8
max_client_conn = 500
logfile = {workdir}/pgbouncer.log
pidfile = {workdir}/pgbouncer.pid
ignore_startup_parameters = extra_float_digits,options
""")
    command = [PGBOUNCER, str(workdir / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        shutil.chown(workdir, "postgres", "postgres")
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(workdir / name, "postgres", "postgres")
        command = ["runuser", "-u", "postgres", "--", *command]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/{dbname}"
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    wait_until(lambda: _answers(engine), timeout_s=15)
    engine.dispose()
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(workdir, ignore_errors=True)


def _answers(engine):
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    except sa.exc.OperationalError:
        return False


def ledger_calls(engine):
    with engine.connect() as conn:
        return dict(conn.execute(sa.text(
            "SELECT funcname, calls FROM pg_stat_user_functions "
            "WHERE funcname IN ('kiln_admit', 'kiln_settle')")).all())


def test_two_gateways_through_pgbouncer_keep_the_ledger_exact(bouncer, catalog_path, fake,
                                                               engine):
    env = {"KILN_DATABASE_URL": bouncer, "KILN_MODELS": str(catalog_path)}
    with engine.connect() as conn:  # the server counts function calls (new connections)
        conn.execute(sa.text(f"ALTER DATABASE {bouncer.rsplit('/', 1)[1]} "
                             f"SET track_functions = 'all'"))
        conn.commit()
    gateways = [Gateway(env, workers=2).start(), Gateway(env, workers=2).start()]
    try:
        org = make_org(engine, f"bouncer-{uuid.uuid4().hex[:8]}", limit=4)
        fake.default = lambda record: (
            sse([chat_chunk("a"), chat_chunk("b", finish_reason="stop"),
                 chat_chunk(choices=False, usage=make_usage(6, 2))], delay_s=0.2)
            if (record.json or {}).get("stream") else
            [*json_reply(chat_completion("ab", usage=make_usage(6, 2)))])
        before = ledger_calls(engine)
        codes, gids = [], []
        # The shared fake may still be ending an earlier test's script (its count drops just
        # after the last byte, or once it sees a hung connection closed): count this test's
        # requests only.
        wait_until(lambda: fake.active == 0)
        seen = len(fake.requests)

        def client(i):
            r = requests.post(gateways[i % 2].base_url + "/v1/chat/completions",
                              headers=org.headers, timeout=60,
                              json={"model": "fake-model", "messages": MESSAGES,
                                    "stream": i % 3 == 0})
            codes.append(r.status_code)
            if r.status_code == 200:
                gids.append(r.headers["X-Neocloud-Generation-Id"])
        for _ in range(3):
            threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert set(codes) <= {200, 429} and codes.count(200) >= 12
        # The org's limit held across both hosts: each request held its lease from before the
        # backend received it until after the backend's last send (the fake's own count lags
        # those bounds, as settlement follows the answer by milliseconds).
        # Chat requests only: a gateway's health probe (GET /v1/models) is no generation.
        assert max_overlap([r for r in fake.requests[seen:]
                            if r.path.endswith("/chat/completions")]) <= 4
        with engine.connect() as conn:
            settled = wait_until(lambda: conn.execute(sa.text(
                "SELECT count(*) FROM usage_events WHERE org_id = :o AND status = 'completed' "
                "AND cost_nanos = 1200"), {"o": org.id}).scalar_one() == len(gids), timeout_s=30)
        assert settled
        # statistics reach the view within a second or so of each transaction
        assert wait_until(lambda: ledger_calls(engine).get("kiln_admit", 0)
                          - before.get("kiln_admit", 0) >= len(gids), timeout_s=15)
        check = subprocess.run([KILN, "credits", "reconcile"], capture_output=True, text=True,
                               env={**os.environ, "KILN_DATABASE_URL": bouncer}, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        for gw in gateways:
            gw.stop()


def max_overlap(records):
    """The most requests the backend held at one instant, from arrival to last send."""
    edges = sorted([(r.received_at, 1) for r in records]
                   + [(max(r.sent_at[-1] if r.sent_at else r.received_at, r.received_at), -1)
                      for r in records], key=lambda edge: (edge[0], edge[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak
