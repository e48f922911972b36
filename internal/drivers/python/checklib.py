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


def fence_options(job_key, epoch, token):
    return f"-c fence.job_key={job_key} -c fence.epoch={epoch} -c fence.token={token}"
