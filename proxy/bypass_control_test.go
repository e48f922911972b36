package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/internal/ownsql"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/rewrite"
)

// TestBypass/control (issue 30, HIGH 1): pgfence's own SQL in a database
// booby-trapped by a worker. The proxy's control connections (the catalog
// watcher, the pollers, the console's SHOW FENCES, the auth lookup) connect
// as the primary DSN's user, a superuser by default, into the database a
// client names; the CLI connects as whoever runs it, often a DBA. A worker
// that may create objects there, or owns the database, or made it, lays
// traps: operators and aggregates that match the proxy's comparisons
// better than pg_catalog's, functions, operators and types that shadow
// every built-in name pgfence uses (with pg_catalog placed last on the
// database's search_path), a fake fence schema of views whose functions
// run as whoever reads them. Every trap calls trap.fired, which logs the
// fact (RAISE LOG: it works on a read-only connection and on the replica),
// records it in trap.canary when it can, and, run by a superuser, makes
// the worker one. Each case drives one path that sends pgfence's own SQL
// into the trapped database, then asserts on a separate connection that
// the worker is not a superuser, that the canary is empty and that no
// server log (the primary's or the replica's) says a trap fired there.
// Each trap was seen to fire (and the worker to become a superuser where
// a superuser ran it) against the code before this class's fix.
func init() { registerBypass("control", bypassControl) }

// trapKind is how the worker got its traps into the database.
type trapKind int

const (
	// trapCreate: the worker may CREATE in schema public (PostgreSQL's
	// default before 15, so every upgraded cluster's), nothing more.
	// pg_catalog comes first on every search_path there, so its traps are
	// exact matches where pg_catalog has only a coercion or a
	// polymorphic candidate.
	trapCreate trapKind = iota
	// trapOwner: the worker owns the database (a real, migrated fence
	// schema in it) and set its search_path to trap, public, pg_catalog:
	// every built-in name pgfence calls, every operator it uses and every
	// type it casts to has a twin in trap.
	trapOwner
	// trapFake: the worker's own database (CREATEDB), never migrated,
	// with a fence schema of its own: views named as pgfence's tables,
	// whose functions run as whoever reads them, a replica_reached and a
	// schema version table that fire.
	trapFake
	// trapFakeRLS: the same with plain tables under forced row security,
	// whose policy fires for every reader that is not a superuser (the
	// least-privilege control role).
	trapFakeRLS
	// trapGrant: a real fence schema on which a DBA granted CREATE to the
	// worker, who overloaded fence.gate and fence.commit for the integer
	// literals the proxy's simple-protocol steps used to send.
	trapGrant
	// trapPremigrate: a database pgfence was never migrated to, where the
	// worker may CREATE in public and made tern's version table first,
	// with a trigger.
	trapPremigrate
)

// trapEnv is one trapped database.
type trapEnv struct {
	kind   trapKind
	db     string
	worker string
	su     *pgx.Conn // superuser in db, search_path pg_catalog (the checks must not fire traps)
}

// trapFired is the function every trap calls (WORKER: the worker's name).
const trapFired = `
CREATE TABLE trap.canary (what pg_catalog.text, by_session pg_catalog.name, by_user pg_catalog.name, app pg_catalog.text);
GRANT INSERT ON trap.canary TO PUBLIC;
CREATE FUNCTION trap.fired(what pg_catalog.text) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog AS $f$
BEGIN
  RAISE LOG 'pgfence-trap[%] % fired: session_user %, current_user %, application %, query: %', current_database(), what,
    session_user, current_user, current_setting('application_name'), left(current_query(), 400);
  BEGIN
    INSERT INTO trap.canary VALUES (what, session_user, current_user, current_setting('application_name'));
  EXCEPTION WHEN OTHERS THEN NULL;
  END;
  IF current_setting('is_superuser') = 'on' THEN
    BEGIN
      EXECUTE format('ALTER ROLE %I SUPERUSER', 'WORKER');
    EXCEPTION WHEN OTHERS THEN NULL;
    END;
  END IF;
  RETURN true;
END $f$;
GRANT EXECUTE ON FUNCTION trap.fired(pg_catalog.text) TO PUBLIC;
`

// trapCreateSQL: the worker's exact matches in public, for every
// comparison of two different types, and every polymorphic or variadic
// call, in pgfence's control SQL before the fix.
const trapCreateSQL = `
CREATE FUNCTION public.trap_oid_regclass(a pg_catalog.oid, b pg_catalog.regclass) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('=(oid,regclass)') AND a = b::oid; END $f$;
CREATE OPERATOR public.= (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.regclass, FUNCTION = public.trap_oid_regclass);
CREATE FUNCTION public.trap_oid_regnamespace(a pg_catalog.oid, b pg_catalog.regnamespace) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('=(oid,regnamespace)') AND a = b::oid; END $f$;
CREATE OPERATOR public.= (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.regnamespace, FUNCTION = public.trap_oid_regnamespace);
CREATE FUNCTION public.trap_oid_ge_int(a pg_catalog.oid, b pg_catalog.int4) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('>=(oid,integer)') AND a >= b::oid; END $f$;
CREATE OPERATOR public.>= (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.int4, FUNCTION = public.trap_oid_ge_int);
CREATE FUNCTION public.trap_oid_ne_int(a pg_catalog.oid, b pg_catalog.int4) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('<>(oid,integer)') AND a <> b::oid; END $f$;
CREATE OPERATOR public.<> (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.int4, FUNCTION = public.trap_oid_ne_int);
CREATE FUNCTION public.trap_numeric_int(a pg_catalog.numeric, b pg_catalog.int4) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('=(numeric,integer)') AND a = b::numeric; END $f$;
CREATE OPERATOR public.= (LEFTARG = pg_catalog.numeric, RIGHTARG = pg_catalog.int4, FUNCTION = public.trap_numeric_int);
CREATE FUNCTION public.format(f pg_catalog.text, a pg_catalog.text, b pg_catalog.text, c pg_catalog.bool) RETURNS pg_catalog.text
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN PERFORM trap.fired('format(text,text,text,boolean)'); RETURN format(f, a, b, c); END $f$;
CREATE FUNCTION public.trap_agg_oid(s pg_catalog.oid[], v pg_catalog.oid) RETURNS pg_catalog.oid[]
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN PERFORM trap.fired('array_agg(oid)'); RETURN s || v; END $f$;
CREATE AGGREGATE public.array_agg(pg_catalog.oid) (SFUNC = public.trap_agg_oid, STYPE = pg_catalog.oid[]);
`

// trapPremigrateSQL: tern's version table, made by the worker before the
// DBA's first pgfence migrate, which inserts and updates its row.
const trapPremigrateSQL = `
CREATE TABLE public.pgfence_schema_version (version pg_catalog.int4 NOT NULL);
INSERT INTO public.pgfence_schema_version VALUES (0);
CREATE FUNCTION public.trap_version() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pgfence_schema_version trigger'); RETURN NEW; END $f$;
CREATE TRIGGER trap_version BEFORE INSERT OR UPDATE ON public.pgfence_schema_version FOR EACH ROW EXECUTE FUNCTION public.trap_version();
GRANT ALL ON public.pgfence_schema_version TO PUBLIC;
`

