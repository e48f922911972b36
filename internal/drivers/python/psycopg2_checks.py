"""psycopg2's checks of the driver matrix (see checklib and internal/drivers).

psycopg2 speaks only the simple query protocol (it interpolates parameters
client-side), in text format; transactions begin implicitly unless the
connection is in autocommit.
"""

import hashlib
import os
import select
import sys
import threading
import uuid
from contextlib import closing, contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psycopg2  # noqa: E402
import psycopg2.errors  # noqa: E402
import psycopg2.extensions  # noqa: E402
import psycopg2.extras  # noqa: E402
import psycopg2.pool  # noqa: E402

from checklib import (  # noqa: E402
    OBSERVER_PORT, UPSERT, NotApplicable, CheckFailed, Observer,
    expect, expect_eq, expect_server_cursors, fence_options, receipts_need_proxy,
    run, run_threads, sqlstate_catcher, wait_until,
)

VARIANT = "psycopg2"


def connect(autocommit=False, **kw):
    conn = psycopg2.connect("", **kw)
    conn.autocommit = autocommit
    return conn


def observer():
    return connect(autocommit=True, port=OBSERVER_PORT)


def one(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchone()


sqlstate_of = sqlstate_catcher(psycopg2.Error)


def check_connect():
    with connect() as conn:
        expect(conn.server_version >= 150000, f"server_version {conn.server_version}")
        expect_eq(one(conn, "SELECT 1")[0], 1, "SELECT 1")
        expect_eq(conn.get_parameter_status("server_encoding"), "UTF8", "server_encoding")
    conn.close()


def check_simple_query():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT 1; SELECT 'two', %s", ("three",))
            expect_eq(cur.fetchone(), ("two", "three"), "last result of a multi-statement query")


def check_extended_query():
    raise NotApplicable("psycopg2 has no extended protocol: parameters are interpolated client-side")


def check_prepared():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("PREPARE q(int) AS SELECT $1 * 2")
            for i in range(3):
                cur.execute("EXECUTE q(%s)", (i,))
                expect_eq(cur.fetchone()[0], i * 2, "EXECUTE q")
            cur.execute("DEALLOCATE q")
            cur.execute("SELECT count(*) FROM pg_prepared_statements")
            expect_eq(cur.fetchone()[0], 0, "prepared statements left")


def check_prepared_server():
    raise NotApplicable("psycopg2 never prepares statements itself")


def check_binary():
    raise NotApplicable("psycopg2 uses text format only")


def check_transaction():
    with closing(connect()) as conn, closing(observer()) as obs:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE p2_tx (v int)")
            conn.commit()
            cur.execute("INSERT INTO p2_tx VALUES (1)")
            expect_eq(conn.get_transaction_status(), psycopg2.extensions.TRANSACTION_STATUS_INTRANS, "status in tx")
            expect_eq(one(obs, "SELECT count(*) FROM p2_tx")[0], 0, "uncommitted row seen by another session")
            conn.commit()
            cur.execute("INSERT INTO p2_tx VALUES (2)")
            conn.rollback()
            expect_eq(one(obs, "SELECT array_agg(v) FROM p2_tx")[0], [1], "rows after commit and rollback")


def check_savepoint():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE sp (v int)")
            cur.execute("INSERT INTO sp VALUES (1)")
            cur.execute("SAVEPOINT a")
            cur.execute("INSERT INTO sp VALUES (2)")
            expect_eq(sqlstate_of(lambda: cur.execute("SELECT 1/0")), "22012", "error inside the savepoint")
            cur.execute("ROLLBACK TO SAVEPOINT a")
            cur.execute("INSERT INTO sp VALUES (3)")
            cur.execute("RELEASE SAVEPOINT a")
            conn.commit()
            cur.execute("SELECT array_agg(v ORDER BY v) FROM sp")
            expect_eq(cur.fetchone()[0], [1, 3], "rows")


def check_error_recovery():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE er (v int PRIMARY KEY)")
            cur.execute("INSERT INTO er VALUES (1)")
            conn.commit()
            try:
                cur.execute("INSERT INTO er VALUES (1)")
                raise CheckFailed("duplicate key accepted")
            except psycopg2.errors.UniqueViolation as e:
                expect_eq(e.diag.constraint_name, "er_pkey", "constraint name")
            expect_eq(conn.get_transaction_status(), psycopg2.extensions.TRANSACTION_STATUS_INERROR, "status after error")
            expect_eq(sqlstate_of(lambda: cur.execute("SELECT 1")), "25P02", "statement in a failed transaction")
            conn.rollback()
            cur.execute("SELECT 1")
            expect_eq(cur.fetchone()[0], 1, "after rollback")
            expect_eq(sqlstate_of(lambda: cur.execute("SELEC 1")), "42601", "syntax error")
            conn.rollback()
            cur.execute("SELECT count(*) FROM er")
            expect_eq(cur.fetchone()[0], 1, "rows")


def check_syntax_error():
    # A typo in a statement with one string literal (its text unique to
    # the variant: the proxy caches classifications by text).
    with closing(connect(autocommit=True)) as conn:
        with conn.cursor() as cur:
            expect_eq(sqlstate_of(lambda: cur.execute(f"SELEC '{VARIANT}'")), "42601", "a syntax error")
            cur.execute("SELECT 1")
            expect_eq(cur.fetchone()[0], 1, "after the syntax error")


def check_notice():
    with closing(connect(autocommit=True)) as conn:
        with conn.cursor() as cur:
            cur.execute("DO $$ BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful'; END $$")
        expect(any("hello 42" in n for n in conn.notices), f"notices {conn.notices}")
        expect(any("WARNING:  careful" in n for n in conn.notices), f"notices {conn.notices}")


def wait_notifies(conn, n=1, timeout=10.0):
    def got():
        if select.select([conn], [], [], 0.05)[0]:
            conn.poll()
        else:
            conn.poll()
        return len(conn.notifies) >= n
    wait_until("a notification", got, timeout)


def check_listen_notify():
    with closing(connect(autocommit=True)) as a, closing(connect(autocommit=True)) as b:
        with a.cursor() as cur:
            cur.execute("LISTEN p2_chan")
        with b.cursor() as cur:
            cur.execute("NOTIFY p2_chan, 'hello'")
            cur.execute("SELECT pg_notify('p2_chan', 'from function')")
        wait_notifies(a, 2)
        got = [(n.channel, n.payload) for n in a.notifies]
        expect_eq(got, [("p2_chan", "hello"), ("p2_chan", "from function")], "notifications")
        with a.cursor() as cur:
            cur.execute("UNLISTEN *")


def check_copy_out():
    import io
    with closing(connect()) as conn:
        buf = io.StringIO()
        with conn.cursor() as cur:
            cur.copy_expert("COPY (SELECT g, 'row ' || g FROM generate_series(1, 1000) g) TO STDOUT", buf)
        lines = buf.getvalue().splitlines()
        expect_eq(len(lines), 1000, "lines")
        expect_eq(lines[999], "1000\trow 1000", "last line")


def check_copy_in():
    import io
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE ci (id int, name text)")
            data = "".join(f"{i}\tname {i}\n" for i in range(1, 1001))
            cur.copy_expert("COPY ci FROM STDIN", io.StringIO(data))
            expect_eq(cur.rowcount, 1000, "rowcount")
            conn.commit()
            code = sqlstate_of(lambda: cur.copy_expert("COPY ci FROM STDIN", io.StringIO("x\ty\n")))
            expect_eq(code, "22P02", "bad COPY data")
            conn.rollback()
            cur.execute("SELECT count(*), sum(id) FROM ci")
            expect_eq(cur.fetchone(), (1000, 500500), "rows")


def check_cancel():
    app = "p2cancel-" + uuid.uuid4().hex[:8]
    conn, obs = connect(application_name=app), observer()
    errs = []

    def sleeper():
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_sleep(60)")
            errs.append(None)
        except psycopg2.Error as e:
            errs.append(e.pgcode)

    th = threading.Thread(target=sleeper)
    try:
        th.start()
        wait_until("the query to run", lambda: one(obs,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'active' AND query LIKE '%%pg_sleep%%'",
            (app,))[0] == 1)
        conn.cancel()
        th.join(20)
        expect_eq(errs, ["57014"], "the cancelled query's SQLSTATE")
        conn.rollback()
        expect_eq(one(conn, "SELECT 1")[0], 1, "after the cancel")
    finally:
        th.join(60)
        conn.close()
        obs.close()


def check_statement_timeout():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("SET statement_timeout = '100ms'")
            expect_eq(sqlstate_of(lambda: cur.execute("SELECT pg_sleep(10)")), "57014", "timed-out query")
            conn.rollback()
            cur.execute("SELECT 1")
            expect_eq(cur.fetchone()[0], 1, "after the timeout")


def check_server_cursor():
    with closing(connect()) as conn:
        expect_server_cursors(conn, "SELECT g FROM generate_series(1, 1000) g", None, "p2_cursor", "p2_hold")


def check_pool():
    pool = psycopg2.pool.ThreadedConnectionPool(1, 4)  # raises when exhausted: 4 workers

    def worker(i):
        for j in range(5):
            c = pool.getconn()
            try:
                with c.cursor() as cur:
                    cur.execute("SELECT %s::int + %s", (i, j))
                    expect_eq(cur.fetchone()[0], i + j, "answer")
                c.rollback()
            finally:
                pool.putconn(c)

    errs = run_threads(4, worker)
    pool.closeall()
    expect_eq(errs, [], "errors")


def check_pipeline():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE pb (id int, v text)")
            psycopg2.extras.execute_batch(cur, "INSERT INTO pb VALUES (%s, %s)", [(i, f"v{i}") for i in range(250)], page_size=100)
            psycopg2.extras.execute_values(cur, "INSERT INTO pb VALUES %s", [(i, f"w{i}") for i in range(250, 500)])
            conn.commit()
            cur.execute("SELECT count(*), sum(id) FROM pb")
            expect_eq(cur.fetchone(), (500, 124750), "rows")
        return "execute_batch (multi-statement queries) and execute_values"


def check_large_value():
    with closing(connect()) as conn:
        text = "x" * (8 << 20) + "end"
        blob = os.urandom(4 << 20)
        with conn.cursor() as cur:
            cur.execute("SELECT %s::text, md5(%s::text), %s::bytea", (text, text, psycopg2.Binary(blob)))
            t, md5, b = cur.fetchone()
        expect(t == text, "text value changed")
        expect_eq(md5, hashlib.md5(text.encode()).hexdigest(), "server-side md5")
        expect(bytes(b) == blob, "bytea value changed")


def check_large_result():
    with closing(connect()) as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT g, repeat('x', 100) FROM generate_series(1, 100000) g")
            rows = cur.fetchall()
        expect_eq(len(rows), 100000, "rows")
        expect_eq(rows[-1][0], 100000, "last row")


def check_client_encoding():
    with closing(connect()) as conn:
        conn.set_client_encoding("LATIN1")
        expect_eq(conn.get_parameter_status("client_encoding"), "LATIN1", "client_encoding")
        with conn.cursor() as cur:
            cur.execute("SELECT %s::text, octet_length(%s::text)", ("café ñ", "café ñ"))
            expect_eq(cur.fetchone(), ("café ñ", 8), "LATIN1 text and its UTF8 length in the server")
            expect_eq(sqlstate_of(lambda: cur.execute("SELECT chr(8364)")), "22P05", "a character LATIN1 lacks")
        conn.rollback()
        conn.set_client_encoding("UTF8")
        with conn.cursor() as cur:
            cur.execute("SELECT %s::text", ("漢字 🐘",))
            expect_eq(cur.fetchone()[0], "漢字 🐘", "UTF8 text")


def check_backend_pid():
    app = "p2pid-" + uuid.uuid4().hex[:8]
    with closing(connect(autocommit=True, application_name=app)) as conn, closing(observer()) as obs:
        pid = conn.get_backend_pid()
        expect_eq(one(conn, "SELECT pg_backend_pid()")[0], pid, "pg_backend_pid() against the driver's BackendKeyData PID")
        expect_eq(one(obs, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))[0], pid,
                  "pg_stat_activity's pid against the driver's")
        with conn.cursor() as cur:
            cur.execute("LISTEN p2_self")
            cur.execute("NOTIFY p2_self")
        wait_notifies(conn)
        expect_eq(conn.notifies[0].pid, pid, "PID of a self-notification")


