"""What the Python drivers' checks share: reporting, the target, the
observer connection's queries and the fencing flows' SQL.

Each check is a function; run() calls them in order and prints one line
per check (check, variant, name, ok|fail|n/a, detail), tab-separated, the
format the Go orchestrator (internal/drivers) reads. A check passes by
returning (optionally a detail string), is not applicable by raising
NotApplicable, and fails by raising anything else.
"""

import os
import sys
import time
import traceback

TARGET = os.environ["PGFENCE_TARGET"]  # "direct" or "proxy"
PROXY = TARGET == "proxy"
OBSERVER_PORT = os.environ["PGFENCE_OBSERVER_PORT"]

UPSERT = (
    "INSERT INTO results (job_key, payload, token) VALUES (%s, %s, %s) "
    "ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token "
    "WHERE results.token < excluded.token"
)


class NotApplicable(Exception):
    """The driver has no such feature (or the check means nothing on this target)."""


class CheckFailed(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def expect_eq(got, want, what):
    if got != want:
        raise CheckFailed(f"{what}: got {got!r}, want {want!r}")


def sqlstate(e):
    """The SQLSTATE of a psycopg2 or psycopg 3 error (None for one from the
    driver itself)."""
    return getattr(e, "pgcode", None) or getattr(e, "sqlstate", None) or getattr(getattr(e, "diag", None), "sqlstate", None)


def sqlstate_catcher(error):
    """sqlstate_of for a driver whose errors are error (its base class):
    sqlstate_of(fn) calls fn and returns the SQLSTATE of the driver error it
    raised, or None when it raised none."""
    def sqlstate_of(fn):
        try:
            fn()
        except error as e:
            return sqlstate(e)
        return None
    return sqlstate_of


def receipts_need_proxy():
    """Raises NotApplicable straight to PostgreSQL: the proxy writes the
    receipts (replay, conflict) the check is about."""
    if not PROXY:
        raise NotApplicable("receipts are written by the proxy")


def expect_server_cursors(conn, sql, args, name, hold_name):
    """The DB-API server-side cursors both drivers have: sql (args), the
    numbers 1 to 1000, read through cursor name 100 rows at a time, then a
    WITH HOLD cursor hold_name read after its transaction committed."""
    with conn.cursor(name=name) as cur:
        cur.itersize = 100
        cur.execute(sql, args)
        total = sum(r[0] for r in cur)
    expect_eq(total, 500500, "sum over the cursor")
    conn.commit()
    with conn.cursor(name=hold_name, withhold=True) as cur:
        cur.execute("SELECT g FROM generate_series(1, 10) g")
        conn.commit()
        expect_eq(len(cur.fetchall()), 10, "rows of a WITH HOLD cursor after commit")


def clean(s):
    return " ".join(str(s).split())[:500]


def run(variant, checks):
    for fn in checks:
        name = fn.__name__.removeprefix("check_")
        try:
            detail = fn() or ""
            status = "ok"
        except NotApplicable as e:
            status, detail = "n/a", str(e)
        except Exception as e:  # noqa: BLE001 - a check fails on anything
            status = "fail"
            code = getattr(e, "pgcode", None) or getattr(getattr(e, "diag", None), "sqlstate", None)
            detail = f"{type(e).__name__}{' ' + code if code else ''}: {e}"
            traceback.print_exc(file=sys.stderr)
        print("\t".join(["check", variant, name, status, clean(detail)]), flush=True)


def wait_until(what, cond, timeout=10.0):
    """Polls cond (an observation: pg_stat_activity, a socket) until it
    holds; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out waiting for {what}")
        time.sleep(0.01)


def run_threads(n, worker):
    """Runs worker(i) for i in range(n) in threads at once; returns what
    they raised, as strings."""
    import threading
    errs = []

    def run(i):
        try:
            worker(i)
        except Exception as e:  # noqa: BLE001
            errs.append(repr(e))

    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    return errs


def fence_options(job_key, epoch, token):
    return f"-c fence.job_key={job_key} -c fence.epoch={epoch} -c fence.token={token}"


class Observer:
    """The fencing flows' view from a separate connection straight to
    PostgreSQL. connect is the driver's connect to the observer port, in
    autocommit; each call opens a connection and closes it."""

    def __init__(self, connect):
        self.connect = connect

    def one(self, sql, args=()):
        conn = self.connect()
        try:
            cur = conn.cursor()
            cur.execute(sql, args)
            row = cur.fetchone()
            cur.close()
            return row
        finally:
            conn.close()

    def acquire(self, job, holder="h1"):
        """A new generation of job: (epoch, token)."""
        return tuple(self.one("SELECT epoch, token FROM fence.acquire(%s, %s, interval '5 minutes')", (job, holder)))

    def take_over(self, job, token):
        """Another holder takes job over from token; returns its token."""
        self.one("SELECT fence.release(%s, %s)", (job, token))
        return self.one("SELECT token FROM fence.acquire(%s, 'h2', interval '5 minutes')", (job,))[0]

    def new_generation(self, job):
        """job with a new generation: (job, epoch, token)."""
        return (job, *self.acquire(job))

    def expect_committed(self, job, payload, token):
        """Checks job's result row (payload, token) and its receipts: the
        proxy's v1, or straight to PostgreSQL the backstop's."""
        expect_eq(self.result_row(job), (payload, token), "the row")
        expect_eq(self.receipt_kinds(job), "v1" if PROXY else "backstop-v1", "receipts (digest versions)")

    def receipt_kinds(self, job):
        """The digest versions of job's receipts: the proxy's v1, or straight
        to PostgreSQL the backstop's backstop-v1."""
        return self.one("SELECT coalesce(string_agg(digest_version, ',' ORDER BY token), '') FROM fence.receipts WHERE job_key = %s", (job,))[0]

    def receipts(self, job):
        return self.one("SELECT count(*) FROM fence.receipts WHERE job_key = %s", (job,))[0]

    def result_row(self, job):
        row = self.one("SELECT payload, token FROM results WHERE job_key = %s", (job,))
        return tuple(row) if row is not None else None