// trapOwnerSQL: twins in schema trap, first on the database's search_path,
// of every function, operator and type pgfence named without a schema.
// The types come last: once trap.text exists, an unqualified text in
// the worker's own DDL would be it.
const trapOwnerSQL = `
CREATE FUNCTION trap.current_setting(n pg_catalog.text) RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('current_setting(text)'); RETURN current_setting(n); END $f$;
CREATE FUNCTION trap.current_setting(n pg_catalog.text, m pg_catalog.bool) RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('current_setting(text,boolean)'); RETURN current_setting(n, m); END $f$;
CREATE FUNCTION trap.to_regclass(n pg_catalog.text) RETURNS pg_catalog.regclass LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('to_regclass'); RETURN to_regclass(n); END $f$;
CREATE FUNCTION trap.to_regprocedure(n pg_catalog.text) RETURNS pg_catalog.regprocedure LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('to_regprocedure'); RETURN to_regprocedure(n); END $f$;
CREATE FUNCTION trap.pg_current_wal_insert_lsn() RETURNS pg_catalog.pg_lsn LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_current_wal_insert_lsn'); RETURN pg_current_wal_insert_lsn(); END $f$;
CREATE FUNCTION trap.pg_current_wal_lsn() RETURNS pg_catalog.pg_lsn LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_current_wal_lsn'); RETURN pg_current_wal_lsn(); END $f$;
CREATE FUNCTION trap.pg_last_wal_replay_lsn() RETURNS pg_catalog.pg_lsn LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_last_wal_replay_lsn'); RETURN pg_last_wal_replay_lsn(); END $f$;
CREATE FUNCTION trap.pg_is_in_recovery() RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_is_in_recovery'); RETURN pg_is_in_recovery(); END $f$;
CREATE FUNCTION trap.now() RETURNS pg_catalog.timestamptz LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('now'); RETURN now(); END $f$;
CREATE FUNCTION trap.clock_timestamp() RETURNS pg_catalog.timestamptz LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('clock_timestamp'); RETURN clock_timestamp(); END $f$;
CREATE FUNCTION trap.to_char(v pg_catalog.timestamp, f pg_catalog.text) RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('to_char'); RETURN to_char(v, f); END $f$;
CREATE FUNCTION trap.md5(v pg_catalog.text) RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('md5'); RETURN md5(v); END $f$;
CREATE FUNCTION trap.regexp_matches(s pg_catalog.text, r pg_catalog.text, f pg_catalog.text) RETURNS SETOF pg_catalog.text[]
  LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('regexp_matches'); RETURN QUERY SELECT regexp_matches(s, r, f); END $f$;
CREATE FUNCTION trap.agg_text(s pg_catalog.text, v pg_catalog.text, d pg_catalog.text) RETURNS pg_catalog.text
  LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('string_agg'); RETURN CASE WHEN s IS NULL THEN v ELSE s || d || v END; END $f$;
CREATE AGGREGATE trap.string_agg(pg_catalog.text, pg_catalog.text) (SFUNC = trap.agg_text, STYPE = pg_catalog.text);
CREATE FUNCTION trap.pg_advisory_lock(k pg_catalog.int8) RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_advisory_lock'); PERFORM pg_advisory_lock(k); END $f$;
CREATE FUNCTION trap.pg_advisory_unlock(k pg_catalog.int8) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('pg_advisory_unlock'); RETURN pg_advisory_unlock(k); END $f$;
CREATE FUNCTION trap.eq_oid(a pg_catalog.oid, b pg_catalog.oid) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN RETURN trap.fired('=(oid,oid)') AND a = b; END $f$;
CREATE OPERATOR trap.= (LEFTARG = pg_catalog.oid, RIGHTARG = pg_catalog.oid, FUNCTION = trap.eq_oid);
CREATE FUNCTION trap.eq_text(a pg_catalog.text, b pg_catalog.text) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN RETURN trap.fired('=(text,text)') AND a = b; END $f$;
CREATE OPERATOR trap.= (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = trap.eq_text);
CREATE FUNCTION trap.eq_name(a pg_catalog.name, b pg_catalog.name) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN RETURN trap.fired('=(name,name)') AND a = b; END $f$;
CREATE OPERATOR trap.= (LEFTARG = pg_catalog.name, RIGHTARG = pg_catalog.name, FUNCTION = trap.eq_name);
CREATE FUNCTION trap.eq_int8(a pg_catalog.int8, b pg_catalog.int8) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN RETURN trap.fired('=(bigint,bigint)') AND a = b; END $f$;
CREATE OPERATOR trap.= (LEFTARG = pg_catalog.int8, RIGHTARG = pg_catalog.int8, FUNCTION = trap.eq_int8);
CREATE FUNCTION trap.gt_tstz(a pg_catalog.timestamptz, b pg_catalog.timestamptz) RETURNS pg_catalog.bool LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN RETURN trap.fired('>(timestamptz,timestamptz)') AND a > b; END $f$;
CREATE OPERATOR trap.> (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = trap.gt_tstz);
CREATE FUNCTION trap.mi_lsn(a pg_catalog.pg_lsn, b pg_catalog.pg_lsn) RETURNS pg_catalog.numeric LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('-(pg_lsn,pg_lsn)'); RETURN a - b; END $f$;
CREATE OPERATOR trap.- (LEFTARG = pg_catalog.pg_lsn, RIGHTARG = pg_catalog.pg_lsn, FUNCTION = trap.mi_lsn);
CREATE FUNCTION trap.mod_numeric(a pg_catalog.numeric, b pg_catalog.numeric) RETURNS pg_catalog.numeric LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('%(numeric,numeric)'); RETURN a % b; END $f$;
CREATE OPERATOR trap.% (LEFTARG = pg_catalog.numeric, RIGHTARG = pg_catalog.numeric, FUNCTION = trap.mod_numeric);
CREATE FUNCTION trap.cat_text(a pg_catalog.text, b pg_catalog.text) RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('||(text,text)'); RETURN a || b; END $f$;
CREATE OPERATOR trap.|| (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = trap.cat_text);
CREATE DOMAIN trap.text AS pg_catalog.text CHECK (trap.fired('domain text'));
CREATE DOMAIN trap.name AS pg_catalog.name CHECK (trap.fired('domain name'));
CREATE DOMAIN trap.oid AS pg_catalog.oid CHECK (trap.fired('domain oid'));
CREATE DOMAIN trap.regclass AS pg_catalog.regclass CHECK (trap.fired('domain regclass'));
CREATE DOMAIN trap.pg_lsn AS pg_catalog.pg_lsn CHECK (trap.fired('domain pg_lsn'));
CREATE DOMAIN trap.int8 AS pg_catalog.int8 CHECK (trap.fired('domain int8'));
`

// trapFakeSQL: the worker's own fence schema, of views; and tern's version
// table, a view too.
const trapFakeSQL = `
CREATE TABLE public.results (job_key pg_catalog.text PRIMARY KEY, payload pg_catalog.text, token pg_catalog.int8);
CREATE SCHEMA fence;
CREATE VIEW fence.protected_tables AS
  SELECT 'public.results'::pg_catalog.regclass AS relid, 'public'::pg_catalog.text AS schema_name, 'results'::pg_catalog.text AS table_name,
         NULL::pg_catalog.text AS job_key_column, NULL::pg_catalog.regclass AS root, pg_catalog.now() AS protected_at
  WHERE trap.fired('fake fence.protected_tables');
CREATE VIEW fence.fences AS
  SELECT 'job'::pg_catalog.text AS job_key, 1::pg_catalog.int8 AS epoch, 1::pg_catalog.int8 AS max_issued_token, NULL::pg_catalog.timestamptz AS retired_at
  WHERE trap.fired('fake fence.fences');
CREATE VIEW fence.leases AS
  SELECT 'job'::pg_catalog.text AS job_key, 'h'::pg_catalog.text AS holder, 1::pg_catalog.int8 AS token, pg_catalog.now() AS expires_at
  WHERE trap.fired('fake fence.leases');
CREATE VIEW fence.issuance AS
  SELECT 1::pg_catalog.int8 AS token, 'job'::pg_catalog.text AS job_key, 1::pg_catalog.int8 AS epoch, 'h'::pg_catalog.text AS holder,
         pg_catalog.now() AS issued_at WHERE trap.fired('fake fence.issuance');
CREATE VIEW fence.receipts AS
  SELECT 'job'::pg_catalog.text AS job_key, 1::pg_catalog.int8 AS epoch, 1::pg_catalog.int8 AS token, ''::pg_catalog.text AS step,
         ''::pg_catalog.bytea AS payload_digest, 'v'::pg_catalog.text AS digest_version, pg_catalog.now() AS committed_at
  WHERE trap.fired('fake fence.receipts');
CREATE VIEW fence.jobs AS
  SELECT 'job'::pg_catalog.text AS job_key, 1::pg_catalog.int8 AS epoch, NULL::pg_catalog.timestamptz AS retired_at,
         'h'::pg_catalog.text AS lease_holder, pg_catalog.now() AS lease_expires_at, true AS lease_live
  WHERE trap.fired('fake fence.jobs');
CREATE FUNCTION fence.replica_reached(j pg_catalog.text, e pg_catalog.int8, t pg_catalog.int8) RETURNS pg_catalog.bool
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN RETURN trap.fired('fake fence.replica_reached'); END $f$;
CREATE FUNCTION fence.gc(k pg_catalog.interval) RETURNS pg_catalog.int8
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN PERFORM trap.fired('fake fence.gc'); RETURN 0; END $f$;
CREATE FUNCTION fence.protect(r pg_catalog.regclass, c pg_catalog.text) RETURNS void
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN PERFORM trap.fired('fake fence.protect'); END $f$;
CREATE VIEW public.pgfence_schema_version AS SELECT 10 AS version WHERE trap.fired('fake pgfence_schema_version');
`