# --- fencing flows -----------------------------------------------------------

OBS = Observer(observer)
acquire, receipts, result_row = OBS.acquire, OBS.receipts, OBS.result_row


def fenced(job, epoch, token, autocommit=False):
    return connect(autocommit=autocommit, options=fence_options(job, epoch, token))


def job_key(check):
    return f"{VARIANT}:{check}"


def check_fence_acquire():
    conn = connect(autocommit=True)
    job = job_key("acquire")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT epoch, token FROM fence.acquire(%s, 'h1', interval '5 minutes')", (job,))
            epoch, token = cur.fetchone()
            expect(epoch >= 1 and token >= 1, f"epoch {epoch} token {token}")
            code = sqlstate_of(lambda: cur.execute("SELECT * FROM fence.acquire(%s, 'h2', interval '5 minutes')", (job,)))
            expect_eq(code, "FN002", "a second holder's acquire")
    finally:
        conn.close()


def check_fence_commit():
    job, epoch, token = committed_generation("commit")
    OBS.expect_committed(job, "p1", token)


@contextmanager
def upserted(job, epoch, token, payload):
    """A fenced connection, closed at the end of the block, whose open
    transaction has upserted payload."""
    with closing(fenced(job, epoch, token)) as conn:
        with conn.cursor() as cur:
            cur.execute(UPSERT, (job, payload, token))
        yield conn


