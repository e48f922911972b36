"""psycopg 3's checks of the driver matrix (see checklib and internal/drivers).

psycopg 3 binds parameters server-side (the extended protocol), prepares a
statement server-side once it has run prepare_threshold times (5 by
default; 0 prepares at once), and has binary formats, pipeline mode,
server-side cursors and a pool. Two variants: the default threshold, and
prepare_threshold=0 (every statement a named prepared statement).
"""

import hashlib
import os
import sys
import threading
import uuid
from datetime import datetime, timezone
from decimal import Decimal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psycopg  # noqa: E402
import psycopg_pool  # noqa: E402
from psycopg import errors, pq  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

from checklib import (  # noqa: E402
    OBSERVER_PORT, UPSERT, NotApplicable, CheckFailed, Observer,
    expect, expect_eq, expect_server_cursors, fence_options, receipts_need_proxy,
    run, run_threads, sqlstate_catcher, wait_until,
)

VARIANT = "psycopg"
THRESHOLD = {}  # extra connect() settings of the variant running


def connect(autocommit=False, **kw):
    conn = psycopg.connect("", autocommit=autocommit, **kw)
    if "prepare_threshold" in THRESHOLD:
        conn.prepare_threshold = THRESHOLD["prepare_threshold"]
    return conn


def observer():
    return psycopg.connect("", autocommit=True, port=OBSERVER_PORT)


sqlstate_of = sqlstate_catcher(psycopg.Error)


def tag():
    return VARIANT.replace(" ", "_").replace("=", "_")


def check_connect():
    with connect() as conn:
        expect(conn.info.server_version >= 150000, f"server_version {conn.info.server_version}")
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "SELECT 1")
        expect_eq(conn.info.parameter_status("server_encoding"), "UTF8", "server_encoding")


def check_simple_query():
    with connect() as conn:
        cur = conn.execute("SELECT 1; SELECT 'two'", prepare=False)  # no parameters: the simple protocol
        expect_eq(cur.fetchone()[0], 1, "first result")
        expect(cur.nextset(), "no second result")
        expect_eq(cur.fetchone()[0], "two", "second result")
        cur = psycopg.ClientCursor(conn)  # client-side binding, the simple protocol
        cur.execute("SELECT %s::text, %s::int", ("it's", 3))
        expect_eq(cur.fetchone(), ("it's", 3), "ClientCursor")


def check_extended_query():
    with connect() as conn:
        row = conn.execute("SELECT %s::int + %s, %s::text, %s::bool", (1, 2, "x", None)).fetchone()
        expect_eq(row, (3, "x", None), "row")
        expect_eq(sqlstate_of(lambda: conn.execute("SELECT 1; SELECT %s", (1,))), "42601", "two statements with parameters")


def check_prepared():
    with connect() as conn:
        for i in range(3):
            expect_eq(conn.execute("SELECT %s::int * 2", (i,), prepare=True).fetchone()[0], i * 2, "prepared")
        n = conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT $1::int * 2%%'").fetchone()[0]
        expect_eq(n, 1, "statements prepared by prepare=True")


def check_prepared_server():
    # The server-side threshold: prepared on the threshold-th execution.
    with connect() as conn:
        want = conn.prepare_threshold
        for i in range(7):
            conn.execute("SELECT %s::int + 1", (i,))
            n = conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'SELECT $1::int + 1%%'").fetchone()[0]
            expect_eq(n, 1 if i + 1 > want else 0, f"prepared after {i + 1} executions (threshold {want})")
        return f"prepare_threshold={want}"


def check_binary():
    with connect() as conn:
        cur = conn.cursor(binary=True)
        ts = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
        cur.execute("SELECT %b::int8, %b::text, %b::bytea, %b::numeric, %b::timestamptz, %b::int4[], %b::jsonb",
                    (2**40, "héllo", b"\x00\x01\xff", Decimal("12345.6789"), ts, [1, None, 3], Jsonb({"a": [1, 2]})))
        row = cur.fetchone()
        expect_eq(row, (2**40, "héllo", b"\x00\x01\xff", Decimal("12345.6789"), ts, [1, None, 3], {"a": [1, 2]}), "binary row")
        expect_eq(cur.pgresult.fformat(0), pq.Format.BINARY, "result format")