// trapFakeRLSSQL: the worker's own fence schema, of plain tables whose
// forced row security fires for every reader but a superuser.
const trapFakeRLSSQL = `
CREATE TABLE public.results (job_key pg_catalog.text PRIMARY KEY, payload pg_catalog.text, token pg_catalog.int8);
CREATE SCHEMA fence;
CREATE TABLE fence.protected_tables (relid pg_catalog.regclass, schema_name pg_catalog.text, table_name pg_catalog.text,
  job_key_column pg_catalog.text, root pg_catalog.regclass, protected_at pg_catalog.timestamptz);
INSERT INTO fence.protected_tables VALUES ('public.results', 'public', 'results', NULL, NULL, pg_catalog.now());
CREATE TABLE fence.fences (job_key pg_catalog.text, epoch pg_catalog.int8, max_issued_token pg_catalog.int8, retired_at pg_catalog.timestamptz);
INSERT INTO fence.fences VALUES ('job', 1, 1, NULL);
CREATE TABLE fence.leases (job_key pg_catalog.text, holder pg_catalog.text, token pg_catalog.int8, expires_at pg_catalog.timestamptz);
INSERT INTO fence.leases VALUES ('job', 'h', 1, pg_catalog.now());
ALTER TABLE fence.protected_tables ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
ALTER TABLE fence.fences ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
ALTER TABLE fence.leases ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
CREATE POLICY p ON fence.protected_tables USING (trap.fired('fake fence.protected_tables policy'));
CREATE POLICY p ON fence.fences USING (trap.fired('fake fence.fences policy'));
CREATE POLICY p ON fence.leases USING (trap.fired('fake fence.leases policy'));
GRANT USAGE ON SCHEMA fence TO PUBLIC;
GRANT SELECT ON fence.protected_tables, fence.fences, fence.leases TO PUBLIC;
`

// trapGrantSQL: overloads of the gate's and the receipt's functions for
// the integer literals of the simple-protocol steps, in a real fence
// schema the worker was given CREATE on.
const trapGrantSQL = `
CREATE FUNCTION fence.gate(j pg_catalog.text, e pg_catalog.int4, t pg_catalog.int4, s pg_catalog.text) RETURNS pg_catalog.text
  LANGUAGE plpgsql SET search_path = pg_catalog AS $f$ BEGIN PERFORM trap.fired('fence.gate(text,integer,integer,text)'); RETURN 'ok'; END $f$;
CREATE FUNCTION fence.commit(j pg_catalog.text, e pg_catalog.int4, t pg_catalog.int4, s pg_catalog.text, d pg_catalog.bytea, v pg_catalog.text)
  RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('fence.commit(text,integer,integer,...)'); RETURN 'committed'; END $f$;
CREATE FUNCTION fence.commit_if_written(j pg_catalog.text, e pg_catalog.int4, t pg_catalog.int4, s pg_catalog.text, d pg_catalog.bytea, v pg_catalog.text)
  RETURNS pg_catalog.text LANGUAGE plpgsql SET search_path = pg_catalog
  AS $f$ BEGIN PERFORM trap.fired('fence.commit_if_written(text,integer,integer,...)'); RETURN 'none'; END $f$;
`

// newTrapEnv makes a database of kind, its worker and its traps.
func newTrapEnv(t *testing.T, kind trapKind) *trapEnv {
	t.Helper()
	ctx := ctxT(t)
	e := &trapEnv{kind: kind}
	var base string
	switch kind {
	case trapFake, trapFakeRLS, trapPremigrate:
		base = cluster.NewDatabase(t) // only for a unique name
	default:
		base = cluster.NewDatabaseWith(t, ddlTriggerSQL+fenceSchema)
	}
	prefix, _, _ := strings.Cut(base, "_")
	e.worker = prefix + "_trapper"
	id := pgx.Identifier{e.worker}.Sanitize()
	root := cluster.Primary.MustConnect(t, "postgres")
	execOK(t, root, "CREATE ROLE "+id+" LOGIN CREATEDB IN ROLE pgfence_worker")
	fired := strings.ReplaceAll(trapFired, "WORKER", e.worker)
	switch kind {
	case trapFake, trapFakeRLS:
		// The worker makes its own database, as CREATEDB lets it.
		e.db = base + "_own"
		w := connectRole(t, "postgres", e.worker)
		execOK(t, w, "CREATE DATABASE "+pgx.Identifier{e.db}.Sanitize()+" TEMPLATE template0")
		t.Cleanup(func() {
			if err := cluster.DropDatabase(context.Background(), e.db); err != nil {
				t.Logf("drop %s: %v", e.db, err)
			}
		})
		schema := trapFakeSQL
		if kind == trapFakeRLS {
			schema = trapFakeRLSSQL
		}
		own := connectRole(t, e.db, e.worker)
		execOK(t, own, "CREATE SCHEMA trap; GRANT USAGE ON SCHEMA trap TO PUBLIC;"+fired+schema)
	case trapPremigrate:
		// A database the DBA made for pgfence and has not migrated yet.
		e.db = base + "_new"
		execOK(t, root, "CREATE DATABASE "+pgx.Identifier{e.db}.Sanitize()+" TEMPLATE template0")
		t.Cleanup(func() {
			if err := cluster.DropDatabase(context.Background(), e.db); err != nil {
				t.Logf("drop %s: %v", e.db, err)
			}
		})
		su := cluster.Primary.MustConnect(t, e.db)
		execOK(t, su, "GRANT CREATE ON SCHEMA public TO "+id+"; CREATE SCHEMA trap AUTHORIZATION "+id+"; GRANT USAGE ON SCHEMA trap TO PUBLIC")
		w := connectRole(t, e.db, e.worker)
		execOK(t, w, fired+trapCreateSQL+trapPremigrateSQL)
	default:
		e.db = base
		su := cluster.Primary.MustConnect(t, e.db)
		execOK(t, su, fmt.Sprintf(`
GRANT CREATE ON SCHEMA public TO %[1]s;
CREATE SCHEMA trap AUTHORIZATION %[1]s;
GRANT USAGE ON SCHEMA trap TO PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON results, audit TO %[1]s;
GRANT USAGE ON SEQUENCE audit_id_seq TO %[1]s;`, id))
		switch kind {
		case trapOwner:
			execOK(t, su, "ALTER DATABASE "+pgx.Identifier{e.db}.Sanitize()+" OWNER TO "+id)
		case trapGrant:
			execOK(t, su, "GRANT CREATE ON SCHEMA fence TO "+id)
		}
		w := connectRole(t, e.db, e.worker)
		execOK(t, w, fired)
		switch kind {
		case trapCreate:
			execOK(t, w, trapCreateSQL)
		case trapOwner:
			execOK(t, w, trapCreateSQL+trapOwnerSQL)
			// The database's owner puts its twins before pg_catalog, for
			// every session that starts from now on.
			execOK(t, w, "ALTER DATABASE "+pgx.Identifier{e.db}.Sanitize()+" SET search_path = trap, public, pg_catalog")
		case trapGrant:
			execOK(t, w, trapGrantSQL)
		}
	}
	// Every statement run in the database is logged (TestBypass/control's
	// every_text reads them back).
	execOK(t, root, "ALTER DATABASE "+pgx.Identifier{e.db}.Sanitize()+" SET log_statement = 'all'")
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	e.su = connectSU(t, e.db)
	return e
}

