package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("tree_joins", bypassTreeJoins) }

// bypassTreeJoins (round 18, attacker AH): what joins a protected tree.
//
// AH-H2, AH-L1: only a permanent table joins. An unlogged member
// (CREATE UNLOGGED TABLE … PARTITION OF or INHERITS, ATTACH of an empty
// unlogged table) loses its rows in a crash and on every standby while
// their receipts stay, so the retry of a write that is gone is a replay;
// a temporary child is dropped at its session's end without an event
// trigger and leaves its entry behind. 55000 for everyone, fence.protect
// included.
//
// AH-H1: the checks of an arriving member ran before anything stopped
// writers to it. ALTER TABLE … INHERIT locks the new child's own children
// only ACCESS SHARE, so the owner's second session, already holding ROW
// EXCLUSIVE on such a grandchild, inserted a row and created a BEFORE ROW
// trigger while the guard's CREATE TRIGGER waited for it, and the member
// joined with both. Migration 030 locks every arriving member SHARE ROW
// EXCLUSIVE before checking it, so the check sees what the other session
// committed: FN010. A non-administrator's DDL that adds members must run
// READ COMMITTED (a snapshot from before the lock would not show it).
func bypassTreeJoins(t *testing.T) {
	c := newCast(t)
	o := c.owner
	inhCols := "k int not null, job_key text not null, v text not null"
	c.as(t, o, "create unlogged table tj_u ("+inhCols+"); create unlogged table tj_up ("+inhCols+")")
	cases := []castCase{
		{"create_unlogged_partition_of", attempt{role: o, code: "55000",
			sql: "create unlogged table tj_p1 partition of res for values from (700) to (710)"}},
		{"create_unlogged_inherits", attempt{role: o, code: "55000",
			sql: "create unlogged table tj_i1 () inherits (inh)"}},
		{"create_unlogged_inherits_keyed", attempt{role: o, code: "55000",
			sql: "create unlogged table app.tj_i2 () inherits (app.ledger)"}},
		{"inherit_unlogged", attempt{role: o, code: "55000", sql: "alter table tj_u inherit inh"}},
		{"attach_unlogged", attempt{role: o, code: "55000",
			sql: "alter table res attach partition tj_up for values from (710) to (720)"}},
		{"create_temp_inherits", attempt{role: o, code: "55000", direct: true,
			sql: "create temp table tj_t1 () inherits (inh)"}},
		{"dba_create_unlogged_partition_of", attempt{role: c.dba, code: "55000",
			sql: "create unlogged table tj_p2 partition of res for values from (720) to (730)"}},
		{"dba_protect_unlogged", attempt{role: c.dba, code: "55000", direct: true,
			sql: "select fence.protect('tj_u')"}},
		{"rr_inherit", attempt{role: o, code: castLocked,
			sql: "begin isolation level repeatable read; create table tj_rr (" + inhCols + "); alter table tj_rr inherit inh; commit"}},
		{"serializable_create_inherits", attempt{role: o, code: castLocked,
			sql: "begin isolation level serializable; create table tj_sr () inherits (inh); commit"}},
	}
	// Round 20, attacker AM's H1: a protected table made to depend on an
	// object in the session's temporary schema was dropped (or lost the
	// column and its rows) at the session's end, which fires no event
	// trigger. 55000 for everyone, a DBA included.
	cases = append(cases,
		castCase{"of_temp_type", attempt{role: o, code: "55000",
			sql: "create type pg_temp.gt as (k int, job_key text, v text); alter table app.ledger of pg_temp.gt"}},
		castCase{"add_column_temp_domain", attempt{role: o, code: "55000",
			sql: "create domain pg_temp.gd as int; alter table inh add column z pg_temp.gd"}},
		castCase{"add_column_temp_domain_dba", attempt{role: c.dba, code: "55000",
			sql: "create domain pg_temp.gd as int; alter table res add column z pg_temp.gd"}},
		castCase{"add_column_array_of_temp_type", attempt{role: o, code: "55000",
			sql: "create type pg_temp.ge as enum ('a'); alter table app.ledger add column z pg_temp.ge[]"}},
		castCase{"alter_column_type_temp_domain_dba", attempt{role: c.dba, code: "55000",
			sql: "create domain pg_temp.gd as text; alter table app.ledger alter column v type pg_temp.gd"}},
		castCase{"dba_joins_table_with_temp_column", attempt{role: c.dba, code: "55000",
			sql: "create domain pg_temp.gd as text; create table tj_tdep (k int not null, job_key text not null, v text not null, z pg_temp.gd); alter table tj_tdep inherit inh"}},
		castCase{"dba_protects_table_of_temp_type", attempt{role: c.su, code: "55000",
			sql: "create type pg_temp.gt as (a int); create table tj_tof of pg_temp.gt; select fence.protect('tj_tof')"}},
	)
	c.tryEach(t, cases)

	// Round 21, attacker AO: the dependency through a permanent object
	// on another session's temporary one, made in a session that has no
	// temporary schema (the check skipped such sessions).
	t.Run("permanent_over_other_sessions_temp", func(t *testing.T) {
		a := c.connect(t, "direct", o, nil)
		if err := castExec(ctxT(t), a, "create domain pg_temp.tj_d as int; create domain public.tj_dd as pg_temp.tj_d; "+
			"create domain public.tj_dd2 as pg_temp.tj_d; create function public.tj_kf(i int) returns int language sql immutable begin atomic select i; end", ""); err != nil {
			t.Fatal(err)
		}
		c.as(t, c.su, "create table tj_chk (k int not null, job_key text not null, v text not null); "+
			"alter table tj_chk owner to "+o+"; select fence.protect('tj_chk')")
		for _, route := range castRoutes {
			b := c.connect(t, route, o, nil)
			err := castExec(ctxT(t), b, "alter table app.ledger add column z public.tj_dd", "")
			if got := pgtest.SQLState(err); got != "55000" {
				t.Fatalf("%s: a column of a domain over another session's temporary domain: %v (SQLSTATE %q), want 55000", route, err, got)
			}
		}
		// A protected table's CHECK on the owner's function: since
		// migration 033 only an administrator may add one, and while it
		// is there the owner's DDL — replacing the function with one
		// over a temporary domain among it — is refused (FN010).
		c.as(t, c.dba, "alter table tj_chk add constraint tj_chk_k check (public.tj_kf(k) >= 0)")
		for _, route := range castRoutes {
			b := c.connect(t, route, o, nil)
			err := castExec(ctxT(t), b, "create or replace function public.tj_kf(i int) returns int language sql immutable begin atomic select i::public.tj_dd2::int; end", "")
			if got := pgtest.SQLState(err); got != castLocked {
				t.Fatalf("%s: a protected table's constraint function made to use a domain over a temporary one: %v (SQLSTATE %q), want %s", route, err, got, castLocked)
			}
		}
		c.as(t, c.dba, "alter table tj_chk drop constraint tj_chk_k")
		if err := castExec(ctxT(t), a, "discard temp", ""); err != nil {
			t.Fatal(err)
		}
		if n := c.count(t, "select count(*) from pg_class where relname = 'tj_chk'"); n != 1 {
			t.Fatal("the protected table was dropped with the temporary domain")
		}
	})
	t.Run("temp_types_in_temp_tables_pass", func(t *testing.T) {
		c.as(t, o, "create type pg_temp.gt as (a int); create temp table tj_tmp of pg_temp.gt; create domain pg_temp.gd as int; create temp table tj_tmp2 (a pg_temp.gd); create table tj_perm (a int); alter table tj_perm add column b int")
	})

	t.Run("permanent_still_joins", func(t *testing.T) {
		c.as(t, o, "create table tj_ok () inherits (inh); create table tj_okp partition of res for values from (730) to (740); "+
			"begin isolation level read committed; create table tj_ok2 () inherits (inh); commit")
		c.protectedUnder(t, "inh", "tj_ok", "tj_ok2")
		c.protectedUnder(t, "res", "tj_okp")
		// A DBA may add members in any isolation level.
		c.as(t, c.dba, "begin isolation level repeatable read; create table tj_ok3 () inherits (inh); commit")
		c.protectedUnder(t, "inh", "tj_ok3")
	})

	// The race: the owner's second session holds ROW EXCLUSIVE on the
	// future grandchild tj_gc; the first runs ALTER TABLE tj_g INHERIT inh
	// and waits for it (observed in pg_locks); the second then inserts a
	// row and creates its own trigger, and commits. The ALTER must be
	// refused: the member has rows and a trigger of its own.
	for i, v := range []struct{ name, route string }{{"row_and_trigger", "direct"}, {"row_and_trigger", "proxy"}, {"trigger_only", "direct"}, {"trigger_only", "proxy"}} {
		k, route := 9001+i, v.route
		t.Run("race_grandchild_"+v.name+"_"+route, func(t *testing.T) {
			g, gc := fmt.Sprintf("tj_g_%d", i), fmt.Sprintf("tj_gc_%d", i)
			write := fmt.Sprintf("insert into %s values (%d, 'job2', 'forged'); ", gc, k)
			if v.name == "trigger_only" {
				write = ""
			}
			c.as(t, o, "create table "+g+" ("+inhCols+"); create table "+gc+" () inherits ("+g+"); "+
				"create or replace function public.tj_trg() returns trigger language plpgsql as $$ begin new.v := 'owner'; return new; end $$")
			s2 := c.connect(t, "direct", o, nil)
			if err := castExec(ctxT(t), s2, "begin; lock table "+gc+" in row exclusive mode", ""); err != nil {
				t.Fatal(err)
			}
			s1 := c.connect(t, route, o, nil)
			pid := pgconnPID(t, s1, route)
			done := make(chan error, 1)
			go func() { done <- castExec(context.Background(), s1, "alter table "+g+" inherit inh", "") }()
			waitLockWait(t, c, pid)
			if err := castExec(ctxT(t), s2, write+
				"create trigger a_owner before insert or update on "+gc+" for each row execute function public.tj_trg(); commit", ""); err != nil {
				t.Fatalf("the second session: %v", err)
			}
			var err error
			select {
			case err = <-done:
			case <-time.After(time.Minute):
				t.Fatal("the ALTER did not end within a minute")
			}
			if got := pgtest.SQLState(err); got != castLocked {
				t.Fatalf("alter table %s inherit inh while another session wrote its child: %v (SQLSTATE %q), want %s", g, err, got, castLocked)
			}
			if err != nil {
				t.Logf("refused: %v", err)
			}
			if n := c.count(t, "select count(*) from fence.protected_tables where relid in ($1::regclass, $2::regclass)", g, gc); n != 0 {
				t.Fatalf("%d of %s, %s protected: the refused ALTER left them in the tree", n, g, gc)
			}
			if n := c.count(t, "select count(*) from inh where k = $1", k); n != 0 {
				t.Fatal("the forged row is in the protected tree")
			}
		})
	}
}

// pgconnPID is the PostgreSQL backend of conn (through the proxy, the
// session's backend), by pg_backend_pid().
func pgconnPID(t *testing.T, conn *pgconn.PgConn, route string) uint32 {
	t.Helper()
	rr := conn.ExecParams(ctxT(t), "select pg_backend_pid()", nil, nil, nil, nil).Read()
	if rr.Err != nil || len(rr.Rows) != 1 {
		t.Fatalf("%s: pg_backend_pid: %v", route, rr.Err)
	}
	var pid uint32
	for _, b := range rr.Rows[0][0] {
		pid = pid*10 + uint32(b-'0')
	}
	return pid
}

// waitLockWait waits until backend pid waits for a lock (pg_locks).
func waitLockWait(t *testing.T, c *cast, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for c.count(t, "select count(*) from pg_locks where pid = $1 and not granted", int32(pid)) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("backend %d never waited for a lock", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