def check_transaction():
    with connect() as conn, observer() as obs:
        conn.execute(f"CREATE TABLE p3_tx_{tag()} (v int)")
        conn.commit()
        with conn.transaction():
            conn.execute(f"INSERT INTO p3_tx_{tag()} VALUES (1)")
            expect_eq(conn.info.transaction_status, pq.TransactionStatus.INTRANS, "status")
            expect_eq(obs.execute(f"SELECT count(*) FROM p3_tx_{tag()}").fetchone()[0], 0, "uncommitted row seen elsewhere")
        try:
            with conn.transaction():
                conn.execute(f"INSERT INTO p3_tx_{tag()} VALUES (2)")
                raise psycopg.Rollback()
        except psycopg.Rollback:
            pass
        conn.commit()
        expect_eq(obs.execute(f"SELECT array_agg(v) FROM p3_tx_{tag()}").fetchone()[0], [1], "rows")


def check_savepoint():
    with connect(autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE sp (v int)")
        with conn.transaction():
            conn.execute("INSERT INTO sp VALUES (1)")
            try:
                with conn.transaction():  # a savepoint
                    conn.execute("INSERT INTO sp VALUES (2)")
                    conn.execute("SELECT 1/0")
            except errors.DivisionByZero:
                pass
            conn.execute("INSERT INTO sp VALUES (3)")
        expect_eq(conn.execute("SELECT array_agg(v ORDER BY v) FROM sp").fetchone()[0], [1, 3], "rows")


def check_error_recovery():
    with connect() as conn:
        conn.execute("CREATE TEMP TABLE er (v int PRIMARY KEY)")
        conn.execute("INSERT INTO er VALUES (1)")
        conn.commit()
        try:
            conn.execute("INSERT INTO er VALUES (%s)", (1,))
            raise CheckFailed("duplicate key accepted")
        except errors.UniqueViolation as e:
            expect_eq(e.diag.constraint_name, "er_pkey", "constraint")
        expect_eq(conn.info.transaction_status, pq.TransactionStatus.INERROR, "status after the error")
        expect_eq(sqlstate_of(lambda: conn.execute("SELECT 1")), "25P02", "a statement in a failed transaction")
        conn.rollback()
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after rollback")
        e = None
        try:
            conn.execute("SELECT %s::int", ("nope",))
        except errors.InvalidTextRepresentation as err:
            e = err
        expect(e is not None, "bad parameter accepted")
        conn.rollback()
        expect_eq(conn.execute("SELECT count(*) FROM er").fetchone()[0], 1, "rows")


def check_syntax_error():
    # A typo in a statement with one string literal, without and with a
    # parameter (its text unique to the variant: the proxy caches
    # classifications by text).
    with connect(autocommit=True) as conn:
        expect_eq(sqlstate_of(lambda: conn.execute(f"SELEC '{VARIANT}'")), "42601", "a syntax error")
        expect_eq(sqlstate_of(lambda: conn.execute(f"SELEC '{VARIANT}', %s", (1,))), "42601", "a syntax error with a parameter")
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after the syntax errors")


def check_notice():
    got = []
    with connect(autocommit=True) as conn:
        conn.add_notice_handler(lambda d: got.append((d.severity_nonlocalized, d.sqlstate, d.message_primary)))
        conn.execute("DO $$ BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful' USING ERRCODE = '01XYZ'; END $$")
    expect_eq(got, [("NOTICE", "00000", "hello 42"), ("WARNING", "01XYZ", "careful")], "notices")


def collect_notifies(conn, got, n):
    # Each poll runs a query, during which pending notifications arrive.
    wait_until("notifications", lambda: conn.execute("SELECT 1") and len(got) >= n)


def check_listen_notify():
    got = []
    with connect(autocommit=True) as a, connect(autocommit=True) as b:
        a.add_notify_handler(got.append)
        a.execute(f"LISTEN p3_{tag()}")
        b.execute(f"NOTIFY p3_{tag()}, 'hello'")
        b.execute("SELECT pg_notify(%s, %s)", (f"p3_{tag()}", "from function"))
        collect_notifies(a, got, 2)
        expect_eq([(x.channel, x.payload) for x in got], [(f"p3_{tag()}", "hello"), (f"p3_{tag()}", "from function")], "notifications")


def check_copy_out():
    with connect() as conn:
        cur = conn.cursor()
        rows = []
        with cur.copy("COPY (SELECT g, 'row ' || g FROM generate_series(1, 1000) g) TO STDOUT") as copy:
            copy.set_types(["int4", "text"])
            rows = list(copy.rows())
        expect_eq(len(rows), 1000, "rows")
        expect_eq(rows[-1], (1000, "row 1000"), "last row")
        data = b""
        with cur.copy("COPY (SELECT g FROM generate_series(1, 3) g) TO STDOUT (FORMAT BINARY)") as copy:
            for chunk in copy:
                data += bytes(chunk)
        expect(data.startswith(b"PGCOPY\n\xff\r\n\x00"), "binary COPY header")


def check_copy_in():
    with connect() as conn:
        cur = conn.cursor()
        cur.execute("CREATE TEMP TABLE ci (id int, name text)")
        with cur.copy("COPY ci FROM STDIN") as copy:
            for i in range(1, 501):
                copy.write_row((i, f"name {i}"))
        with cur.copy("COPY ci FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["int4", "text"])
            for i in range(501, 1001):
                copy.write_row((i, f"name {i}"))
        conn.commit()

        def bad():
            with cur.copy("COPY ci FROM STDIN") as copy:
                copy.write(b"x\ty\n")
        expect_eq(sqlstate_of(bad), "22P02", "bad COPY data")
        conn.rollback()
        expect_eq(conn.execute("SELECT count(*), sum(id) FROM ci").fetchone(), (1000, 500500), "rows")


def check_cancel():
    app = "p3cancel-" + uuid.uuid4().hex[:8]
    errs = []
    with connect(application_name=app) as conn, observer() as obs:
        def sleeper():
            errs.append(sqlstate_of(lambda: conn.execute("SELECT pg_sleep(60)")))
        th = threading.Thread(target=sleeper)
        th.start()
        try:
            wait_until("the query to run", lambda: obs.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'active' AND query LIKE '%%pg_sleep%%'",
                (app,)).fetchone()[0] == 1)
            conn.cancel()
            th.join(20)
        finally:
            th.join(60)
        expect_eq(errs, ["57014"], "the cancelled query's SQLSTATE")
        conn.rollback()
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after the cancel")


def check_statement_timeout():
    with connect() as conn:
        conn.execute("SET statement_timeout = '100ms'")
        expect_eq(sqlstate_of(lambda: conn.execute("SELECT pg_sleep(10)")), "57014", "the timed-out query")
        conn.rollback()
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after the timeout")


def check_server_cursor():
    with connect() as conn:
        expect_server_cursors(conn, "SELECT g FROM generate_series(1, %s) g", (1000,), f"p3_cursor_{tag()}", "p3_hold")
        with conn.cursor(name="p3_scroll", scrollable=True) as cur:
            cur.execute("SELECT g FROM generate_series(1, 10) g")
            cur.scroll(7, mode="absolute")
            expect_eq(cur.fetchone()[0], 8, "scrolled")


def check_pool():
    with psycopg_pool.ConnectionPool("", min_size=1, max_size=3, kwargs={"autocommit": True}, timeout=20) as pool:
        def worker(i):
            for j in range(5):
                with pool.connection() as c:
                    expect_eq(c.execute("SELECT %s::int + %s", (i, j)).fetchone()[0], i + j, "answer")
        errs = run_threads(6, worker)
        pool.check()
    expect_eq(errs, [], "errors")


def check_pipeline():
    with connect(autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE pl (id int PRIMARY KEY)")
        with conn.pipeline() as p:
            curs = [conn.execute("INSERT INTO pl VALUES (%s) RETURNING id", (i,)) for i in range(50)]
            last = conn.execute("SELECT count(*) FROM pl")
            p.sync()
            expect_eq([c.fetchone()[0] for c in curs], list(range(50)), "RETURNING ids")
            expect_eq(last.fetchone()[0], 50, "count in the pipeline")
        code = None
        try:
            with conn.pipeline():
                conn.execute("INSERT INTO pl VALUES (%s)", (1000,))
                conn.execute("INSERT INTO pl VALUES (%s)", (1,))  # duplicate
                conn.execute("INSERT INTO pl VALUES (%s)", (1001,))
        except psycopg.Error as e:
            code = e.sqlstate
        expect_eq(code, "23505", "error in the pipeline")
        # An autocommit pipeline up to its Sync is one implicit transaction.
        expect_eq(conn.execute("SELECT array_agg(id ORDER BY id) FROM pl WHERE id >= 1000").fetchone()[0], None, "rows after the error")
        with conn.transaction(), conn.pipeline():
            conn.execute("INSERT INTO pl VALUES (%s)", (2000,))
            conn.execute("SAVEPOINT s")
        expect_eq(conn.execute("SELECT count(*) FROM pl WHERE id = 2000").fetchone()[0], 1, "a transaction in the pipeline")


def check_large_value():
    text = "x" * (8 << 20) + "end"
    blob = os.urandom(4 << 20)
    with connect() as conn:
        t, md5, b = conn.execute("SELECT %s::text, md5(%s::text), %b::bytea", (text, text, blob)).fetchone()
        expect(t == text, "text value changed")
        expect_eq(md5, hashlib.md5(text.encode()).hexdigest(), "server-side md5")
        expect(bytes(b) == blob, "bytea value changed")
        b2 = conn.cursor(binary=True).execute("SELECT %b::bytea", (blob,)).fetchone()[0]
        expect(bytes(b2) == blob, "bytea value changed (binary result)")


def check_large_result():
    with connect() as conn:
        rows = conn.execute("SELECT g, repeat('x', 100) FROM generate_series(1, %s) g", (100000,)).fetchall()
        expect_eq(len(rows), 100000, "rows")
        expect_eq(rows[-1][0], 100000, "last row")


def check_client_encoding():
    with connect() as conn:
        conn.execute("SET client_encoding TO 'LATIN1'")
        expect_eq(conn.info.encoding, "iso8859-1", "the connection's Python codec")
        row = conn.execute("SELECT %s::text, octet_length(%s::text)", ("café ñ", "café ñ")).fetchone()
        expect_eq(row, ("café ñ", 8), "LATIN1 text and its UTF8 length in the server")
        expect_eq(sqlstate_of(lambda: conn.execute("SELECT chr(8364)")), "22P05", "a character LATIN1 lacks")
        conn.rollback()
        conn.execute("SET client_encoding TO 'EUC_JP'")
        expect_eq(conn.execute("SELECT %s::text", ("漢字",)).fetchone()[0], "漢字", "EUC_JP text")
        conn.execute("SET client_encoding TO 'UTF8'")
        expect_eq(conn.execute("SELECT %s::text", ("漢字 🐘",)).fetchone()[0], "漢字 🐘", "UTF8 text")


def check_backend_pid():
    app = "p3pid-" + uuid.uuid4().hex[:8]
    got = []
    with connect(autocommit=True, application_name=app) as conn, observer() as obs:
        pid = conn.info.backend_pid
        expect_eq(conn.execute("SELECT pg_backend_pid()").fetchone()[0], pid, "pg_backend_pid() against the driver's BackendKeyData PID")
        expect_eq(obs.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)).fetchone()[0], pid,
                  "pg_stat_activity's pid against the driver's")
        conn.add_notify_handler(got.append)
        conn.execute("LISTEN p3_self")
        conn.execute("NOTIFY p3_self")
        collect_notifies(conn, got, 1)
        expect_eq(got[0].pid, pid, "PID of a self-notification")