// connectRole connects directly to db as role (trust on 127.0.0.1).
func connectRole(t *testing.T, db, role string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", url.PathEscape(role), cluster.Primary.Addr(), db))
	if err != nil {
		t.Fatal(err)
	}
	return connectPgx(t, cfg)
}

// connectSU is a superuser connection to db whose own queries no trap can
// catch: search_path is pg_catalog alone.
func connectSU(t *testing.T, db string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = "pg_catalog"
	return connectPgx(t, cfg)
}

// noFire asserts that nothing the worker laid has run anywhere but in the
// worker's own statements: the worker is no superuser, the canary is
// empty, and neither server's log says a trap fired in e.db.
func (e *trapEnv) noFire(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	var super bool
	if err := e.su.QueryRow(ctx, "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) $1", e.worker).Scan(&super); err != nil {
		t.Fatal(err)
	}
	var canary []string
	rows, err := e.su.Query(ctx, "SELECT what || ' by ' || by_session || '/' || by_user || ' (' || app || ')' FROM trap.canary")
	if err != nil {
		t.Fatal(err)
	}
	if canary, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	logged := trapLog(t, e.db)
	if super || len(canary) > 0 || len(logged) > 0 {
		t.Fatalf("a trap fired in %s: worker superuser=%v, canary %q, logged:\n%s", e.db, super, canary, strings.Join(logged, "\n"))
	}
}

// trapLog is every log line, on the primary and the replica, of a trap
// that fired in db.
func trapLog(t *testing.T, db string) []string {
	t.Helper()
	var out []string
	mark := "pgfence-trap[" + db + "]"
	for _, n := range []*pgtest.Node{cluster.Primary, cluster.Replica} {
		b, err := os.ReadFile(n.LogPath)
		if err != nil {
			t.Fatalf("read the %s's log: %v", n.Name, err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, mark) {
				out = append(out, n.Name+": "+l)
			}
		}
	}
	return out
}

// trapProxy is a gated proxy in front of the cluster (the primary DSN's
// user: the superuser postgres, the default the issue attacks), with the
// replica for read routing when reads, and the console's users.
func trapProxy(t *testing.T, reads bool, cfg Config) (*testProxy, *Fence) {
	t.Helper()
	gate := newGate(t)
	cfg.Interceptor = gate
	if reads {
		cfg.Replicas = []string{cluster.Replica.DSN("postgres")}
		cfg.ReplicaPoll = 10 * time.Millisecond
		cfg.ReplicaMaxLag = time.Minute
	}
	return startProxy(t, withConsole(cfg)), gate
}

// session opens a session through p into e.db as the worker (its
// generation's settings in opts), which starts the database's watcher and
// waits for its first load.
func (e *trapEnv) session(t *testing.T, p *testProxy, opts ...string) *pgconn.PgConn {
	t.Helper()
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", url.PathEscape(e.worker), p.addr.Port, e.db))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	c := connectConfig(t, cfg)
	mustExec(t, c, "SELECT 1")
	return c
}

// waitLoads waits until g's watcher of db has loaded more than n times.
func waitLoads(t *testing.T, g *Fence, db string, n int64) {
	t.Helper()
	c := catalogOf(t, g, db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return c.loads.Load() > n, nil }); err != nil {
		t.Fatalf("the watcher of %s never loaded again: %v", db, err)
	}
}

// controlCase is one path that sends pgfence's own SQL into a trapped
// database of kind.
type controlCase struct {
	name  string
	kind  trapKind
	drive func(t *testing.T, e *trapEnv)
}

func bypassControl(t *testing.T) {
	var cases []controlCase
	for _, k := range []struct {
		name string
		kind trapKind
	}{{"create", trapCreate}, {"owner", trapOwner}, {"fake", trapFake}} {
		cases = append(cases,
			controlCase{k.name + "/watcher_load", k.kind, driveWatcherLoad},
			controlCase{k.name + "/watcher_reload", k.kind, driveWatcherReload},
			controlCase{k.name + "/takeover", k.kind, driveTakeover},
			controlCase{k.name + "/reads_watcher_and_pollers", k.kind, driveReads},
			controlCase{k.name + "/console_stats", k.kind, driveConsole("watcher")},
			controlCase{k.name + "/console_admin", k.kind, driveConsole("admin")},
			controlCase{k.name + "/console_all_databases", k.kind, driveConsoleAll},
			controlCase{k.name + "/auth_lookup", k.kind, driveAuth},
			controlCase{k.name + "/cli_protect_list", k.kind, driveCLI(false, "protect", "list")},
			controlCase{k.name + "/cli_lease_list", k.kind, driveCLI(false, "lease", "list")},
		)
	}
	cases = append(cases,
		controlCase{"owner/in_session_commit_lsn", trapOwner, driveCommitLSN},
		controlCase{"owner/in_session_replica_fence_check", trapOwner, driveFenceCheck},
		controlCase{"owner/in_session_gated_write", trapOwner, driveGatedWrite},
		controlCase{"owner/cli_audit", trapOwner, driveCLI(false, "audit", "--since", "1h")},
		controlCase{"owner/cli_gc", trapOwner, driveCLI(false, "gc")},
		controlCase{"owner/cli_migrate", trapOwner, driveCLI(false, "migrate")},
		controlCase{"fake/cli_migrate", trapFake, driveCLI(true, "migrate")},
		controlCase{"premigrate/cli_migrate", trapPremigrate, driveCLI(true, "migrate")},
		controlCase{"fake/cli_gc", trapFake, driveCLI(true, "gc")},
		controlCase{"fake/cli_protect_add", trapFake, driveCLI(true, "protect", "add", "results")},
		controlCase{"grant/in_session_gated_write", trapGrant, driveGatedWrite},
	)
	cases = append(cases,
		controlCase{"fake/untrusted_reported", trapFake, driveUntrustedReported},
		controlCase{"grant/untrusted_reported", trapGrant, driveUntrustedReported},
		controlCase{"fake_rls/watcher_load_least_privilege", trapFakeRLS, driveLeastPrivilege(false)},
		controlCase{"fake_rls/console_admin_least_privilege", trapFakeRLS, driveLeastPrivilege(true)},
		controlCase{"pins/standard_conforming_strings_read_set", trapOwner, drivePinnedReadSet},
		controlCase{"pins/role_console", trapOwner, drivePinnedRole},
		controlCase{"pins/client_encoding_names", trapOwner, drivePinnedEncoding},
		controlCase{"pins/local_preload_libraries_console", trapOwner, drivePinnedLibraries},
		controlCase{"pins/dsn_options", trapOwner, driveDSNOptions},
		controlCase{"pins/alter_role_in_database", trapOwner, driveRoleSetting},
	)
	cases = append(cases,
		controlCase{"least_privilege/watcher_takeover_reads_console", trapOwner, driveControlRole},
		controlCase{"least_privilege/auth_lookup_function", trapOwner, driveAuthFunction},
		controlCase{"superuser_warning", trapOwner, driveSuperuserWarning},
		controlCase{"every_text", trapOwner, driveEveryText},
	)
	for _, p := range controlPins {
		cases = append(cases, controlCase{"pins/" + p.setting, trapOwner, drivePin(p.setting, p.hostile, p.want)})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newTrapEnv(t, c.kind)
			c.drive(t, e)
			e.noFire(t)
		})
	}
}

// controlPins: a setting a database's owner may set for every session
// there, a value of it that would turn a control connection (the DSN's
// user: a superuser) against the proxy, and what the connection runs with.
var controlPins = []struct{ setting, hostile, want string }{
	{"search_path", "public", "pg_catalog, pg_temp"},
	{"role", "WORKER", "none"},
	{"local_preload_libraries", "pgfence_no_such_library", ""},
	{"client_encoding", "LATIN1", "UTF8"},
	{"standard_conforming_strings", "off", "on"},
	{"transform_null_equals", "on", "off"},
	{"default_transaction_isolation", "serializable", "read committed"},
	{"default_transaction_deferrable", "on", "off"},
	{"statement_timeout", "1", "0"},
	{"lock_timeout", "1", "0"},
	{"idle_in_transaction_session_timeout", "1", "0"},
	{"idle_session_timeout", "1", "0"},
	{"exit_on_error", "on", "off"},
	{"default_transaction_read_only", "off", "on"},
	{"row_security", "on", "off"},
	{"jit", "on", "off"},
}