def committed_generation(check, payload="p1"):
    job, epoch, token = OBS.new_generation(job_key(check))
    with upserted(job, epoch, token, payload) as conn:
        conn.commit()
    return job, epoch, token


def check_fence_replay():
    receipts_need_proxy()
    job, epoch, token = committed_generation("replay")
    with upserted(job, epoch, token, "p1") as conn:
        conn.commit()
        expect(any("idempotent replay" in n for n in conn.notices), f"no replay notice: {conn.notices}")
        expect_eq(one(conn, "SELECT 1")[0], 1, "after the replay")
    expect_eq(receipts(job), 1, "receipts")
    expect_eq(result_row(job), ("p1", token), "the row")


def check_fence_conflict():
    receipts_need_proxy()
    job, epoch, token = committed_generation("conflict")
    with upserted(job, epoch, token, "something else") as conn:
        expect_eq(sqlstate_of(conn.commit), "FN003", "a different payload under a committed generation")
        expect_eq(conn.get_transaction_status(), psycopg2.extensions.TRANSACTION_STATUS_IDLE, "status after FN003")
        expect_eq(one(conn, "SELECT 1")[0], 1, "after the conflict")
    expect_eq(result_row(job), ("p1", token), "the row")


def check_fence_stale():
    job, epoch, old = OBS.new_generation(job_key("stale"))
    new = OBS.take_over(job, old)
    with closing(fenced(job, epoch, old)) as conn:
        with conn.cursor() as cur:
            code = sqlstate_of(lambda: cur.execute(UPSERT, (job, "zombie", old)))
            if code is None:
                code = sqlstate_of(conn.commit)
        expect_eq(code, "FN001", "a write under the token taken over")
        conn.rollback()
        expect_eq(one(conn, "SELECT 1")[0], 1, "after FN001")
    expect_eq(result_row(job), None, "the row")
    return f"token {old} taken over by {new}"