# --- fencing flows -----------------------------------------------------------

def job_key(check):
    return f"{tag()}:{check}"


OBS = Observer(observer)
acquire, receipts, result_row = OBS.acquire, OBS.receipts, OBS.result_row


def fenced(job, epoch, token, autocommit=False):
    return connect(autocommit=autocommit, options=fence_options(job, epoch, token))


def check_fence_acquire():
    job = job_key("acquire")
    with connect(autocommit=True) as conn:
        epoch, token = conn.execute("SELECT epoch, token FROM fence.acquire(%s, 'h1', interval '5 minutes')", (job,)).fetchone()
        expect(epoch >= 1 and token >= 1, f"epoch {epoch} token {token}")
        code = sqlstate_of(lambda: conn.execute("SELECT * FROM fence.acquire(%s, 'h2', interval '5 minutes')", (job,)))
        expect_eq(code, "FN002", "a second holder's acquire")


def check_fence_commit():
    job, epoch, token = committed_generation("commit")
    OBS.expect_committed(job, "p1", token)


def commit_once(job, epoch, token, payload, notices=None):
    with fenced(job, epoch, token) as conn:
        if notices is not None:
            conn.add_notice_handler(lambda d: notices.append(d.sqlstate))
        with conn.transaction():
            conn.execute(UPSERT, (job, payload, token))
            conn.execute("SELECT 1")


