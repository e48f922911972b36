package proxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/noschema (issue 30): a client that presents fence metadata
// (its generation in the startup options, by SET, by set_config) to a
// database without the fence schema believes its writes are fenced; they
// were relayed unfenced, though the proxy's log said such clients are
// refused. Every statement of such a session that writes or may write
// (DML, COPY FROM, a writable CTE, CALL, DO, a function call, EXECUTE of
// a prepared write), by the simple and the extended protocol, is refused
// with FN014, saying the database has no fence schema and that
// `pgfence migrate` installs it, and writes nothing. The session itself is
// not refused (PGOPTIONS set for every tool must not stop a psql from
// reading); its reads pass, and so does everything of a session without
// fence metadata. Through the proxy only: without the schema the
// database has nothing to refuse with.
func init() { registerBypass("noschema", bypassNoSchema) }

// noSchemaEnv is a database that was never migrated, its proxy, and a
// login role that may write its table.
type noSchemaEnv struct {
	db, role string
	proxy    *testProxy
	admin    *pgx.Conn
}

// noSchemaGen is the generation the attempts present: any, as the
// database has no fence to check it against.
var noSchemaGen = fence.Lease{JobKey: "job", Epoch: 1, Token: 7}

func newNoSchemaEnv(t *testing.T) *noSchemaEnv {
	t.Helper()
	ctx := ctxT(t)
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	db := fmt.Sprintf("t_noschema_%d", time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE template0", db)); err != nil {
		t.Fatal(err)
	}
	e := &noSchemaEnv{db: db, role: db + "_w", proxy: startProxy(t, Config{Interceptor: newGate(t)})}
	if e.admin, err = cluster.Primary.Connect(ctx, db); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.admin.Close(context.Background()) })
	id := pgx.Identifier{e.role}.Sanitize()
	for _, sql := range []string{
		"CREATE ROLE " + id + " LOGIN",
		"CREATE TABLE notes (id int PRIMARY KEY, note text NOT NULL)",
		"INSERT INTO notes VALUES (1, 'seed')",
		"CREATE FUNCTION add_note(n int) RETURNS int LANGUAGE sql AS $$ INSERT INTO notes VALUES (n, 'f') RETURNING id $$",
		"CREATE PROCEDURE add_note_p(n int) LANGUAGE sql AS $$ INSERT INTO notes VALUES (n, 'p') $$",
		"GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON notes TO " + id,
		"GRANT CREATE ON SCHEMA public TO " + id,
	} {
		if _, err := e.admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	t.Cleanup(func() {
		c, err := cluster.Primary.Connect(context.Background(), "postgres")
		if err == nil {
			c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)")
			c.Exec(context.Background(), "DROP ROLE IF EXISTS "+id)
			c.Close(context.Background())
		}
	})
	return e
}

// connect connects through the proxy as the role, with l's generation in
// the startup options when l is not nil.
func (e *noSchemaEnv) connect(t *testing.T, l *fence.Lease) *pgconn.PgConn {
	t.Helper()
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", e.role, e.proxy.addr, e.db))
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		cfg.RuntimeParams["options"] = pgoptions(*l)
	}
	return connectConfig(t, cfg)
}