// ownerSets runs ALTER DATABASE e.db SET setting = value as the worker,
// the database's owner (a new session there gets it from then on).
func (e *trapEnv) ownerSets(t *testing.T, setting, value string) {
	t.Helper()
	execOK(t, connectRole(t, e.db, e.worker), fmt.Sprintf("ALTER DATABASE %s SET %s = %s",
		pgx.Identifier{e.db}.Sanitize(), setting, pgx.Identifier{strings.ReplaceAll(value, "WORKER", e.worker)}.Sanitize()))
}

// controlSetting opens a control connection to e.db as the proxy would
// (the cluster's superuser, settings pinned) with cfg's changes, and
// returns setting there and the connection's current_user.
func (e *trapEnv) controlSetting(t *testing.T, setting string, change func(*pgconn.Config)) (string, string) {
	t.Helper()
	base, err := pgconn.ParseConfig(cluster.Primary.DSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	if change != nil {
		change(base)
	}
	c := connectConfig(t, controlConfig(base, e.db, "pgfence pin check"))
	res := c.ExecParams(ctxT(t), "SELECT pg_catalog.current_setting($1), current_user::pg_catalog.text", [][]byte{[]byte(setting)}, nil, nil, nil).Read()
	if res.Err != nil || len(res.Rows) != 1 {
		t.Fatalf("read %s: %v", setting, res.Err)
	}
	return string(res.Rows[0][0]), string(res.Rows[0][1])
}

// drivePin: the database's owner sets setting to hostile; a control
// connection still runs with want, as the DSN's own user.
func drivePin(setting, hostile, want string) func(t *testing.T, e *trapEnv) {
	return func(t *testing.T, e *trapEnv) {
		e.ownerSets(t, setting, hostile)
		got, user := e.controlSetting(t, setting, nil)
		if got != want || user != "postgres" {
			t.Fatalf("a control connection runs with %s = %q as %s, want %q as postgres", setting, got, user, want)
		}
	}
}

// driveDSNOptions: the DSN's own options do not unpin either.
func driveDSNOptions(t *testing.T, e *trapEnv) {
	got, user := e.controlSetting(t, "search_path", func(c *pgconn.Config) {
		c.RuntimeParams["options"] = "-c search_path=trap,public -c role=" + e.worker
	})
	if got != ownsql.SearchPath || user != "postgres" {
		t.Fatalf("search_path %q as %s, want %q as postgres", got, user, ownsql.SearchPath)
	}
}

// driveRoleSetting: nor do the DSN user's own settings in the database.
func driveRoleSetting(t *testing.T, e *trapEnv) {
	execOK(t, e.su, "ALTER ROLE postgres IN DATABASE "+pgx.Identifier{e.db}.Sanitize()+" SET search_path = trap, public")
	t.Cleanup(func() {
		e.su.Exec(context.Background(), "ALTER ROLE postgres IN DATABASE "+pgx.Identifier{e.db}.Sanitize()+" RESET search_path")
	})
	if got, _ := e.controlSetting(t, "search_path", nil); got != ownsql.SearchPath {
		t.Fatalf("search_path %q, want %q", got, ownsql.SearchPath)
	}
	p, _ := trapProxy(t, true, Config{})
	e.session(t, p)
	e.lease(t)
	showFencesOK(t, p, e.db)
}

// showFencesOK runs SHOW FENCES db as an admin, which must answer with a
// row showing a token.
func showFencesOK(t *testing.T, p *testProxy, db string) {
	t.Helper()
	c, err := consoleConnect(t, p, "admin", consolePassword("admin"))
	if err != nil {
		t.Fatal(err)
	}
	rows := show(t, c, "SHOW FENCES "+db)
	if len(rows) == 0 || rows[0]["max_issued_token"] == "" {
		t.Fatalf("SHOW FENCES %s: %v, want a fence row with its token", db, rows)
	}
}

// drivePinnedReadSet: with standard_conforming_strings off for the
// database, the read set still finds a view that runs SQL (query_to_xml).
func drivePinnedReadSet(t *testing.T, e *trapEnv) {
	execOK(t, e.su, "CREATE VIEW public.v_xml AS SELECT pg_catalog.query_to_xml('SELECT payload FROM public.results', false, false, '')::pg_catalog.text AS payload")
	e.ownerSets(t, "standard_conforming_strings", "off")
	p, g := trapProxy(t, true, Config{})
	e.session(t, p)
	cat := catalogOf(t, g, e.db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.reads.Load() != nil, nil }); err != nil {
		t.Fatalf("no read set: %v", err)
	}
	if !cat.reads.Load().exposes(rewrite.RelName{Schema: "public", Name: "v_xml"}) {
		t.Fatal("a view calling query_to_xml is not in the read set as reaching protected data")
	}
}

// drivePinnedRole: with role set to the worker for the database, SHOW
// FENCES still reads as the DSN's user.
func drivePinnedRole(t *testing.T, e *trapEnv) {
	e.lease(t)
	e.ownerSets(t, "role", "WORKER")
	p, _ := trapProxy(t, false, Config{})
	showFencesOK(t, p, e.db)
}

// drivePinnedEncoding: with client_encoding LATIN1 for the database, the
// watcher still reads a protected table's name as it is.
func drivePinnedEncoding(t *testing.T, e *trapEnv) {
	execOK(t, e.su, `CREATE TABLE public."résultats" (k pg_catalog.int4); SELECT fence.protect('public."résultats"')`)
	e.ownerSets(t, "client_encoding", "LATIN1")
	p, g := trapProxy(t, false, Config{})
	e.session(t, p)
	if !catalogOf(t, g, e.db).prot.Load().Matches(rewrite.RelName{Schema: "public", Name: "résultats"}, nil) {
		t.Fatal("the watcher does not know public.résultats as protected")
	}
}

// drivePinnedLibraries: a library name that is not there, loaded into
// every session of the database, does not keep SHOW FENCES out of it.
func drivePinnedLibraries(t *testing.T, e *trapEnv) {
	e.lease(t)
	e.ownerSets(t, "local_preload_libraries", "pgfence_no_such_library")
	p, _ := trapProxy(t, false, Config{})
	showFencesOK(t, p, e.db)
}

// driveUntrustedReported: a database whose schema fence is not trusted is
// treated as having none, and the catalog says why, distinctly from a
// database with no schema fence.
func driveUntrustedReported(t *testing.T, e *trapEnv) {
	p, g := trapProxy(t, false, Config{})
	e.session(t, p)
	cat := catalogOf(t, g, e.db)
	if cat.schema.Load() || cat.prot.Load().Len() != 0 || cat.untrusted.Load() == nil {
		t.Fatalf("schema %v, %d protected tables, untrusted %v: want no schema, none, and why", cat.schema.Load(), cat.prot.Load().Len(), cat.untrusted.Load())
	}
	t.Logf("untrusted: %s", *cat.untrusted.Load())
	plain := cluster.NewDatabase(t)
	execOK(t, cluster.Primary.MustConnect(t, plain), "DROP SCHEMA fence CASCADE")
	e2 := &trapEnv{db: plain, worker: e.worker}
	e2.session(t, p)
	if c := catalogOf(t, g, plain); c.schema.Load() || c.untrusted.Load() != nil {
		t.Fatalf("a database without schema fence: schema %v, untrusted %v", c.schema.Load(), c.untrusted.Load())
	}
}

