package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/replica_code (issue 30, round 9, attacker R's M2): code run on
// the session's replica connection (a DO block, a function, a view's
// function, in a read-only transaction there, through the simple or the
// extended protocol, or in an autocommit read routed there) changed that
// session's settings or role for good with set_config(..., false): later
// reads routed to the replica ran under search_path = 'evil, public' (and
// read evil's table), another role, another DateStyle, while the primary
// session, and SHOW through the proxy, had the session's own. Every read
// after it answers as the primary session's settings say, and reads go
// on being routed to a replica.
//
// Only through the proxy: the two sessions are the proxy's.
func init() { registerBypass("replica_code", testBypassReplicaCode) }

const replicaCodeSchema = fenceSchema + `
CREATE SCHEMA evil;
CREATE TABLE public.rc_notes (note text);
INSERT INTO public.rc_notes VALUES ('public');
CREATE TABLE evil.rc_notes (note text);
INSERT INTO evil.rc_notes VALUES ('EVIL');
CREATE FUNCTION public.rc_set() RETURNS text LANGUAGE plpgsql
  AS $$ BEGIN PERFORM set_config('search_path', 'evil, public', false); RETURN 'x'; END $$;
CREATE VIEW public.rc_v AS SELECT public.rc_set() AS x;
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'rc_other') THEN CREATE ROLE rc_other NOLOGIN; END IF;
END $$;
GRANT SELECT ON public.rc_notes TO rc_other;
`

func testBypassReplicaCode(t *testing.T) {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, true, replicaCodeSchema)
	const search = "SELECT note, pg_is_in_recovery() FROM rc_notes"
	cases := []struct {
		name   string
		tx     bool   // inside BEGIN READ ONLY on the replica, then COMMIT
		params bool   // the code through the extended protocol
		code   string // what runs the code
		check  string // a read after it
		want   string
		kept   bool // the code ran on the primary: its setting is the session's
	}{
		{name: "do_search_path", tx: true, code: "DO $$ BEGIN PERFORM set_config('search_path', 'evil, public', false); END $$", check: search, want: "public"},
		{name: "function_search_path", tx: true, code: "SELECT rc_set()", check: search, want: "public"},
		{name: "view_search_path", tx: true, code: "SELECT x FROM rc_v", check: search, want: "public"},
		{name: "extended_search_path", tx: true, params: true, code: "SELECT rc_set()", check: search, want: "public"},
		// An autocommit read of a view whose code sets search_path: since
		// round 12 (attacker X's M1) it runs on the primary, in the
		// client's own session, so the setting is the session's, as
		// straight to PostgreSQL (before: it ran on the replica and was
		// lost, want "public"); the session is pinned to the primary.
		{name: "autocommit_view", code: "SELECT x FROM rc_v", check: search, want: "EVIL", kept: true},
		{name: "do_role", tx: true, code: "DO $$ BEGIN PERFORM set_config('role', 'rc_other', false); END $$",
			check: "SELECT current_user::text, pg_is_in_recovery()", want: "postgres"},
		{name: "do_datestyle", tx: true, code: "DO $$ BEGIN PERFORM set_config('DateStyle', 'SQL, DMY', false); END $$",
			check: "SELECT '2020-01-02'::date::text, pg_is_in_recovery()", want: "2020-01-02"},
		{name: "do_search_path_same_query", tx: true, code: "DO $$ BEGIN PERFORM set_config('search_path', 'evil, public', false); END $$; COMMIT; " + search,
			want: "public"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.reader(t, nil)
			if err := pgtest.Poll(ctx, func() (bool, error) {
				q := "SELECT 1, pg_is_in_recovery()"
				if c.tx {
					q = "BEGIN READ ONLY; " + q
				}
				_, rep, err := where(t, r, q)
				if err != nil || rep {
					return rep, err
				}
				if c.tx {
					_, err = r.Exec(ctx, "ROLLBACK").ReadAll()
				}
				return false, err
			}); err != nil {
				t.Fatalf("never on the replica: %v", err)
			}
			var res []*pgconn.Result
			var err error
			if c.params {
				rr := r.ExecParams(ctx, c.code, nil, nil, nil, nil).Read()
				err = rr.Err
			} else {
				res, err = r.Exec(ctx, c.code).ReadAll()
			}
			if err != nil {
				t.Fatalf("%s: %v", c.code, err)
			}
			if c.check == "" {
				// The read in the same query, after COMMIT.
				last := res[len(res)-1]
				if len(last.Rows) != 1 || string(last.Rows[0][0]) != c.want {
					t.Fatalf("%s: %q, want %q", c.code, last.Rows, c.want)
				}
				c.check = search
			} else if c.tx {
				mustExec(t, r, "COMMIT")
			}
			// Twice: the read after the check is routed as usual.
			for i := range 2 {
				vals, _, err := where(t, r, c.check)
				if err != nil || len(vals) == 0 || vals[0] != c.want {
					t.Fatalf("%s (read %d): %v (%v), want %q: the replica session's settings are not the session's", c.check, i, vals, err, c.want)
				}
			}
			if c.kept {
				wantValue(t, r, "SELECT current_setting('search_path')", "evil, public")
				return
			}
			// What the session says of itself agrees.
			if vals, _, err := where(t, r, "SELECT current_setting('search_path'), current_setting('DateStyle'), current_user::text, 1"); err != nil ||
				vals[0] != `"$user", public` || vals[1] != "ISO, MDY" || vals[2] != "postgres" {
				t.Fatalf("session settings: %v (%v)", vals, err)
			}
			// Reads still go to a replica.
			if err := pgtest.Poll(ctx, func() (bool, error) {
				vals, rep, err := where(t, r, search)
				if err == nil && vals[0] != "public" {
					t.Fatalf("%s: %v", search, vals)
				}
				return rep, err
			}); err != nil {
				t.Fatalf("reads no longer reach a replica: %v", err)
			}
		})
	}
}
