package proxy

import (
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// injector exercises the seam the write gate will use: before every client
// Query it injects a simple query, before every client Parse an extended
// Parse/Bind/Execute (no Sync), and it swallows their responses; a client
// query "SELECT 'replace-me'" is held until an injected query's answer
// arrives and then replaced by a query built from it.
type injector struct {
	mu        sync.Mutex
	swallowed []byte // server message types swallowed
}

func (in *injector) Open(s *Session) (Handler, error) { return in, nil }
func (in *injector) Close(s *Session)                 {}

func enc(m pgproto3.FrontendMessage) []byte {
	b, err := m.Encode(nil)
	if err != nil {
		panic(err)
	}
	return b
}

func (in *injector) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	switch msg[0] {
	case 'Q':
		var q pgproto3.Query
		q.Decode(MessageBody(msg))
		if q.String == "SELECT 'replace-me'" {
			// Hold: ask upstream first, wait, then replace.
			r, err := s.Inject(enc(&pgproto3.Query{String: "SELECT 40 + 2"}), "hold")
			if err != nil {
				return Drop, err
			}
			if err := s.FlushServer(); err != nil {
				return Drop, err
			}
			<-r.Done()
			return Drop, s.ForwardMessage(enc(&pgproto3.Query{String: "SELECT 'replaced ' || " + r.Tag.(string)}))
		}
		if _, err := s.Inject(enc(&pgproto3.Query{String: "SELECT 'injected'; SELECT 2"}), nil); err != nil {
			return Drop, err
		}
	case 'P':
		for _, m := range []pgproto3.FrontendMessage{
			&pgproto3.Parse{Name: "", Query: "SELECT 'probe'"},
			&pgproto3.Bind{},
			&pgproto3.Execute{},
		} {
			if _, err := s.Inject(enc(m), nil); err != nil {
				return Drop, err
			}
		}
	}
	return Forward, nil
}

func (in *injector) ServerMessage(s *Session, msg []byte, req *Request) (Verdict, error) {
	if req == nil || !req.Injected {
		return Forward, nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	in.swallowed = append(in.swallowed, msg[0])
	if msg[0] == 'D' && req.Tag == "hold" {
		var d pgproto3.DataRow
		d.Decode(MessageBody(msg))
		req.Tag = string(d.Values[0])
	}
	return Drop, nil
}

func TestInterceptorInjectSwallowHoldReplace(t *testing.T) {
	in := &injector{}
	p := startProxy(t, Config{Interceptor: in})
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	ctx := ctxT(t)

	res, err := c.Exec(ctx, "CREATE TABLE t(a int PRIMARY KEY); SELECT 'client'").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 2 || string(res[1].Rows[0][0]) != "client" {
		t.Fatalf("client saw %d results %v, want only its own 2", len(res), res)
	}
	res, err = c.Exec(ctx, "SELECT 'replace-me'").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != "replaced 42" {
		t.Fatalf("held and replaced query: got %v %v, want 'replaced 42'", res, err)
	}

	// A pipeline with an error in the middle: the injected steps after the
	// error are skipped by PostgreSQL and must be matched as skipped.
	pl := c.StartPipeline(ctx)
	pl.SendQueryParams("INSERT INTO t VALUES (1)", nil, nil, nil, nil)
	pl.SendQueryParams("INSERT INTO t VALUES (1)", nil, nil, nil, nil)
	pl.SendQueryParams("INSERT INTO t VALUES (2)", nil, nil, nil, nil)
	pl.Sync()
	pl.SendQueryParams("SELECT count(*) FROM t", nil, nil, nil, nil)
	pl.Sync()
	var states []string
	for i := 0; i < 6; i++ {
		r, err := pl.GetResults()
		switch r := r.(type) {
		case *pgconn.ResultReader:
			rr := r.Read()
			if rr.Err != nil {
				states = append(states, pgtest.SQLState(rr.Err))
			} else if len(rr.Rows) > 0 {
				states = append(states, string(rr.Rows[0][0]))
			} else {
				states = append(states, rr.CommandTag.String())
			}
		case *pgconn.PipelineSync:
			states = append(states, "sync")
		default:
			if err != nil {
				states = append(states, pgtest.SQLState(err))
			}
		}
	}
	if got, want := strings.Join(states, ","), "INSERT 0 1,23505,sync,0,sync"; !strings.HasPrefix(got, want) {
		t.Fatalf("pipeline results %s, want %s", got, want)
	}
	if err := pl.Close(); err != nil {
		t.Fatal(err)
	}
	// The session is in sync: a last query works and sees only its rows.
	res, err = c.Exec(ctx, "SELECT 'last'").ReadAll()
	if err != nil || len(res) != 1 || string(res[0].Rows[0][0]) != "last" {
		t.Fatalf("after pipeline: %v %v", res, err)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if !strings.Contains(string(in.swallowed), "TDCTDCZ") || !strings.Contains(string(in.swallowed), "12DC") {
		t.Fatalf("swallowed %q, want the injected responses", in.swallowed)
	}
}
