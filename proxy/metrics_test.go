package proxy

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// scrape fetches url and returns its status and body.
func scrape(t *testing.T, url string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctxT(t), "GET", url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// metric finds a sample in a text exposition: name with its labels as
// printed, e.g. `pgfence_gate_errors_total{code="FN001"}`.
func metric(t *testing.T, body, sample string) float64 {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), sample+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", sample, err)
			}
			return f
		}
	}
	t.Fatalf("no sample %s in /metrics", sample)
	return 0
}

func TestMetricsScrape(t *testing.T) {
	e := newOpsEnv(t, Config{HealthInterval: 50 * time.Millisecond})
	w := runWorkload(t, e)
	hs := httptest.NewServer(e.proxy.srv.MetricsHandler())
	t.Cleanup(hs.Close)

	code, body := scrape(t, hs.URL+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d\n%s", code, body)
	}
	for sample, want := range map[string]int64{
		`pgfence_gate_transactions_total{outcome="gated"}`:                 w.gated,
		`pgfence_gate_transactions_total{outcome="committed"}`:             w.commits,
		`pgfence_gate_transactions_total{outcome="replayed"}`:              w.replays,
		`pgfence_gate_errors_total{code="FN001"}`:                          w.fn001,
		`pgfence_gate_errors_total{code="FN008"}`:                          w.fn008,
		`pgfence_gate_errors_total{code="FN003"}`:                          0,
		`pgfence_gate_step_duration_seconds_count{step="gate"}`:            w.gated + w.fn001,
		`pgfence_gate_step_duration_seconds_count{step="commit"}`:          w.commits + w.replays,
		`pgfence_gate_step_duration_seconds_bucket{step="gate",le="+Inf"}`: w.gated + w.fn001,
		`pgfence_sessions`:                           3,
		`pgfence_sessions_opened_total`:              3,
		`pgfence_upstream_connection_errors_total`:   0,
		`pgfence_read_routes_total{route="replica"}`: 0,
	} {
		if got := metric(t, body, sample); got != float64(want) {
			t.Errorf("%s: got %v, want %d", sample, got, want)
		}
	}
	if sum := metric(t, body, `pgfence_gate_step_duration_seconds_sum{step="commit"}`); sum <= 0 || sum > 30 {
		t.Errorf("commit step latency sum %v s: want a positive duration", sum)
	}

	if code, _ := scrape(t, hs.URL+"/healthz"); code != 200 {
		t.Errorf("/healthz: got %d, want 200", code)
	}
	ctx := ctxT(t)
	if err := pgtest.Poll(ctx, func() (bool, error) {
		code, _ := scrape(t, hs.URL+"/readyz")
		return code == 200, nil
	}); err != nil {
		_, why := scrape(t, hs.URL+"/readyz")
		t.Fatalf("/readyz never 200: %s", why)
	}
	if metric(t, func() string { _, b := scrape(t, hs.URL+"/metrics"); return b }(), `pgfence_upstream_up{addr="`+cluster.Primary.Addr()+`",role="primary"}`) != 1 {
		t.Error("pgfence_upstream_up of the primary: want 1")
	}
	// Shutting down: no longer ready, still alive.
	w.openTx.Rollback(ctx)
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	e.proxy.srv.Shutdown(sctx)
	if code, _ := scrape(t, hs.URL+"/readyz"); code != 503 {
		t.Errorf("/readyz after Shutdown: got %d, want 503", code)
	}
	if code, _ := scrape(t, hs.URL+"/healthz"); code != 200 {
		t.Errorf("/healthz after Shutdown: got %d, want 200", code)
	}
}

// TestMetricsReadyzUnreachablePrimary: a proxy whose primary cannot be
// reached serves, but is not ready; upstream errors are counted.
func TestMetricsReadyzUnreachablePrimary(t *testing.T) {
	p := startProxy(t, Config{Primary: "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2", HealthInterval: 50 * time.Millisecond})
	hs := httptest.NewServer(p.srv.MetricsHandler())
	t.Cleanup(hs.Close)
	ctx := ctxT(t)
	var why string
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var code int
		code, why = scrape(t, hs.URL+"/readyz")
		if code == 200 {
			t.Fatalf("/readyz 200 with an unreachable primary: %s", why)
		}
		return strings.Contains(why, "primary unreachable"), nil
	}); err != nil {
		t.Fatalf("/readyz: %q, want primary unreachable", why)
	}
	if _, err := pgconn.Connect(ctx, p.dsn("postgres")); pgtest.SQLState(err) != "08006" {
		t.Fatalf("client of an unreachable primary: got %v, want 08006", err)
	}
	_, body := scrape(t, hs.URL+"/metrics")
	if got := metric(t, body, "pgfence_upstream_connection_errors_total"); got != 1 {
		t.Errorf("upstream connection errors: got %v, want 1", got)
	}
	if got := metric(t, body, `pgfence_clients_refused_total{code="08006"}`); got != 1 {
		t.Errorf("clients refused 08006: got %v, want 1", got)
	}
	if got := metric(t, body, `pgfence_upstream_up{addr="127.0.0.1:1",role="primary"}`); got != 0 {
		t.Errorf("pgfence_upstream_up: got %v, want 0", got)
	}
}
