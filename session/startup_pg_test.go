package session

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// startupCase is a startup packet's settings: its options and its other
// parameters.
type startupCase struct {
	options string
	params  map[string]string
}

// startupCorpus are the readings the attacker found (issue 30,
// B-M5) and their neighbours: options and packet parameters naming the
// same setting, grouped and attached flags, escapes, and what the
// server refuses.
var startupCorpus = []startupCase{
	{"-c fence.job_key=job-b -c fence.epoch=2 -c fence.token=8 -c fence.step=o1", map[string]string{"fence.job_key": "job-a", "fence.epoch": "1", "fence.token": "7"}},
	{"-c fence.step=o1", map[string]string{"fence.step": "o2"}},
	{"--fence.step=o1", map[string]string{"FENCE.STEP": "o2"}},
	{"-ec fence.step=g2", nil},
	{"-ecfence.step=g3", nil},
	{"-e -cfence.step=g4", nil},
	{"-S 1024 -c fence.step=g5", nil},
	{"-S1024 -fs --fence.job-key=k", nil},
	{"-fs -e -- ", nil},
	{"-c fence.step=a -c fence.step=b", nil},
	{`-c fence.step=two\ words -c Search_Path=a,b`, nil},
	{`-c fence.step=a\\b\`, nil},
	{`-c\ fence.step=x`, nil},
	{"-c fence.step=x\t-c\nfence.job_key=y\v", nil},
	{"-sc fence.step=s", nil},
	{"-c -c", nil},
	{"-c fence.step=x -- fence.job_key=y", nil},
	{"-- -c fence.step=x", nil},
	{"fence.step=x", nil},
	{"-c fence.step=x y", nil},
	{"-x -c fence.step=x", nil},
	{"-c", nil},
	{"-c fence.step", nil},
	{"--fence.step", nil},
	{"-e -", nil},
	{"-cfence.step=", map[string]string{"fence.step": "p"}},
	{"-c search_path=a", map[string]string{"search_path": "b"}},
	{"-c FENCE.STEP=upper", nil},
	{"-c fence.step=\xa0x", nil},
	{`-c fence.step=\` + "\xa0x", nil},
}

// randomStartup builds a startup packet's settings from the pieces a
// reading could trip on.
func randomStartup(r *rand.Rand) startupCase {
	names := []string{"fence.step", "fence.job_key", "FENCE.STEP", "fence.job-key", "search_path", "Fence.Step"}
	value := func() string {
		parts := []string{"a", "b1", `\ `, `\\`, "x=y", "-c", "--", "é"}
		var b strings.Builder
		for n := r.Intn(3) + 1; n > 0; n-- {
			b.WriteString(parts[r.Intn(len(parts))])
		}
		return b.String()
	}
	var words []string
	for n := r.Intn(5); n > 0; n-- {
		name := names[r.Intn(len(names))]
		switch r.Intn(9) {
		case 0:
			words = append(words, "-c", name+"="+value())
		case 1:
			words = append(words, "-c"+name+"="+value())
		case 2:
			words = append(words, "--"+name+"="+value())
		case 3:
			words = append(words, "-ec", name+"="+value())
		case 4:
			words = append(words, "-fs"+[]string{"", "e", "ec"}[r.Intn(3)])
		case 5:
			words = append(words, "-S", "1024")
		case 6:
			words = append(words, []string{"--", "-", "-c", "x", "-q"}[r.Intn(5)])
		case 7:
			words = append(words, "-e")
		default:
			words = append(words, "-c", name+"="+value())
		}
	}
	sep := []string{" ", "  ", "\t", "\n"}
	var b strings.Builder
	for i, w := range words {
		if i > 0 || r.Intn(4) == 0 {
			b.WriteString(sep[r.Intn(len(sep))])
		}
		b.WriteString(w)
	}
	params := map[string]string{}
	for n := r.Intn(3); n > 0; n-- {
		params[[]string{"fence.step", "fence.job_key", "FENCE.STEP", "search_path"}[r.Intn(4)]] = value()
	}
	return startupCase{b.String(), params}
}

// TestStartupReadingMatchesServer requires that what New reads from a
// startup packet is what PostgreSQL reads from it: for every packet of a
// corpus and of a random sample, either New refuses it (with the
// server's 42601 when the server refuses it too, or 08P01 for what the
// proxy cannot be certain of, or 22023 for a malformed fence value), or
// the server refuses it for a value New does not check (and there is no
// session), or the server accepts it and each tracked setting New holds equals
// current_setting on the server.
func TestStartupReadingMatchesServer(t *testing.T) {
	db := cluster.NewDatabase(t)
	cases := append([]startupCase(nil), startupCorpus...)
	r := rand.New(rand.NewSource(30))
	for range 200 {
		cases = append(cases, randomStartup(r))
	}
	names := []string{Step, JobKey, SearchPath}
	for i, tc := range cases {
		t.Run(fmt.Sprintf("%d", i), func(t *testing.T) {
			cfg, err := pgconn.ParseConfig(cluster.Primary.DSN(db))
			if err != nil {
				t.Fatal(err)
			}
			params := map[string]string{"user": cfg.User, "database": db, "options": tc.options}
			cfg.RuntimeParams["options"] = tc.options
			for k, v := range tc.params {
				cfg.RuntimeParams[k] = v
				params[k] = v
			}
			st, nerr := New(params, NewStatements())
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conn, cerr := pgconn.ConnectConfig(ctx, cfg)
			if cerr == nil {
				defer conn.Close(context.Background())
			}
			var fe *fence.Error
			if nerr != nil {
				if !errors.As(nerr, &fe) {
					t.Fatalf("options %q params %q: New: %v, want a *fence.Error", tc.options, tc.params, nerr)
				}
				switch fe.Code {
				case CodeSyntaxError:
					if got := pgtest.SQLState(cerr); got != CodeSyntaxError {
						t.Fatalf("options %q params %q: New refused with 42601 (%v), the server: %v", tc.options, tc.params, nerr, cerr)
					}
				case CodeProtocolViolation, CodeInvalidParameterValue:
				default:
					t.Fatalf("options %q params %q: New: %v", tc.options, tc.params, nerr)
				}
				return
			}
			if cerr != nil {
				// No session: what the server refuses for a value (an
				// invalid name, search_path) is the server's to refuse;
				// its grammar New must know.
				if pgtest.SQLState(cerr) == CodeSyntaxError {
					t.Fatalf("options %q params %q: New read it, the server refused its syntax: %v", tc.options, tc.params, cerr)
				}
				return
			}
			for _, name := range names {
				res, err := conn.Exec(ctx, fmt.Sprintf("select current_setting('%s', true)", name)).ReadAll()
				if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
					t.Fatalf("read %s: %v", name, err)
				}
				server := string(res[0].Rows[0][0])
				got, _ := st.Get(name)
				if name == SearchPath {
					v := st.vars[SearchPath]
					if v == nil || !v.cur.known {
						continue // the proxy does not claim to know it
					}
					got = v.cur.s
				}
				if got != server {
					t.Fatalf("options %q params %q: %s: New read %q, the server %q", tc.options, tc.params, name, got, server)
				}
			}
		})
	}
}
