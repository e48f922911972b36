package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
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
	// Round 19, attacker AL's L1: the console cut no name, so DISABLE of
	// the longer name disabled a database no session can have.
	t.Run("console_cuts_names", func(t *testing.T) {
		execOK(t, con, "DISABLE "+longer)
		defer execOK(t, con, "ENABLE "+db)
		_, err := pgconn.Connect(ctx, p.dsn(db))
		wantCode(t, err, "55000")
	})
	// AL's L2: replication is read as PostgreSQL reads it.
	t.Run("replication_parameter", func(t *testing.T) {
		for v, code := range map[string]string{"f": "", "of": "", "n": "", "FA": "", "0": "",
			"t": "0A000", "on": "0A000", "database": "0A000", "yes": "0A000",
			"o": "22023", "xyz": "22023", "": "22023"} {
			cfg, err := pgconn.ParseConfig(p.dsn(db))
			if err != nil {
				t.Fatal(err)
			}
			cfg.RuntimeParams["replication"] = v
			c, err := pgconn.ConnectConfig(ctx, cfg)
			if code == "" {
				if err != nil {
					t.Errorf("replication=%q: %v, want an ordinary session (PostgreSQL reads it as false)", v, err)
					continue
				}
				c.Close(context.Background())
				continue
			}
			if got := pgtest.SQLState(err); got != code {
				t.Errorf("replication=%q: %v (SQLSTATE %q), want %s", v, err, got, code)
			}
		}
	})
	// AL's L3: a user name that is not UTF-8 (a cut inside a character) is
	// refused as an unknown role is, not with the lookup query's 22021.
	t.Run("non_utf8_user", func(t *testing.T) {
		e := newAuthEnv(t, Config{})
		e.refused(t, strings.Repeat("u", 62)+"\u00e9", "whatever", "28P01")
		e.refused(t, "auth_\xff", "whatever", "28P01")
	})
}