def committed_generation(check):
    job, epoch, token = OBS.new_generation(job_key(check))
    commit_once(job, epoch, token, "p1")
    return job, epoch, token


def check_fence_replay():
    receipts_need_proxy()
    job, epoch, token = committed_generation("replay")
    notices = []
    commit_once(job, epoch, token, "p1", notices)
    expect_eq(notices, ["FN00R"], "notices of the retried commit")
    expect_eq(receipts(job), 1, "receipts")
    expect_eq(result_row(job), ("p1", token), "the row")


def check_fence_conflict():
    receipts_need_proxy()
    job, epoch, token = committed_generation("conflict")
    with fenced(job, epoch, token) as conn:
        conn.execute(UPSERT, (job, "something else", token))
        expect_eq(sqlstate_of(conn.commit), "FN003", "a different payload under a committed generation")
        expect_eq(conn.info.transaction_status, pq.TransactionStatus.IDLE, "status after FN003")
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after the conflict")
    expect_eq(result_row(job), ("p1", token), "the row")


def check_fence_stale():
    job, epoch, old = OBS.new_generation(job_key("stale"))
    new = OBS.take_over(job, old)
    with fenced(job, epoch, old) as conn:
        code = sqlstate_of(lambda: conn.execute(UPSERT, (job, "zombie", old)))
        if code is None:
            code = sqlstate_of(conn.commit)
        expect_eq(code, "FN001", "a write under the token taken over")
        conn.rollback()
        expect_eq(conn.execute("SELECT 1").fetchone()[0], 1, "after FN001")
    expect_eq(result_row(job), None, "the row")
    return f"token {old} taken over by {new}"


