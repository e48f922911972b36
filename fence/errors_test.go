package fence_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

// TestFromPostgres: a server error of class FN becomes an *Error that
// keeps the server's error as its cause; any other error, and an *Error,
// stay as they are.
func TestFromPostgres(t *testing.T) {
	pg := &pgconn.PgError{Code: fence.CodeStale, Message: "stale token", Detail: "d", Hint: "h"}
	err := fence.FromPostgres(fmt.Errorf("write: %w", pg))
	var fe *fence.Error
	if !errors.As(err, &fe) || fe.Code != fence.CodeStale || fe.Message != pg.Message || fe.Detail != "d" || fe.Hint != "h" {
		t.Fatalf("FromPostgres(FN001): got %#v, want an *Error with the server's fields", err)
	}
	var got *pgconn.PgError
	if !errors.As(err, &got) || got != pg || !errors.Is(err, pg) {
		t.Errorf("FromPostgres(FN001): the server's error is not its cause: %#v", err)
	}
	if fence.FromPostgres(err) != err {
		t.Errorf("FromPostgres of an *Error: not returned as it is")
	}
	other := fmt.Errorf("write: %w", &pgconn.PgError{Code: "23505", Message: "duplicate key"})
	if fence.FromPostgres(other) != other || fence.Code(other) != "" {
		t.Errorf("FromPostgres(23505): got %v (code %q), want it as it is, no fence code", fence.FromPostgres(other), fence.Code(other))
	}
	if fence.FromPostgres(nil) != nil {
		t.Errorf("FromPostgres(nil) is not nil")
	}
	// Code is for class FN only: an *Error with a standard SQLSTATE (a
	// refusal of the proxy's or of package session) has none.
	if c := fence.Code(&fence.Error{Code: "22023", Message: "bad value"}); c != "" {
		t.Errorf("Code(22023 *Error) = %q, want \"\"", c)
	}
	if c := fence.Code(fmt.Errorf("x: %w", pg)); c != fence.CodeStale || !fence.IsStale(pg) {
		t.Errorf("Code(raw FN001) = %q, IsStale %v; want FN001, true", c, fence.IsStale(pg))
	}
	if s := (&fence.Error{Code: "FN013", Message: "m"}).SQLState(); s != "FN013" {
		t.Errorf("SQLState() = %q, want FN013", s)
	}
}

// TestSetup: the errors that say pgfence is not installed, and the ones
// that look alike but do not.
func TestSetup(t *testing.T) {
	for _, tt := range []struct {
		code, msg string
		want      fence.SetupProblem
	}{
		{"3F000", `schema "fence" does not exist`, fence.NoSchema},
		{"42883", "function fence.acquire(unknown, unknown, unknown) does not exist", fence.NoSchema},
		{"42P01", `relation "fence.fences" does not exist`, fence.NoSchema},
		{"42501", "permission denied for function acquire", fence.NotWorker},
		{"42501", "permission denied for function commit_if_written", fence.NotWorker},
		// Look-alikes: another schema, an administrative function, a
		// table of the fence schema workers may not read.
		{"3F000", `schema "fencex" does not exist`, fence.Installed},
		{"42883", "function myfence.acquire() does not exist", fence.Installed},
		{"42P01", `relation "myfence.fences" does not exist`, fence.Installed},
		{"42P01", `relation "results" does not exist`, fence.Installed},
		{"42501", "permission denied for function protect", fence.Installed},
		{"42501", "permission denied for function acquire_all", fence.Installed},
		{"42501", "permission denied for table fences", fence.Installed},
		{"FN001", "stale token", fence.Installed},
	} {
		if got := fence.Setup(tt.code, tt.msg); got != tt.want {
			t.Errorf("Setup(%s, %q) = %d, want %d", tt.code, tt.msg, got, tt.want)
		}
	}
}

// TestWorkerFunctions keeps Setup's list in step with the migrations'
// grants: every function of schema fence that pgfence_worker may run and
// PUBLIC may not is listed (a role without pgfence_worker gets 42501 for
// it), and every listed one is a function pgfence_worker may run.
func TestWorkerFunctions(t *testing.T) {
	e := newEnv(t)
	rows, err := e.admin.Query(ctxT(t), `select distinct p.proname::text,
		has_function_privilege('public', p.oid, 'execute')
		from pg_proc p join pg_namespace n on n.oid = p.pronamespace
		where n.nspname = 'fence' and has_function_privilege('pgfence_worker', p.oid, 'execute')`)
	if err != nil {
		t.Fatal(err)
	}
	public := map[string]bool{}
	for rows.Next() {
		var name string
		var pub bool
		if err := rows.Scan(&name, &pub); err != nil {
			t.Fatal(err)
		}
		public[name] = pub
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for name, pub := range public {
		if !pub && !slices.Contains(fence.WorkerFunctions, name) {
			t.Errorf("only pgfence_worker may run fence.%s, which Setup does not list", name)
		}
	}
	for _, name := range fence.WorkerFunctions {
		if _, ok := public[name]; !ok {
			t.Errorf("Setup lists fence.%s, which pgfence_worker may not run", name)
		}
	}
}