def check_fence_autocommit():
    job, epoch, token = OBS.new_generation(job_key("autocommit"))
    with closing(fenced(job, epoch, token, autocommit=True)) as conn:
        with conn.cursor() as cur:
            cur.execute(UPSERT, (job, "auto", token))
    OBS.expect_committed(job, "auto", token)


def check_fence_copy():
    import io
    job, epoch, token = OBS.new_generation(job_key("copy"))
    with closing(fenced(job, epoch, token, autocommit=True)) as conn:
        with conn.cursor() as cur:
            cur.copy_expert("COPY results (job_key, payload, token) FROM STDIN", io.StringIO(f"{job}\tcopied\t{token}\n"))
    OBS.expect_committed(job, "copied", token)


def check_fence_no_metadata():
    with closing(connect(autocommit=True)) as conn:
        with conn.cursor() as cur:
            code = sqlstate_of(lambda: cur.execute(UPSERT, (job_key("nometa"), "x", 1)))
        expect_eq(code, "FN008", "a write without fence metadata")
    expect_eq(result_row(job_key("nometa")), None, "the row")


def check_fence_pipeline():
    job, epoch, token = OBS.new_generation(job_key("pipeline"))
    with closing(fenced(job, epoch, token)) as conn:
        with conn.cursor() as cur:
            psycopg2.extras.execute_batch(cur, UPSERT, [(job, "batch", token)] * 3, page_size=10)
        conn.commit()
    OBS.expect_committed(job, "batch", token)
    return "execute_batch"


if __name__ == "__main__":
    run(VARIANT, [v for k, v in list(globals().items()) if k.startswith("check_")])
