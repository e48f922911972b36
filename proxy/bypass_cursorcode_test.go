package proxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func init() {
	registerBypass("cursor_code", func(t *testing.T) { bypassCursorCode(t, false) })
	registerBypass("cursor_code_tracked", func(t *testing.T) { bypassCursorCode(t, true) })
}

// cursorCodeSchema: a view whose function FETCHes the session's cursor c,
// and one whose function DECLAREs a WITH HOLD cursor hc.
const cursorCodeSchema = `
CREATE FUNCTION cc_fetch() RETURNS SETOF results LANGUAGE plpgsql
  AS $$ DECLARE c refcursor := 'c'; r results; BEGIN LOOP FETCH c INTO r; EXIT WHEN NOT FOUND; RETURN NEXT r; END LOOP; END $$;
CREATE VIEW cc_vf AS SELECT payload, token, pg_catalog.pg_is_in_recovery() AS rep FROM cc_fetch();
CREATE FUNCTION cc_decl() RETURNS int LANGUAGE plpgsql
  AS $$ BEGIN EXECUTE 'DECLARE hc CURSOR WITH HOLD FOR SELECT payload, token, pg_catalog.pg_is_in_recovery() FROM results WHERE job_key = ''job'''; RETURN 1; END $$;
CREATE VIEW cc_vdecl AS SELECT cc_decl() AS x;
CREATE FUNCTION cc_fetch_hc() RETURNS TABLE (payload text, token bigint, rep boolean) LANGUAGE plpgsql
  AS $$ DECLARE c refcursor := 'hc'; BEGIN LOOP FETCH c INTO payload, token, rep; EXIT WHEN NOT FOUND; RETURN NEXT; END LOOP; END $$;
CREATE VIEW cc_vf_hc AS SELECT * FROM cc_fetch_hc();
`

// bypassCursorCode (round 8, attacker P's H2 and H3): code a read runs
// without the statement naming it (a view's function) can FETCH from
// any cursor of the session and DECLARE a WITH HOLD one. The proxy took
// a read of such a view for a fresh plain read (it waited for replay at
// READ COMMITTED, or sent it in autocommit), and the cursor, opened
// before the takeover, served the previous generation; a WITH HOLD
// cursor the view's function declared was not counted in the session's
// held-cursor floor, and a FETCH in a later transaction read it. Now a
// read of a relation that runs code counts as code for cursors (its
// request may read any cursor, and may declare a held one); at READ
// COMMITTED the proxy asks the replica whether the session has cursors
// (with the isolation, in one query), and before a routed read that a
// held cursor could answer, whether any is held (pg_cursors).
//
// The replica has replayed the takeover when the attempts run: each
// reader's cursor (or the view's) was opened before it.
func bypassCursorCode(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	type rd struct {
		name  string
		c     *pgconn.PgConn
		setup []string // before the pause
		then  []string // after the catch-up; the last is the attempt
	}
	gen := func(sc *readsScene, local bool) string {
		l := ""
		if local {
			l = "LOCAL "
		}
		return fmt.Sprintf("SET %sfence.job_key = 'job'; SET %sfence.token = %d", l, l, sc.b.Token)
	}
	var readers []*rd
	var sc *readsScene
	sc = newReadsScene(t, tracked, readsSchema+cursorCodeSchema, nil, func(sc *readsScene) {
		readers = []*rd{
			{name: "tx_view_fetches_cursor", setup: []string{"DECLARE c CURSOR FOR SELECT * FROM results WHERE job_key = 'job'"}},
			{name: "autocommit_view_fetches_held_cursor", setup: []string{"DECLARE c CURSOR WITH HOLD FOR SELECT * FROM results WHERE job_key = 'job'", "COMMIT"}},
			{name: "view_declares_held_cursor_then_fetch", setup: []string{"SELECT x FROM cc_vdecl", "COMMIT"}},
			{name: "view_declares_held_cursor_then_view_fetch", setup: []string{"SELECT x FROM cc_vdecl", "COMMIT"}},
		}
		for _, r := range readers {
			r.c = sc.e.reader(t, nil, "-c fence.read_wait=2s", "-c fence.read_policy=wait")
			l4RoTx(t, r.c, r.name)
			for _, q := range r.setup {
				stmtExec(t, r.c, q)
			}
		}
	})
	resumeAndCatchUp(t)
	waitProxyReplay(t, sc.e.proxy)
	readers[0].then = []string{gen(sc, true), "SELECT payload, token, rep FROM cc_vf"}
	readers[1].then = []string{gen(sc, false), "SELECT payload, token, rep FROM cc_vf"}
	readers[2].then = []string{gen(sc, false), "BEGIN READ ONLY", "FETCH ALL FROM hc"}
	readers[3].then = []string{gen(sc, false), "BEGIN READ ONLY", "SELECT pg_is_in_recovery()", "SELECT payload, token, rep FROM cc_vf"}
	// cc_vf fetches c; reader 3 has only hc: its view reads hc.
	readers[3].then[len(readers[3].then)-1] = "SELECT payload, token, rep FROM cc_vf_hc"
	for _, r := range readers {
		t.Run(r.name, func(t *testing.T) {
			defer r.c.Close(context.Background())
			for _, q := range r.then[:len(r.then)-1] {
				stmtExec(t, r.c, q)
			}
			last := r.then[len(r.then)-1]
			res, err := r.c.Exec(ctx, last).ReadAll()
			for _, x := range res {
				for _, row := range x.Rows {
					for _, v := range row {
						if string(v) == "A" {
							t.Fatalf("%s: the previous generation's result, from a cursor opened before the takeover: %q", last, row)
						}
					}
				}
			}
			if err != nil {
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || !strings.HasPrefix(pe.Code, "FN") && pe.Code != "34000" {
					t.Fatalf("%s: %v", last, err)
				}
				t.Logf("refused: %v", err)
			}
		})
	}
}