// driveLeastPrivilege: the proxy's DSN is a role that is no superuser (a
// member of pgfence_control, where the database has it): the fake fence's
// row security would run its policy as that role. console: SHOW FENCES by
// an admin, else a session (the watcher).
func driveLeastPrivilege(console bool) func(t *testing.T, e *trapEnv) {
	return func(t *testing.T, e *trapEnv) {
		ctl := controlRole(t)
		p, _ := leastPrivilegeProxy(t, ctl, Config{})
		if console {
			c, err := consoleConnect(t, p, "admin", consolePassword("admin"))
			if err != nil {
				t.Fatal(err)
			}
			rows, err := c.Query(ctxT(t), "SHOW FENCES "+e.db)
			if err == nil {
				rows.Close()
				err = rows.Err()
			}
			t.Logf("SHOW FENCES: %v", err)
			return
		}
		e.session(t, p)
	}
}

// controlRole is a LOGIN role for the proxy's DSN that is a member of
// pgfence_control and nothing more.
func controlRole(t *testing.T) string {
	t.Helper()
	db := cluster.NewDatabase(t)
	prefix, _, _ := strings.Cut(db, "_")
	role := prefix + "_control"
	execOK(t, cluster.Primary.MustConnect(t, "postgres"), "CREATE ROLE "+role+" LOGIN IN ROLE pgfence_control")
	return role
}

// leastPrivilegeProxy is trapProxy with role as the primary's (and, with
// cfg.Replicas not nil, the replica's) DSN user.
func leastPrivilegeProxy(t *testing.T, role string, cfg Config) (*testProxy, *Fence) {
	t.Helper()
	return leastPrivilegeProxyLog(t, role, cfg, zaptest.NewLogger(t))
}

// driveWatcherLoad: a session starts the database's watcher (LISTEN, the
// protected tables, the takeover floor).
func driveWatcherLoad(t *testing.T, e *trapEnv) {
	p, _ := trapProxy(t, false, Config{})
	e.session(t, p)
}

// driveWatcherReload: then a notification makes it load again.
func driveWatcherReload(t *testing.T, e *trapEnv) {
	p, g := trapProxy(t, false, Config{})
	e.session(t, p)
	n := catalogOf(t, g, e.db).loads.Load()
	execOK(t, connectRole(t, e.db, e.worker), "NOTIFY pgfence_protected")
	waitLoads(t, g, e.db, n)
}

// driveTakeover: a takeover's notification makes the watcher read the
// job's fence row (and the primary's position) on its connection.
func driveTakeover(t *testing.T, e *trapEnv) {
	p, g := trapProxy(t, false, Config{})
	e.session(t, p)
	cat := catalogOf(t, g, e.db)
	n := cat.tk.verified.Load()
	w := connectRole(t, e.db, e.worker)
	if e.kind == trapFake || e.kind == trapFakeRLS {
		// No fence.acquire there: anyone may notify.
		execOK(t, w, `NOTIFY pgfence_takeover, '{"job_key":"tk","epoch":1,"token":1}'`)
	} else {
		execOK(t, w, "SELECT FROM fence.acquire('tk', 'h', '1 minute'::interval)")
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.tk.verified.Load() > n, nil }); err != nil {
		t.Fatalf("the takeover was never recorded: %v", err)
	}
}

// driveReads: with read routing, the watcher also reads the catalog mode
// and the read set, and the pollers poll the primary's and the replica's
// WAL positions in the database (the only one with a session).
func driveReads(t *testing.T, e *trapEnv) {
	p, g := trapProxy(t, true, Config{})
	e.session(t, p)
	waitHealthy(t, p)
	rs := p.srv.rs
	n := rs.list[0].replay.Load()
	// Two more polls of each: both pollers have run in e.db.
	for range 2 {
		if _, err := rs.list[0].refresh(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return rs.primaryLSN.Load() > 0, nil }); err != nil {
		t.Fatal(err)
	}
	_ = n
	if e.kind == trapFake || e.kind == trapFakeRLS {
		return
	}
	// The read set of a tracked database with a protected table.
	cat := catalogOf(t, g, e.db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.reads.Load() != nil, nil }); err != nil {
		t.Fatalf("the read set of %s was never loaded: %v", e.db, err)
	}
}

// lease gives the database a fence row and a lease (a job the worker
// acquired directly), so that whatever reads them reads a row; none in a
// database without pgfence's fence schema.
func (e *trapEnv) lease(t *testing.T) {
	t.Helper()
	if e.kind == trapCreate || e.kind == trapOwner || e.kind == trapGrant {
		execOK(t, connectRole(t, e.db, e.worker), "SELECT FROM fence.acquire('leased', 'h', '1 hour'::interval)")
	}
}

// driveConsole: SHOW FENCES <db> by a console user, in a database the
// proxy has no session in (nor ever had).
func driveConsole(user string) func(t *testing.T, e *trapEnv) {
	return func(t *testing.T, e *trapEnv) {
		e.lease(t)
		p, _ := trapProxy(t, false, Config{})
		c, err := consoleConnect(t, p, user, consolePassword(user))
		if err != nil {
			t.Fatal(err)
		}
		rows, err := c.Query(ctxT(t), "SHOW FENCES "+e.db)
		if err == nil {
			rows.Close()
			err = rows.Err()
		}
		t.Logf("SHOW FENCES %s as %s: %v", e.db, user, err)
	}
}

// driveConsoleAll: SHOW FENCES of every database with a session.
func driveConsoleAll(t *testing.T, e *trapEnv) {
	e.lease(t)
	p, _ := trapProxy(t, false, Config{})
	e.session(t, p)
	c, err := consoleConnect(t, p, "watcher", consolePassword("watcher"))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := c.Query(ctxT(t), "SHOW FENCES")
	if err == nil {
		rows.Close()
		err = rows.Err()
	}
	t.Logf("SHOW FENCES as watcher: %v", err)
}

// driveAuth: auth postgres looks the client's verifier up in the primary
// DSN's database, here the trapped one.
func driveAuth(t *testing.T, e *trapEnv) {
	authRoles(t)
	p := startProxy(t, Config{Primary: cluster.Primary.DSN(e.db), Auth: AuthPostgres})
	dsn := fmt.Sprintf("postgres://auth_alice:alice-pw@127.0.0.1:%d/%s?sslmode=disable", p.addr.Port, e.db)
	c, err := pgconn.Connect(ctxT(t), dsn)
	if err == nil {
		c.Close(context.Background())
	}
	t.Logf("login as auth_alice: %v", err)
}

