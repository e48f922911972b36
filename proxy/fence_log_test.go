package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
)

// observedEnv is a fence env whose gate logs into an observer.
func observedEnv(t *testing.T) (*fenceEnv, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	return newEnv(t, envSpec{log: zap.New(core)}), logs
}

// TestRefusalLogged: every refusal is one line at info naming the
// session, the client, the job, the generations presented and current,
// the table and the SQLSTATE; replays too (issue 20).
func TestRefusalLogged(t *testing.T) {
	e, logs := observedEnv(t)
	old := e.acquire(t, "job-l", "w1", time.Minute)
	cur := e.takeover(t, "job-l", "w2", old)
	ctx := ctxT(t)

	zombie := e.mustConnect(t, client{lease: &old, extra: []string{"-c application_name=nightly"}})
	_, err := zombie.Exec(ctx, upsert, "job-l", "late", old.Token)
	wantCode(t, err, fence.CodeStale)

	anon := e.mustConnect(t, client{extra: []string{"-c fence.job_key=job-l"}})
	_, err = anon.Exec(ctx, upsert, "job-l", "anon", 1)
	wantCode(t, err, fence.CodeFencingRequired)
	var pg interface{ Error() string } = err
	if !strings.Contains(pg.Error(), "fence.epoch is not set") || !strings.Contains(pg.Error(), "fence.token is not set") {
		t.Errorf("FN008 does not name the missing settings: %v", err)
	}

	w := e.mustConnect(t, client{lease: &cur, mode: pgx.QueryExecModeSimpleProtocol})
	execOK(t, w, upsert, "job-l", "ok", cur.Token)
	if _, err := w.Exec(ctx, upsert, "job-l", "ok", cur.Token); err == nil {
		t.Log("second commit under the same step answered") // a replay or a conflict: either is logged
	}

	refused := logs.FilterMessage("refused").All()
	byCode := map[string]observer.LoggedEntry{}
	for _, l := range refused {
		byCode[l.ContextMap()["sqlstate"].(string)] = l
	}
	stale, ok := byCode[fence.CodeStale]
	if !ok {
		t.Fatalf("no refusal line for FN001; got %v", refused)
	}
	f := stale.ContextMap()
	for k, want := range map[string]any{
		"user": "postgres", "database": e.db, "application_name": "nightly", "job_key": "job-l",
		"token": old.Token, "current_token": cur.Token, "table": "results",
	} {
		if got := f[k]; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("FN001 line: %s = %v, want %v (line %v)", k, got, want, f)
		}
	}
	if _, ok := f["session"]; !ok {
		t.Errorf("FN001 line has no session: %v", f)
	}
	if stale.Level != zapcore.InfoLevel {
		t.Errorf("FN001 logged at %v, want info", stale.Level)
	}
	if _, ok := byCode[fence.CodeFencingRequired]; !ok {
		t.Errorf("no refusal line for FN008; got %v", refused)
	}
	if n := len(logs.FilterMessage("replayed").All()) + len(byCode[fence.CodeConflict].Context); n == 0 {
		t.Errorf("the second commit under one step was logged neither as replayed nor as FN003")
	}
	for _, l := range refused {
		if l.ContextMap()["sqlstate"] == fence.CodeStale && l.Entry.Time != stale.Entry.Time {
			t.Errorf("FN001 logged twice")
		}
	}
}

// TestRefusalLogSampled: a storm of refusals does not flood the log.
func TestRefusalLogSampled(t *testing.T) {
	e, logs := observedEnv(t)
	old := e.acquire(t, "job-s", "w1", time.Minute)
	e.takeover(t, "job-s", "w2", old)
	c := e.mustConnect(t, client{lease: &old, mode: pgx.QueryExecModeSimpleProtocol})
	const n = 300
	start := time.Now()
	for i := 0; i < n; i++ {
		_, err := c.Exec(ctxT(t), upsert, "job-s", "storm", old.Token)
		wantCode(t, err, fence.CodeStale)
	}
	secs := int(time.Since(start)/time.Second) + 1
	lines := len(logs.FilterMessage("refused").All())
	if max := secs * (refusalBurst + n/refusalThereafter + 1); lines > max {
		t.Errorf("%d refusals in %d s made %d lines, want at most %d", n, secs, lines, max)
	}
	if got := e.gate.Stats.RefusalsNotLogged.Load(); int(got)+lines != n {
		t.Errorf("logged %d, counted %d not logged: want %d in all", lines, got, n)
	}
}

// TestSetupErrors: a database without the fence schema, or a role
// without pgfence_worker, gets FN014 with the command that fixes it, and
// the proxy warns once.
func TestSetupErrors(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	gate := newGateWith(t, FenceConfig{}, zap.New(core))
	p := startProxy(t, Config{Interceptor: gate})
	ctx := ctxT(t)
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)

	bare := fmt.Sprintf("bare_%d", time.Now().UnixNano())
	execOK(t, admin, "CREATE DATABASE "+bare+" TEMPLATE template0")
	t.Cleanup(func() { admin.Exec(context.Background(), "DROP DATABASE "+bare+" WITH (FORCE)") })
	c, err := pgx.Connect(ctx, p.dsn(bare))
	if err != nil {
		t.Fatal(err)
	}
	// Warned at the first connect, before anything fenced ran.
	if n := len(logs.FilterMessageSnippet("no usable fence schema").All()); n != 1 {
		t.Errorf("warned %d times about the missing schema at the first connect, want once", n)
	}
	for i := 0; i < 2; i++ {
		_, err = c.Exec(ctx, "SELECT * FROM fence.acquire('j', 'w', '1 minute')")
		wantCode(t, err, fence.CodeNotInstalled)
		if pe, ok := err.(*pgconn.PgError); !ok || !strings.Contains(pe.Hint, "pgfence migrate") {
			t.Errorf("no hint to run pgfence migrate: %v", err)
		}
	}
	c.Close(ctx)
	if n := len(logs.FilterMessageSnippet("no usable fence schema").All()); n != 1 {
		t.Errorf("warned %d times about the missing schema, want once", n)
	}

	db := cluster.NewDatabase(t)
	role := fmt.Sprintf("nogrant_%d", time.Now().UnixNano())
	execOK(t, admin, "CREATE ROLE "+role+" LOGIN")
	t.Cleanup(func() { admin.Exec(context.Background(), "DROP ROLE "+role) })
	u, err := pgx.Connect(ctx, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close(ctx)
	_, err = u.Exec(ctx, "SELECT * FROM fence.acquire('j', 'w', '1 minute')")
	wantCode(t, err, fence.CodeNotInstalled)
	if pe, ok := err.(*pgconn.PgError); !ok || !strings.Contains(pe.Hint, "GRANT pgfence_worker TO "+role) {
		t.Errorf("no GRANT hint: %v", err)
	}
	if n := len(logs.FilterMessageSnippet("lacks pgfence_worker").All()); n != 1 {
		t.Errorf("warned %d times about the role, want once", n)
	}
}