// notes is the table's content, as the superuser reads it directly.
func (e *noSchemaEnv) notes(t *testing.T) string {
	t.Helper()
	var s string
	if err := e.admin.QueryRow(ctxT(t), "SELECT coalesce(string_agg(id || ':' || note, ',' ORDER BY id), '') FROM notes").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// wantNoSchema checks that err is FN014 saying what to do.
func wantNoSchema(t *testing.T, what string, err error) {
	t.Helper()
	if got := pgtest.SQLState(err); got != fence.CodeNotInstalled {
		t.Fatalf("%s: got %v (SQLSTATE %q), want %s", what, err, got, fence.CodeNotInstalled)
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || !strings.Contains(pe.Message, "has no fence schema") || !strings.Contains(pe.Hint, "pgfence migrate") {
		t.Fatalf("%s: %v: want a message saying the database has no fence schema, and a hint to run pgfence migrate", what, err)
	}
}

func bypassNoSchema(t *testing.T) {
	e := newNoSchemaEnv(t)
	ctx := ctxT(t)
	set := fmt.Sprintf("SET fence.job_key = 'job'; SET fence.epoch = %d; SET fence.token = %d; ", noSchemaGen.Epoch, noSchemaGen.Token)
	setConfig := fmt.Sprintf("SELECT set_config('fence.job_key', 'job', false), set_config('fence.epoch', '%d', false), set_config('fence.token', '%d', false); ", noSchemaGen.Epoch, noSchemaGen.Token)
	// Simple queries, the generation from the startup options unless the
	// query sets it (fromStartup false).
	simple := []struct {
		name, sql   string
		fromStartup bool
	}{
		{"insert", "INSERT INTO notes VALUES (10, 'x')", true},
		{"update", "UPDATE notes SET note = 'x'", true},
		{"delete", "DELETE FROM notes", true},
		{"truncate", "TRUNCATE notes", true},
		{"merge", "MERGE INTO notes n USING (SELECT 1 AS id) s ON n.id = s.id WHEN MATCHED THEN UPDATE SET note = 'x'", true},
		{"insert_select", "INSERT INTO notes SELECT id + 100, note FROM notes", true},
		{"upsert", "INSERT INTO notes VALUES (1, 'x') ON CONFLICT (id) DO UPDATE SET note = 'x'", true},
		{"writable_cte", "WITH d AS (DELETE FROM notes RETURNING id) SELECT count(*) FROM d", true},
		{"explicit_tx", "BEGIN; INSERT INTO notes VALUES (11, 'x'); COMMIT", true},
		{"after_select", "SELECT 1; INSERT INTO notes VALUES (12, 'x')", true},
		{"call", "CALL add_note_p(14)", true},
		{"do", "DO $$ BEGIN INSERT INTO notes VALUES (15, 'x'); END $$", true},
		{"create_table_as", "CREATE TABLE copy_of_notes AS SELECT * FROM notes", true},
		{"select_into", "SELECT * INTO copy_of_notes2 FROM notes", true},
		{"prepared_execute", "PREPARE w AS INSERT INTO notes VALUES (16, 'x'); EXECUTE w", true},
		{"set_in_query", set + "INSERT INTO notes VALUES (17, 'x')", false},
		{"set_local_in_tx", "BEGIN; SET LOCAL fence.job_key = 'job'; SET LOCAL fence.epoch = 1; SET LOCAL fence.token = 7; UPDATE notes SET note = 'x'; COMMIT", false},
		{"set_config_in_query", setConfig + "DELETE FROM notes", false},
		{"job_key_only", "SET fence.job_key = 'job'; INSERT INTO notes VALUES (18, 'x')", false},
	}
	for _, c := range simple {
		t.Run(c.name, func(t *testing.T) {
			before := e.notes(t)
			var l *fence.Lease
			if c.fromStartup {
				l = &noSchemaGen
			}
			conn := e.connect(t, l)
			_, err := conn.Exec(ctx, c.sql).ReadAll()
			wantNoSchema(t, c.sql, err)
			if after := e.notes(t); after != before {
				t.Fatalf("%s changed notes: %q, was %q", c.sql, after, before)
			}
		})
	}
	// The generation set in an earlier query of the session, then a write.
	for _, c := range []struct{ name, setup string }{
		{"set_earlier", set},
		{"set_config_earlier", setConfig},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := e.notes(t)
			conn := e.connect(t, nil)
			if _, err := conn.Exec(ctx, c.setup).ReadAll(); err != nil {
				t.Fatalf("%s: %v", c.setup, err)
			}
			_, err := conn.Exec(ctx, "INSERT INTO notes VALUES (20, 'x')").ReadAll()
			wantNoSchema(t, "INSERT after "+c.setup, err)
			if after := e.notes(t); after != before {
				t.Fatalf("notes changed: %q, was %q", after, before)
			}
		})
	}
	t.Run("copy_from", func(t *testing.T) {
		before := e.notes(t)
		_, err := e.connect(t, &noSchemaGen).CopyFrom(ctx, strings.NewReader("21\tx\n"), "COPY notes FROM STDIN")
		wantNoSchema(t, "COPY FROM", err)
		if after := e.notes(t); after != before {
			t.Fatalf("notes changed: %q, was %q", after, before)
		}
	})
	// The extended protocol: a parameterized write, a prepared one. (A
	// read that calls a function passes, as in the simple protocol:
	// docs/security.md.)
	for _, c := range []struct {
		name, sql string
		args      [][]byte
	}{
		{"extended_insert", "INSERT INTO notes VALUES ($1, $2)", [][]byte{[]byte("22"), []byte("x")}},
		{"extended_update", "UPDATE notes SET note = $1", [][]byte{[]byte("x")}},
		{"extended_copy", "COPY notes FROM STDIN", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := e.notes(t)
			conn := e.connect(t, &noSchemaGen)
			err := conn.ExecParams(ctx, c.sql, c.args, nil, nil, nil).Read().Err
			wantNoSchema(t, c.sql, err)
			sd, err := conn.Prepare(ctx, "p_"+c.name, c.sql, nil)
			if err == nil {
				err = conn.ExecPrepared(ctx, sd.Name, c.args, nil, nil).Read().Err
			}
			wantNoSchema(t, "prepared "+c.sql, err)
			if after := e.notes(t); after != before {
				t.Fatalf("notes changed: %q, was %q", after, before)
			}
		})
	}
	t.Run("pipelined_batch", func(t *testing.T) {
		before := e.notes(t)
		conn := e.connect(t, nil)
		b := &pgconn.Batch{}
		b.ExecParams("SELECT set_config('fence.job_key', 'job', false), set_config('fence.epoch', '1', false), set_config('fence.token', '7', false)", nil, nil, nil, nil)
		b.ExecParams("INSERT INTO notes VALUES ($1, 'x')", [][]byte{[]byte("24")}, nil, nil, nil)
		_, err := conn.ExecBatch(ctx, b).ReadAll()
		wantNoSchema(t, "a batch that sets the generation, then writes", err)
		if after := e.notes(t); after != before {
			t.Fatalf("notes changed: %q, was %q", after, before)
		}
	})

	// The fast path: a FunctionCall message, by the function's OID.
	var addNote uint32
	if err := e.admin.QueryRow(ctx, "SELECT 'add_note'::regproc::oid").Scan(&addNote); err != nil {
		t.Fatal(err)
	}
	call := &pgproto3.FunctionCall{Function: addNote, ArgFormatCodes: []uint16{0}, Arguments: [][]byte{[]byte("25")}}
	t.Run("function_call_message", func(t *testing.T) {
		before := e.notes(t)
		r := rawFrom(t, e.connect(t, &noSchemaGen))
		r.send(t, call)
		got, errs := r.untilReady(t)
		if len(errs) != 1 || errs[0].Code != fence.CodeNotInstalled || !strings.Contains(errs[0].Hint, "pgfence migrate") {
			t.Fatalf("a FunctionCall of a writing function: got %v, want FN014 naming pgfence migrate", got)
		}
		if after := e.notes(t); after != before {
			t.Fatalf("notes changed: %q, was %q", after, before)
		}
	})

	// A schema named fence that a non-superuser made is no fence schema:
	// the write is still refused (the probe asks for one a superuser owns).
	t.Run("fake_schema_by_worker", func(t *testing.T) {
		id := pgx.Identifier{e.role}.Sanitize()
		if _, err := e.admin.Exec(ctx, "GRANT CREATE ON DATABASE "+e.db+" TO "+id); err != nil {
			t.Fatal(err)
		}
		w := e.connect(t, nil)
		if _, err := w.Exec(ctx, "CREATE SCHEMA fence").ReadAll(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS fence CASCADE") })
		before := e.notes(t)
		_, err := e.connect(t, &noSchemaGen).Exec(ctx, "INSERT INTO notes VALUES (26, 'x')").ReadAll()
		if pgtest.SQLState(err) != fence.CodeNotInstalled {
			t.Fatalf("a fenced write with a worker's schema fence: %v, want %s", err, fence.CodeNotInstalled)
		}
		if after := e.notes(t); after != before {
			t.Fatalf("notes changed: %q, was %q", after, before)
		}
	})

	// Controls: such a session starts and reads; a session without fence
	// metadata writes, as PostgreSQL lets it.
	t.Run("control_reads", func(t *testing.T) {
		conn := e.connect(t, &noSchemaGen)
		// pg_dumpall reads the catalogs with built-ins named
		// pg_catalog.<name>, with PGOPTIONS carried everywhere.
		for _, sql := range []string{"SELECT count(*) FROM notes", "SHOW fence.job_key", "SELECT 1 FROM notes FOR UPDATE", "SET fence.step = 's'", "BEGIN; SELECT note FROM notes; COMMIT",
			"SELECT rolname, pg_catalog.shobj_description(oid, 'pg_authid') FROM pg_catalog.pg_roles",
			"SELECT acldefault('t', oid), array_to_string(ARRAY['a'], ', ') FROM pg_catalog.pg_roles"} {
			if _, err := conn.Exec(ctx, sql).ReadAll(); err != nil {
				t.Fatalf("%s in a session with fence metadata: %v", sql, err)
			}
		}
		if err := conn.ExecParams(ctx, "SELECT note FROM notes WHERE id = $1", [][]byte{[]byte("1")}, nil, nil, nil).Read().Err; err != nil {
			t.Fatalf("an extended read in a session with fence metadata: %v", err)
		}
		// A FunctionCall of a built-in (libpq's large-object calls, which
		// pg_restore makes, are such): version(), OID 89.
		r := rawFrom(t, e.connect(t, &noSchemaGen))
		r.send(t, &pgproto3.FunctionCall{Function: 89, ResultFormatCode: 0})
		if got, errs := r.untilReady(t); len(errs) > 0 {
			t.Fatalf("a FunctionCall of a built-in with fence metadata: %v", got)
		}
	})
	t.Run("control_unfenced_writes", func(t *testing.T) {
		conn := e.connect(t, nil)
		for _, sql := range []string{"INSERT INTO notes VALUES (30, 'unfenced')", "UPDATE notes SET note = 'unfenced' WHERE id = 30", "SELECT add_note(31)", "DELETE FROM notes WHERE id IN (30, 31)"} {
			if _, err := conn.Exec(ctx, sql).ReadAll(); err != nil {
				t.Fatalf("%s without fence metadata: %v", sql, err)
			}
		}
		r := rawFrom(t, e.connect(t, nil))
		r.send(t, call)
		if got, errs := r.untilReady(t); len(errs) > 0 {
			t.Fatalf("a FunctionCall without fence metadata: %v", got)
		}
		if _, err := e.admin.Exec(ctx, "DELETE FROM notes WHERE id = 25"); err != nil {
			t.Fatal(err)
		}
		// Metadata reset: unfenced again.
		conn = e.connect(t, nil)
		if _, err := conn.Exec(ctx, set+"RESET fence.job_key; RESET fence.epoch; RESET fence.token").ReadAll(); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "INSERT INTO notes VALUES (32, 'unfenced'); DELETE FROM notes WHERE id = 32").ReadAll(); err != nil {
			t.Fatalf("a write after the metadata was reset: %v", err)
		}
	})
}