def check_fence_autocommit():
    job, epoch, token = OBS.new_generation(job_key("autocommit"))
    with fenced(job, epoch, token, autocommit=True) as conn:
        conn.execute(UPSERT, (job, "auto", token))
    OBS.expect_committed(job, "auto", token)


def check_fence_copy():
    job, epoch, token = OBS.new_generation(job_key("copy"))
    with fenced(job, epoch, token, autocommit=True) as conn:
        with conn.cursor().copy("COPY results (job_key, payload, token) FROM STDIN") as copy:
            copy.write_row((job, "copied", token))
    OBS.expect_committed(job, "copied", token)


def check_fence_no_metadata():
    with connect(autocommit=True) as conn:
        expect_eq(sqlstate_of(lambda: conn.execute(UPSERT, (job_key("nometa"), "x", 1))), "FN008", "a write without fence metadata")
    expect_eq(result_row(job_key("nometa")), None, "the row")


def check_fence_pipeline():
    job, epoch, token = OBS.new_generation(job_key("pipeline"))
    with fenced(job, epoch, token, autocommit=True) as conn:
        with conn.pipeline():
            conn.execute("SELECT 1")
            conn.execute(UPSERT, (job, "piped", token))
            conn.execute("SELECT 2")
    OBS.expect_committed(job, "piped", token)
    return "pipeline mode"


CHECKS = [v for k, v in list(globals().items()) if k.startswith("check_")]

if __name__ == "__main__":
    for variant, settings in [("psycopg", {}), ("psycopg prepare_threshold=0", {"prepare_threshold": 0})]:
        VARIANT = variant
        THRESHOLD.clear()
        THRESHOLD.update(settings)
        run(variant, CHECKS)