// driveCLI runs the pgfence CLI as the superuser against e.db. In a
// database whose fence schema (or tern's version table) is not a
// superuser's it must refuse, with exit code 78 (EX_CONFIG); elsewhere it
// must succeed. mayFail: the command may fail there for its own reasons.
func driveCLI(mayFail bool, args ...string) func(t *testing.T, e *trapEnv) {
	return func(t *testing.T, e *trapEnv) {
		cmd := exec.Command(testbin.Pgfence(t), append(args, "--database", cluster.Primary.DSN(e.db))...)
		cmd.Env = append(os.Environ(), "PGOPTIONS=", "PGFENCE_DATABASE_URL=", "DATABASE_URL=")
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		t.Logf("pgfence %s: %v\n%s", strings.Join(args, " "), err, out)
		if e.kind == trapFake || e.kind == trapFakeRLS || e.kind == trapPremigrate {
			if !errors.As(err, &ee) || ee.ExitCode() != 78 || !strings.Contains(string(out), "trust") {
				t.Errorf("pgfence %s in a database whose fence is not pgfence's: %v, want exit 78 saying it does not trust it", strings.Join(args, " "), err)
			}
			return
		}
		if err != nil && !mayFail {
			t.Errorf("pgfence %s failed in a database whose fence schema is pgfence's: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// driveCommitLSN: a fence.* call through the proxy is followed, on the
// client's own session and under its search_path, by the proxy's read of
// the WAL insert position (fence.commit_lsn).
func driveCommitLSN(t *testing.T, e *trapEnv) {
	p, _ := trapProxy(t, false, Config{})
	c := e.session(t, p)
	n := 0
	mustExec(t, c, "SELECT FROM fence.acquire(E'lsn', E'h', '1 minute'::interval)")
	if v := c.ParameterStatus(ParamCommitLSN); v == "" {
		t.Fatalf("no %s after a fence.* call", ParamCommitLSN)
	}
	_ = n
}

// driveFenceCheck: a protected read whose generation the proxy has not
// seen asks the replica's own fence row, on the client's replica
// connection and under its search_path.
func driveFenceCheck(t *testing.T, e *trapEnv) {
	p, g := trapProxy(t, true, Config{})
	c := e.session(t, p, "-c fence.job_key=unseen -c fence.token=999999")
	waitHealthy(t, p)
	if e.kind != trapFake {
		// Before the replica has replayed the catalog the gate judged by,
		// every read goes to the primary and asks no fence row.
		waitCatalogReplayed(t, p, g, e.db)
	}
	before := p.srv.rs.stats.FenceChecks.Load()
	res, err := c.Exec(ctxT(t), "SELECT job_key FROM results").ReadAll()
	t.Logf("protected read: %v %v", len(res), err)
	if e.kind != trapFake && p.srv.rs.stats.FenceChecks.Load() == before {
		t.Fatal("the read did not ask the replica's fence row")
	}
}

// driveGatedWrite: a gated write through the proxy, by the simple protocol
// (the gate's and the receipt's SQL spliced into the client's query) and
// by the extended protocol (the gate's prepared statements), under the
// client's search_path.
func driveGatedWrite(t *testing.T, e *trapEnv) {
	p, _ := trapProxy(t, false, Config{})
	w := connectRole(t, e.db, e.worker)
	var epoch, token int64
	if err := w.QueryRow(ctxT(t), "SELECT epoch, token FROM fence.acquire(E'job', E'h', '1 minute'::interval)").Scan(&epoch, &token); err != nil {
		t.Fatal(err)
	}
	c := e.session(t, p, fmt.Sprintf("-c fence.job_key=job -c fence.epoch=%d -c fence.token=%d", epoch, token))
	res, err := c.Exec(ctxT(t), "BEGIN; INSERT INTO results VALUES (E'job', E'simple', 1); COMMIT").ReadAll()
	t.Logf("simple: %d results, %v", len(res), err)
	rr := c.ExecParams(ctxT(t), "INSERT INTO results VALUES ($1, $2, 2) ON CONFLICT (job_key) DO NOTHING", [][]byte{[]byte("job2"), []byte("extended")}, nil, nil, nil)
	_, err = rr.Close()
	t.Logf("extended: %v", err)
}

// driveControlRole: with a member of pgfence_control as the DSN's user
// (no superuser), in the trapped database, everything the control
// connections do works: the watcher and its read set, a takeover, the
// pollers, SHOW FENCES with tokens for an admin; and nobody warns that the
// control user is a superuser.
func driveControlRole(t *testing.T, e *trapEnv) {
	ctl := controlRole(t)
	core, logs := observer.New(zap.WarnLevel)
	p, g := leastPrivilegeProxyLog(t, ctl, Config{Replicas: []string{}}, zap.New(core))
	e.session(t, p)
	waitHealthy(t, p)
	cat := catalogOf(t, g, e.db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.reads.Load() != nil && cat.reached.Load(), nil }); err != nil {
		t.Fatalf("no read set or no replica_reached for the control role: %v", err)
	}
	n := cat.tk.verified.Load()
	e.lease(t)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.tk.verified.Load() > n, nil }); err != nil {
		t.Fatalf("the takeover was never recorded: %v", err)
	}
	showFencesOK(t, p, e.db)
	if err := p.srv.CheckControlRole(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, l := range logs.All() {
		if strings.Contains(l.Message, "superuser") {
			t.Fatalf("warned of a superuser: %s", l.Message)
		}
	}
}

// driveAuthFunction: auth postgres with a control role that cannot read
// pg_shadow, through the SECURITY DEFINER lookup docs/proxy.md describes,
// in the trapped database.
func driveAuthFunction(t *testing.T, e *trapEnv) {
	authRoles(t)
	ctl := controlRole(t)
	execOK(t, e.su, `
CREATE SCHEMA pgfence_auth;
CREATE FUNCTION pgfence_auth.lookup(p_user text, OUT usename name, OUT passwd text)
  LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
  AS $$ SELECT usename, passwd FROM pg_catalog.pg_shadow
        WHERE usename = p_user AND (valuntil IS NULL OR valuntil > now()) $$;
REVOKE ALL ON FUNCTION pgfence_auth.lookup(text) FROM PUBLIC;
GRANT USAGE ON SCHEMA pgfence_auth TO `+ctl+`;
GRANT EXECUTE ON FUNCTION pgfence_auth.lookup(text) TO `+ctl)
	p := startProxy(t, Config{Primary: fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", ctl, cluster.Primary.Addr(), e.db),
		Auth: AuthPostgres, AuthQuery: "SELECT usename, passwd FROM pgfence_auth.lookup($1)"})
	c, err := pgconn.Connect(ctxT(t), fmt.Sprintf("postgres://auth_alice:alice-pw@127.0.0.1:%d/%s?sslmode=disable", p.addr.Port, e.db))
	if err != nil {
		t.Fatalf("login through the lookup function: %v", err)
	}
	c.Close(context.Background())
}

// driveSuperuserWarning: a superuser as the DSN's user is warned of, once.
func driveSuperuserWarning(t *testing.T, e *trapEnv) {
	prefix, _, _ := strings.Cut(e.db, "_")
	su := prefix + "_dsn_su"
	execOK(t, e.su, "CREATE ROLE "+su+" LOGIN SUPERUSER")
	core, logs := observer.New(zap.WarnLevel)
	p, _ := leastPrivilegeProxyLog(t, su, Config{}, zap.New(core))
	for range 2 {
		if err := p.srv.CheckControlRole(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	e.session(t, p)
	n := 0
	for _, l := range logs.All() {
		if strings.Contains(l.Message, "control connections run as a superuser") {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("warned %d times that the control user is a superuser, want once", n)
	}
}

// driveEveryText: one database with every trap its owner can lay, every
// path that sends pgfence's own SQL driven there; then every text the
// proxy registers (ownTexts) must be in the servers' statement logs,
// logged by a control connection (application pgfence ...) or by the
// client's own session, as registered.
func driveEveryText(t *testing.T, e *trapEnv) {
	const app = "every_text_client"
	from := map[*pgtest.Node]int64{}
	for _, n := range []*pgtest.Node{cluster.Primary, cluster.Replica} {
		fi, err := os.Stat(n.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		from[n] = fi.Size()
	}
	execOK(t, e.su, "CREATE FUNCTION public.noop() RETURNS pg_catalog.int4 LANGUAGE sql AS 'SELECT 1'; GRANT EXECUTE ON FUNCTION public.noop() TO PUBLIC")
	p, g := trapProxy(t, true, Config{})
	cat := func() *catalog { return catalogOf(t, g, e.db) }
	client := func(opts ...string) *pgconn.PgConn {
		t.Helper()
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&application_name=%s", url.PathEscape(e.worker), p.addr.Port, e.db, app))
		if err != nil {
			t.Fatal(err)
		}
		if len(opts) > 0 {
			cfg.RuntimeParams["options"] = strings.Join(opts, " ")
		}
		return connectConfig(t, cfg)
	}
	// The watcher, its read set and the pollers.
	c := client()
	waitHealthy(t, p)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat().reads.Load() != nil, nil }); err != nil {
		t.Fatal(err)
	}
	// A takeover through the proxy: recorded by the watcher, and the
	// client told fence.commit_lsn.
	var epoch, token string
	res := c.Exec(ctxT(t), "SELECT epoch::pg_catalog.text, token::pg_catalog.text FROM fence.acquire(E'job', E'h', '1 hour'::interval)").ReadAll
	if r, err := res(); err != nil || len(r) == 0 || len(r[0].Rows) == 0 {
		t.Fatalf("acquire: %v", err)
	} else {
		epoch, token = string(r[0].Rows[0][0]), string(r[0].Rows[0][1])
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		tk, ok := cat().tk.lookup("job")
		return ok && fmt.Sprint(tk.token) == token, nil
	}); err != nil {
		t.Fatal(err)
	}
	// Gated writes and receipts, simple and extended, seen into and not.
	gen := func(step string) *pgconn.PgConn {
		return client(fmt.Sprintf("-c fence.job_key=job -c fence.epoch=%s -c fence.token=%s -c fence.step=%s", epoch, token, step))
	}
	for i, q := range []string{
		"BEGIN; INSERT INTO results VALUES (E'job', E'simple', 1); COMMIT",
		"INSERT INTO results VALUES (E'job2', E'autocommit', 1)",
		"BEGIN; SELECT public.noop(); COMMIT",
		"BEGIN; INSERT INTO results VALUES (E'job3', E'simple', 1); INSERT INTO results VALUES (E'job5', E'simple', 1); COMMIT",
	} {
		if _, err := gen(fmt.Sprintf("s%d", i)).Exec(ctxT(t), q).ReadAll(); err != nil {
			t.Fatalf("write %d: %s: %v", i, q, err)
		}
	}
	for i, stmts := range [][]string{
		{"BEGIN", "INSERT INTO results VALUES ($1, E'extended', 1)", "COMMIT"},
		{"BEGIN", "SELECT public.noop()", "COMMIT"},
	} {
		b := &pgconn.Batch{}
		for _, q := range stmts {
			var args [][]byte
			if strings.Contains(q, "$1") {
				args = [][]byte{[]byte(fmt.Sprintf("ext%d", i))}
			}
			b.ExecParams(q, args, nil, nil, nil)
		}
		if _, err := gen(fmt.Sprintf("b%d", i)).ExecBatch(ctxT(t), b).ReadAll(); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
	}
	// A setting the proxy cannot follow from the text: read back.
	w := gen("r")
	mustExec(t, w, "SELECT pg_catalog.set_config('fence.step', pg_catalog.concat('y', ''), false)")
	mustExec(t, w, "BEGIN; INSERT INTO results VALUES (E'job4', E'after', 1); COMMIT")
	// A refusal.
	_, err := w.Exec(ctxT(t), "PREPARE pgfence_x AS SELECT 1").ReadAll()
	t.Logf("refused: %v", err)
	// PREPARE TRANSACTION after a lock on a protected table: the lock
	// probe, refused.
	pt := client("")
	mustExec(t, pt, "BEGIN; SELECT job_key FROM results FOR UPDATE")
	_, err = pt.Exec(ctxT(t), "PREPARE TRANSACTION 'pgfence_control'").ReadAll()
	wantCode(t, err, "FN009")
	mustExec(t, pt, "ROLLBACK")
	// The replica's own fence row, with and without replica_reached.
	before := p.srv.rs.stats.FenceChecks.Load()
	_, err = client("-c fence.job_key=unseen -c fence.token=999999").Exec(ctxT(t), "SELECT job_key FROM results").ReadAll()
	t.Logf("read with an unseen generation: %v", err)
	execOK(t, e.su, "DROP FUNCTION fence.replica_reached(text, bigint, bigint)")
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return !cat().reached.Load(), nil }); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	_, err = client("-c fence.job_key=unseen -c fence.token=999998").Exec(ctxT(t), "SELECT job_key FROM results").ReadAll()
	t.Logf("read with an unseen generation: %v", err)
	if p.srv.rs.stats.FenceChecks.Load() < before+2 {
		t.Fatalf("%d fence-row checks, want 2", p.srv.rs.stats.FenceChecks.Load()-before)
	}
	// A retry whose COMMIT AND CHAIN is a replay: answered with FN00R,
	// the aborted transaction ended.
	rc := gen("chain")
	mustExec(t, rc, "BEGIN; INSERT INTO results VALUES (E'job6', E'chain', 1); COMMIT")
	mustExec(t, rc, "BEGIN")
	_, err = rc.Exec(ctxT(t), "INSERT INTO results VALUES (E'job6', E'chain', 1); COMMIT AND CHAIN").ReadAll()
	wantCode(t, err, "FN00R")
	// A replay whose transaction set fence.step: set again before the
	// client's next request.
	restoreTx := "BEGIN; SET fence.step = E'restore1'; INSERT INTO results VALUES (E'job8', E'restore', 1); SET fence.step = E'restore2'; COMMIT"
	mustExec(t, gen("restore"), restoreTx)
	rr := gen("restore")
	mustExec(t, rr, restoreTx)
	mustExec(t, rr, "SELECT 1")
	// A wrapped COPY: its COMMIT is the proxy's.
	wc := gen("copy")
	if _, err := wc.CopyFrom(ctxT(t), strings.NewReader("job7\tcopied\t1\n"), "COPY results FROM STDIN"); err != nil {
		t.Fatalf("wrapped COPY: %v", err)
	}
	// FN014: fence metadata in a database without a fence schema (the
	// worker's own, trapped as it likes).
	nofence := e.db + "_nofence"
	execOK(t, e.su, fmt.Sprintf("CREATE DATABASE %s OWNER %s", pgx.Identifier{nofence}.Sanitize(), pgx.Identifier{e.worker}.Sanitize()))
	execOK(t, e.su, "ALTER DATABASE "+pgx.Identifier{nofence}.Sanitize()+" SET log_statement = 'all'")
	t.Cleanup(func() {
		e.su.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{nofence}.Sanitize()+" WITH (FORCE)")
	})
	nfc, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&application_name=%s", url.PathEscape(e.worker), p.addr.Port, nofence, app))
	if err != nil {
		t.Fatal(err)
	}
	nfc.RuntimeParams["options"] = "-c fence.job_key=job -c fence.token=1"
	nf := connectConfig(t, nfc)
	mustExec(t, nf, "CREATE TABLE public.t (x pg_catalog.int4)")
	_, err = nf.Exec(ctxT(t), "INSERT INTO public.t VALUES (1)").ReadAll()
	wantCode(t, err, "FN014")

	// The console, and the auth lookup in this database.
	showFencesOK(t, p, e.db)
	driveAuth(t, e)

	// Every own text, found where it runs.
	var logged []loggedStatement
	for n, off := range from {
		logged = append(logged, statementLog(t, n, off)...)
	}
	for _, o := range ownTexts {
		if o.drivenBy != "" {
			continue // TestOwnDrivenByNamesNothing
		}
		found := false
		for _, l := range logged {
			if !strings.Contains(l.sql, o.match) {
				continue
			}
			if o.where == onControl && strings.HasPrefix(l.app, "pgfence ") || o.where == onSession && l.app == app {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("%s was not run in the trapped database (where %d): %s", o.name, o.where, o.match)
		}
	}
}

// loggedStatement is a statement a server logged (log_statement = all):
// the application that sent it and its text.
type loggedStatement struct{ app, sql string }

var logLine = regexp.MustCompile(`^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \S+ \[\d+\] (.*?) ?LOG:  (?:statement|execute [^:]*): (.*)$`)

// statementLog reads the statements n logged after offset.
func statementLog(t *testing.T, n *pgtest.Node, offset int64) []loggedStatement {
	t.Helper()
	b, err := os.ReadFile(n.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	var out []loggedStatement
	var cur *loggedStatement
	for _, l := range strings.Split(string(b[offset:]), "\n") {
		if m := logLine.FindStringSubmatch(l); m != nil {
			out = append(out, loggedStatement{app: m[1], sql: m[2]})
			cur = &out[len(out)-1]
			continue
		}
		if rest, ok := strings.CutPrefix(l, "\t"); ok && cur != nil {
			cur.sql += "\n" + rest
			continue
		}
		cur = nil
	}
	return out
}

// leastPrivilegeProxyLog is leastPrivilegeProxy logging to log.
func leastPrivilegeProxyLog(t *testing.T, role string, cfg Config, log *zap.Logger) (*testProxy, *Fence) {
	t.Helper()
	dsn := func(n *pgtest.Node) string {
		return fmt.Sprintf("postgres://%s@%s/postgres?sslmode=disable", role, n.Addr())
	}
	gate, err := NewFence(FenceConfig{Primary: dsn(cluster.Primary)}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	cfg.Interceptor = gate
	cfg.Primary = dsn(cluster.Primary)
	if cfg.Replicas != nil {
		cfg.Replicas = []string{dsn(cluster.Replica)}
		cfg.ReplicaPoll = 10 * time.Millisecond
		cfg.ReplicaMaxLag = time.Minute
	}
	return startProxyLog(t, withConsole(cfg), log), gate
}
