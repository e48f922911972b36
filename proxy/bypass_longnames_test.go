package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func init() { registerBypass("long_names", bypassLongNames) }

// bypassLongNames (round 18, attacker AI's M1): PostgreSQL cuts a
// startup packet's database and user to 63 bytes (NAMEDATALEN-1), and the
// proxy kept them as sent: a database whose name has 63 bytes was reached
// under that name plus any bytes, which the proxy took for another
// database. DISABLE and PAUSE of the database let such clients in, KILL
// left their sessions, and each such name got a catalog watcher of its
// own. Now the proxy cuts the names as the server does, before anything
// is keyed on them.
func bypassLongNames(t *testing.T) {
	p := startProxy(t, withConsole(Config{Interceptor: newGate(t)}))
	ctx := ctxT(t)
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	db := "long_" + strings.Repeat("n", 58) // 63 bytes
	if _, err := admin.Exec(ctx, fmt.Sprintf("create database %q template template0", db)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		admin, err := cluster.Primary.Connect(context.Background(), "postgres")
		if err == nil {
			admin.Exec(context.Background(), fmt.Sprintf("drop database %q with (force)", db))
			admin.Close(context.Background())
		}
	})
	longer := db + "XYZ"
	con := mustConsole(t, p, "admin")

	t.Run("session_is_the_database", func(t *testing.T) {
		c := connect(t, p.dsn(longer))
		rr := c.ExecParams(ctx, "select current_database()", nil, nil, nil, nil).Read()
		if rr.Err != nil || len(rr.Rows) != 1 || string(rr.Rows[0][0]) != db {
			t.Fatalf("current_database() %v (%v), want %q", rr.Rows, rr.Err, db)
		}
		found := false
		for _, r := range table(t, con, "SHOW CLIENTS") {
			if r["database"] == longer {
				t.Fatalf("SHOW CLIENTS keys a session on %q, the name the client sent; the server's is %q", longer, db)
			}
			found = found || r["database"] == db
		}
		if !found {
			t.Fatalf("SHOW CLIENTS has no session of %q", db)
		}
	})
	t.Run("kill_reaches_it", func(t *testing.T) {
		c := connect(t, p.dsn(longer))
		execOK(t, con, "KILL "+db)
		if _, err := c.Exec(ctx, "select 1").ReadAll(); err == nil {
			t.Fatalf("a session connected as %q survived KILL %s", longer, db)
		}
		execOK(t, con, "RESUME "+db)
	})
	t.Run("disable_refuses_it", func(t *testing.T) {
		execOK(t, con, "DISABLE "+db)
		defer execOK(t, con, "ENABLE "+db)
		for _, name := range []string{db, longer, db + "another"} {
			_, err := pgconn.Connect(ctx, p.dsn(name))
			wantCode(t, err, "55000")
		}
	})
}
