//go:build drivers

package drivers

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgxModes are pgx's query exec modes, each a variant of the matrix.
var pgxModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"cache_statement", pgx.QueryExecModeCacheStatement},
	{"cache_describe", pgx.QueryExecModeCacheDescribe},
	{"describe_exec", pgx.QueryExecModeDescribeExec},
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

const pgxUpsert = `INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
WHERE results.token < excluded.token`

// errNotApplicable marks a check that means nothing for this variant or
// target.
type errNotApplicable string

func (e errNotApplicable) Error() string { return string(e) }

// pgxCheck is one check: nil passes, errNotApplicable is n/a; a string
// result is the detail.
type pgxCheck struct {
	name string
	run  func(ctx context.Context, x *pgxEnv) (string, error)
}

// pgxEnv is what a check knows: the target and the mode.
type pgxEnv struct {
	tg      target
	variant string
	mode    pgx.QueryExecMode
}

func (x *pgxEnv) proxy() bool { return x.tg.Name == "proxy" }

func (x *pgxEnv) config(runtime ...string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(x.tg.DSN())
	if err != nil {
		return nil, err
	}
	cfg.DefaultQueryExecMode = x.mode
	for i := 0; i+1 < len(runtime); i += 2 {
		cfg.RuntimeParams[runtime[i]] = runtime[i+1]
	}
	return cfg, nil
}

func (x *pgxEnv) connect(ctx context.Context, runtime ...string) (*pgx.Conn, error) {
	cfg, err := x.config(runtime...)
	if err != nil {
		return nil, err
	}
	return pgx.ConnectConfig(ctx, cfg)
}

func (x *pgxEnv) observer(ctx context.Context) (*pgx.Conn, error) {
	return pgx.Connect(ctx, x.tg.ObserverDSN())
}

func (x *pgxEnv) slug() string {
	return strings.NewReplacer(" ", "_", "=", "_").Replace(x.variant)
}

func (x *pgxEnv) jobKey(check string) string { return x.slug() + ":" + check }

func sqlstate(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	if err == nil {
		return ""
	}
	return "no SQLSTATE: " + err.Error()
}

func want[T comparable](got, want T, what string) error {
	if got != want {
		return fmt.Errorf("%s: got %v, want %v", what, got, want)
	}
	return nil
}

// first returns the first error of errs.
func first(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func queryInt(ctx context.Context, c *pgx.Conn, sql string, args ...any) (int64, error) {
	var n int64
	err := c.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

func waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for %s", what)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// withConn runs f on a new connection and closes it.
func (x *pgxEnv) withConn(ctx context.Context, f func(c *pgx.Conn) error, runtime ...string) error {
	c, err := x.connect(ctx, runtime...)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return f(c)
}

// withFencedTx runs f with a transaction begun on a connection carrying
// the generation (job, epoch, token) in its startup options.
func (x *pgxEnv) withFencedTx(ctx context.Context, job string, epoch, token int64, f func(c *pgx.Conn, tx pgx.Tx) error) error {
	return x.withConn(ctx, func(c *pgx.Conn) error {
		tx, err := c.Begin(ctx)
		if err != nil {
			return err
		}
		return f(c, tx)
	}, fenceParams(job, epoch, token)...)
}

func (x *pgxEnv) withObserver(ctx context.Context, f func(c *pgx.Conn) error) error {
	c, err := x.observer(ctx)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return f(c)
}

var pgxChecks = []pgxCheck{
	{"connect", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			v := c.PgConn().ParameterStatus("server_version")
			n, err := queryInt(ctx, c, "SELECT 1")
			return first(err, want(n, 1, "SELECT 1"), want(strings.HasPrefix(v, "15"), true, "server_version "+v))
		})
	}},
	{"simple_query", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			res, err := c.PgConn().Exec(ctx, "SELECT 1; SELECT 'two'").ReadAll()
			if err != nil {
				return err
			}
			return first(want(len(res), 2, "results"), want(string(res[1].Rows[0][0]), "two", "second result"))
		})
	}},
	{"extended_query", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			var s int
			var t string
			var n *bool
			err := c.QueryRow(ctx, "SELECT $1::int + $2, $3::text, $4::bool", 1, 2, "x", nil).Scan(&s, &t, &n)
			return first(err, want(s, 3, "sum"), want(t, "x", "text"), want(n == nil, true, "null"))
		})
	}},
	{"prepared", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Prepare(ctx, "double", "SELECT $1::int * 2"); err != nil {
				return err
			}
			for i := 0; i < 3; i++ {
				n, err := queryInt(ctx, c, "double", i)
				if err := first(err, want(n, int64(i*2), "prepared")); err != nil {
					return err
				}
			}
			n, err := queryInt(ctx, c, "SELECT count(*) FROM pg_prepared_statements WHERE name = 'double'")
			return first(err, want(n, 1, "server-side statement"), c.Deallocate(ctx, "double"))
		})
	}},
	{"prepared_server", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			for i := 0; i < 3; i++ {
				if _, err := queryInt(ctx, c, "SELECT $1::int + 1", i); err != nil {
					return err
				}
			}
			n, err := queryInt(ctx, c, "SELECT count(*) FROM pg_prepared_statements WHERE statement = 'SELECT $1::int + 1'")
			cached := int64(0)
			if x.mode == pgx.QueryExecModeCacheStatement {
				cached = 1
			}
			return first(err, want(n, cached, "statements pgx's cache prepared"))
		})
	}},
	{"binary", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			ts := time.Date(2026, 1, 2, 3, 4, 5, 678901000, time.UTC)
			var (
				i8   int64
				txt  string
				b    []byte
				num  pgtype.Numeric
				tz   time.Time
				arr  []*int32
				js   map[string]any
				uuid pgtype.UUID
			)
			err := c.QueryRow(ctx, "SELECT $1::int8, $2::text, $3::bytea, $4::numeric, $5::timestamptz, '{1,NULL,3}'::int4[], $6::jsonb, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid",
				int64(1)<<40, "héllo", []byte{0, 1, 255}, "12345.6789", ts, `{"a": 1}`).Scan(&i8, &txt, &b, &num, &tz, &arr, &js, &uuid)
			if err != nil {
				return err
			}
			f, _ := num.Float64Value()
			return first(want(i8, int64(1)<<40, "int8"), want(txt, "héllo", "text"), want(bytes.Equal(b, []byte{0, 1, 255}), true, "bytea"),
				want(f.Float64, 12345.6789, "numeric"), want(tz.Equal(ts), true, "timestamptz"), want(len(arr) == 3 && arr[1] == nil && *arr[2] == 3, true, "int4[]"),
				want(fmt.Sprint(js), "map[a:1]", "jsonb"), want(uuid.Valid, true, "uuid"))
		})
	}},
	{"transaction", func(ctx context.Context, x *pgxEnv) (string, error) {
		table := "pgx_tx_" + x.slug()
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			return x.withObserver(ctx, func(obs *pgx.Conn) error {
				if _, err := c.Exec(ctx, "CREATE TABLE "+table+" (v int)"); err != nil {
					return err
				}
				tx, err := c.Begin(ctx)
				if err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", 1); err != nil {
					return err
				}
				n, err := queryInt(ctx, obs, "SELECT count(*) FROM "+table)
				if err := first(err, want(n, 0, "uncommitted row seen elsewhere"), tx.Commit(ctx)); err != nil {
					return err
				}
				err = pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", 2); err != nil {
						return err
					}
					return errors.New("roll back")
				})
				var s string
				err2 := obs.QueryRow(ctx, "SELECT string_agg(v::text, ',') FROM "+table).Scan(&s)
				return first(want(err != nil && err.Error() == "roll back", true, "BeginFunc's error"), err2, want(s, "1", "rows"))
			})
		})
	}},
	{"savepoint", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "CREATE TEMP TABLE sp (v int)"); err != nil {
				return err
			}
			err := pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "INSERT INTO sp VALUES (1)"); err != nil {
					return err
				}
				err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { // a savepoint
					if _, err := sp.Exec(ctx, "INSERT INTO sp VALUES ($1)", 2); err != nil {
						return err
					}
					_, err := sp.Exec(ctx, "SELECT 1/0")
					return err
				})
				if err := want(sqlstate(err), "22012", "error in the savepoint"); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, "INSERT INTO sp VALUES ($1)", 3)
				return err
			})
			var s string
			return first(err, c.QueryRow(ctx, "SELECT string_agg(v::text, ',' ORDER BY v) FROM sp").Scan(&s), want(s, "1,3", "rows"))
		})
	}},
	{"error_recovery", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "CREATE TEMP TABLE er (v int PRIMARY KEY); INSERT INTO er VALUES (1)"); err != nil {
				return err
			}
			tx, err := c.Begin(ctx)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, "INSERT INTO er VALUES ($1)", 1)
			var pg *pgconn.PgError
			if !errors.As(err, &pg) || pg.Code != "23505" || pg.ConstraintName != "er_pkey" {
				return fmt.Errorf("duplicate key: got %v", err)
			}
			_, err = tx.Exec(ctx, "SELECT 1")
			if err := first(want(sqlstate(err), "25P02", "a statement in a failed transaction"), tx.Rollback(ctx)); err != nil {
				return err
			}
			_, err = c.Exec(ctx, "SELECT $1::int", "nope")
			if x.mode == pgx.QueryExecModeSimpleProtocol || x.mode == pgx.QueryExecModeExec {
				err = first(want(sqlstate(err), "22P02", "a bad parameter"))
			} else {
				err = first(want(err != nil, true, "a bad parameter accepted"))
			}
			if err != nil {
				return err
			}
			_, err = c.Exec(ctx, "SELEC 1")
			n, err2 := queryInt(ctx, c, "SELECT count(*) FROM er")
			return first(want(sqlstate(err), "42601", "syntax error"), err2, want(n, 1, "rows"))
		})
	}},
	{"syntax_error", func(ctx context.Context, x *pgxEnv) (string, error) {
		// A typo in a statement with one string literal (its text unique to
		// the variant: the proxy caches classifications by text).
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "SELEC '"+x.variant+"'")
			_, err2 := c.Exec(ctx, "SELEC '"+x.variant+"', $1::int", 1)
			n, err3 := queryInt(ctx, c, "SELECT 1")
			return first(want(sqlstate(err), "42601", "a syntax error"), want(sqlstate(err2), "42601", "a syntax error with a parameter"),
				err3, want(n, 1, "after the syntax errors"))
		})
	}},
	{"notice", func(ctx context.Context, x *pgxEnv) (string, error) {
		cfg, err := x.config()
		if err != nil {
			return "", err
		}
		var got []string
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { got = append(got, n.Severity+" "+n.Code+" "+n.Message) }
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			return "", err
		}
		defer c.Close(context.Background())
		_, err = c.Exec(ctx, "DO $$ BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful' USING ERRCODE = '01XYZ'; END $$")
		return "", first(err, want(strings.Join(got, "|"), "NOTICE 00000 hello 42|WARNING 01XYZ careful", "notices"))
	}},
	{"listen_notify", func(ctx context.Context, x *pgxEnv) (string, error) {
		ch := "pgx_" + x.slug()
		return "", x.withConn(ctx, func(a *pgx.Conn) error {
			return x.withConn(ctx, func(b *pgx.Conn) error {
				if _, err := a.Exec(ctx, "LISTEN "+ch); err != nil {
					return err
				}
				if _, err := b.Exec(ctx, "NOTIFY "+ch+", 'hello'"); err != nil {
					return err
				}
				if _, err := b.Exec(ctx, "SELECT pg_notify($1, $2)", ch, "from function"); err != nil {
					return err
				}
				var got []string
				for len(got) < 2 {
					wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					n, err := a.WaitForNotification(wctx)
					cancel()
					if err != nil {
						return fmt.Errorf("after %v: %w", got, err)
					}
					got = append(got, n.Channel+":"+n.Payload)
				}
				return want(strings.Join(got, "|"), ch+":hello|"+ch+":from function", "notifications")
			})
		})
	}},
	{"copy_out", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			var b bytes.Buffer
			tag, err := c.PgConn().CopyTo(ctx, &b, "COPY (SELECT g, 'row ' || g FROM generate_series(1, 1000) g) TO STDOUT")
			if err != nil {
				return err
			}
			lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
			return first(want(tag.RowsAffected(), 1000, "rows"), want(lines[999], "1000\trow 1000", "last line"))
		})
	}},
	{"copy_in", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "CREATE TEMP TABLE ci (id int, name text)"); err != nil {
				return err
			}
			rows := make([][]any, 500)
			for i := range rows {
				rows[i] = []any{int32(i + 1), fmt.Sprintf("name %d", i+1)}
			}
			n, err := c.CopyFrom(ctx, pgx.Identifier{"ci"}, []string{"id", "name"}, pgx.CopyFromRows(rows)) // binary COPY
			if err := first(err, want(n, 500, "CopyFrom rows")); err != nil {
				return err
			}
			var b strings.Builder
			for i := 501; i <= 1000; i++ {
				fmt.Fprintf(&b, "%d\tname %d\n", i, i)
			}
			if _, err := c.PgConn().CopyFrom(ctx, strings.NewReader(b.String()), "COPY ci FROM STDIN"); err != nil {
				return err
			}
			_, err = c.PgConn().CopyFrom(ctx, strings.NewReader("x\ty\n"), "COPY ci FROM STDIN")
			var s string
			return first(want(sqlstate(err), "22P02", "bad COPY data"),
				c.QueryRow(ctx, "SELECT count(*) || ' ' || sum(id) FROM ci").Scan(&s), want(s, "1000 500500", "rows"))
		})
	}},
	{"cancel", func(ctx context.Context, x *pgxEnv) (string, error) {
		app := "pgxcancel-" + x.slug()
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			return x.withObserver(ctx, func(obs *pgx.Conn) error {
				qctx, cancel := context.WithCancel(ctx)
				defer cancel()
				done := make(chan error, 1)
				go func() { _, err := c.Exec(qctx, "SELECT pg_sleep(60)"); done <- err }()
				err := waitFor(ctx, "the query to run", func() (bool, error) {
					n, err := queryInt(ctx, obs, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", app)
					return n == 1, err
				})
				if err != nil {
					return err
				}
				// pgx cancels a query whose context ends: a CancelRequest, then
				// (after a grace period) it closes the connection. Cancel
				// through the protocol alone, then check the session lives.
				if err := c.PgConn().CancelRequest(ctx); err != nil {
					return err
				}
				err = <-done
				n, err2 := queryInt(ctx, c, "SELECT 1")
				return first(want(sqlstate(err), "57014", "the cancelled query's SQLSTATE"), err2, want(n, 1, "after the cancel"))
			})
		}, "application_name", app)
	}},
	{"statement_timeout", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "SELECT pg_sleep(10)")
			n, err2 := queryInt(ctx, c, "SELECT 1")
			return first(want(sqlstate(err), "57014", "the timed-out query"), err2, want(n, 1, "after the timeout"))
		}, "statement_timeout", "100")
	}},
	{"server_cursor", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "DECLARE/FETCH (pgx has no portal row limits)", x.withConn(ctx, func(c *pgx.Conn) error {
			return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "DECLARE pc CURSOR FOR SELECT g FROM generate_series(1, $1::int) g", 1000); err != nil {
					return err
				}
				var sum int64
				for {
					rows, _ := tx.Query(ctx, "FETCH 100 FROM pc")
					vals, err := pgx.CollectRows(rows, pgx.RowTo[int64])
					if err != nil {
						return err
					}
					if len(vals) == 0 {
						break
					}
					for _, v := range vals {
						sum += v
					}
				}
				return want(sum, 500500, "sum over the cursor")
			})
		})
	}},
	{"pool", func(ctx context.Context, x *pgxEnv) (string, error) {
		cfg, err := pgxpool.ParseConfig(x.tg.DSN() + "&pool_max_conns=3")
		if err != nil {
			return "", err
		}
		cfg.ConnConfig.DefaultQueryExecMode = x.mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return "", err
		}
		defer pool.Close()
		var wg sync.WaitGroup
		errs := make(chan error, 30)
		for i := 0; i < 6; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for j := 0; j < 5; j++ {
					var s int
					if err := pool.QueryRow(ctx, "SELECT $1::int + $2", i, j).Scan(&s); err != nil || s != i+j {
						errs <- fmt.Errorf("%d+%d: %d %v", i, j, s, err)
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			return "", err
		}
		return "pgxpool", pool.Ping(ctx)
	}},
	{"pipeline", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "SendBatch", x.withConn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "CREATE TEMP TABLE pl (id int PRIMARY KEY)"); err != nil {
				return err
			}
			b := &pgx.Batch{}
			for i := 0; i < 50; i++ {
				b.Queue("INSERT INTO pl VALUES ($1) RETURNING id", i)
			}
			b.Queue("SELECT count(*) FROM pl")
			br := c.SendBatch(ctx, b)
			for i := 0; i < 50; i++ {
				var id int
				if err := br.QueryRow().Scan(&id); err != nil || id != i {
					br.Close()
					return fmt.Errorf("RETURNING %d: %d %v", i, id, err)
				}
			}
			var n int
			if err := first(br.QueryRow().Scan(&n), br.Close(), want(n, 50, "count in the batch")); err != nil {
				return err
			}
			b = &pgx.Batch{}
			b.Queue("INSERT INTO pl VALUES ($1)", 1000)
			b.Queue("INSERT INTO pl VALUES ($1)", 1)
			b.Queue("INSERT INTO pl VALUES ($1)", 1001)
			err := c.SendBatch(ctx, b).Close()
			m, err2 := queryInt(ctx, c, "SELECT count(*) FROM pl WHERE id >= 1000")
			// A batch is one implicit transaction: the error rolled back all of it.
			return first(want(sqlstate(err), "23505", "error in the batch"), err2, want(m, 0, "rows after the error"))
		})
	}},
	{"large_value", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			text := strings.Repeat("x", 8<<20) + "end"
			blob := make([]byte, 4<<20)
			rand.Read(blob)
			var t, m string
			var b []byte
			err := c.QueryRow(ctx, "SELECT $1::text, md5($1::text), $2::bytea", text, blob).Scan(&t, &m, &b)
			sum := md5.Sum([]byte(text))
			return first(err, want(t == text, true, "text value unchanged"), want(m, hex.EncodeToString(sum[:]), "server-side md5"), want(bytes.Equal(b, blob), true, "bytea unchanged"))
		})
	}},
	{"large_result", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			rows, _ := c.Query(ctx, "SELECT g, repeat('x', 100) FROM generate_series(1, 100000) g")
			var n, last int32
			for rows.Next() {
				var s string
				if err := rows.Scan(&last, &s); err != nil {
					rows.Close()
					return err
				}
				n++
			}
			return first(rows.Err(), want(n, 100000, "rows"), want(last, 100000, "last row"))
		})
	}},
	{"client_encoding", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "UTF8 only: pgx requires it", x.withConn(ctx, func(c *pgx.Conn) error {
			var s string
			var n int
			err := c.QueryRow(ctx, "SELECT $1::text, octet_length($1::text)", "漢字 café 🐘").Scan(&s, &n)
			return first(err, want(s, "漢字 café 🐘", "UTF8 text"), want(n, 17, "octets"))
		})
	}},
	{"backend_pid", func(ctx context.Context, x *pgxEnv) (string, error) {
		app := "pgxpid-" + x.slug()
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			return x.withObserver(ctx, func(obs *pgx.Conn) error {
				pid := int64(c.PgConn().PID())
				own, err := queryInt(ctx, c, "SELECT pg_backend_pid()")
				if err := first(err, want(own, pid, "pg_backend_pid() against the driver's BackendKeyData PID")); err != nil {
					return err
				}
				seen, err := queryInt(ctx, obs, "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app)
				if err := first(err, want(seen, pid, "pg_stat_activity's pid against the driver's")); err != nil {
					return err
				}
				if _, err := c.Exec(ctx, "LISTEN pgx_self; NOTIFY pgx_self"); err != nil {
					return err
				}
				wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				defer cancel()
				n, err := c.WaitForNotification(wctx)
				if err != nil {
					return err
				}
				return want(int64(n.PID), pid, "PID of a self-notification")
			})
		}, "application_name", app)
	}},

	// --- fencing flows ---------------------------------------------------

	{"fence_acquire", func(ctx context.Context, x *pgxEnv) (string, error) {
		job := x.jobKey("acquire")
		return "", x.withConn(ctx, func(c *pgx.Conn) error {
			var epoch, token int64
			if err := c.QueryRow(ctx, "SELECT epoch, token FROM fence.acquire($1, 'h1', interval '5 minutes')", job).Scan(&epoch, &token); err != nil {
				return err
			}
			_, err := c.Exec(ctx, "SELECT fence.acquire($1, 'h2', interval '5 minutes')", job)
			return first(want(epoch >= 1 && token >= 1, true, "epoch and token"), want(sqlstate(err), "FN002", "a second holder's acquire"))
		})
	}},
	{"fence_commit", func(ctx context.Context, x *pgxEnv) (string, error) {
		job, _, token, err := x.committedGeneration(ctx, "commit")
		return "", first(err, x.wantRow(ctx, job, "p1", token), x.wantReceiptKinds(ctx, job))
	}},
	{"fence_replay", func(ctx context.Context, x *pgxEnv) (string, error) {
		job, epoch, token, err := x.receiptGeneration(ctx, "replay")
		if err != nil {
			return "", err
		}
		notices, err := x.commitOnce(ctx, job, epoch, token, "p1")
		return "", first(err, want(strings.Join(notices, ","), "FN00R", "notices of the retried commit"),
			x.wantReceipts(ctx, job, 1), x.wantRow(ctx, job, "p1", token))
	}},
	{"fence_conflict", func(ctx context.Context, x *pgxEnv) (string, error) {
		job, epoch, token, err := x.receiptGeneration(ctx, "conflict")
		if err != nil {
			return "", err
		}
		err = x.withFencedTx(ctx, job, epoch, token, func(c *pgx.Conn, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, pgxUpsert, job, "something else", token); err != nil {
				return err
			}
			err := tx.Commit(ctx)
			n, err2 := queryInt(ctx, c, "SELECT 1")
			return first(want(sqlstate(err), "FN003", "a different payload under a committed generation"),
				want(string(c.PgConn().TxStatus()), "I", "status after FN003"), err2, want(n, 1, "after the conflict"))
		})
		return "", first(err, x.wantRow(ctx, job, "p1", token))
	}},
	{"fence_stale", func(ctx context.Context, x *pgxEnv) (string, error) {
		job := x.jobKey("stale")
		epoch, old, err := x.acquire(ctx, job)
		if err != nil {
			return "", err
		}
		err = x.withObserver(ctx, func(obs *pgx.Conn) error {
			_, err := obs.Exec(ctx, "SELECT fence.release($1, $2)", job, old)
			if err != nil {
				return err
			}
			_, err = obs.Exec(ctx, "SELECT fence.acquire($1, 'h2', interval '5 minutes')", job)
			return err
		})
		if err != nil {
			return "", err
		}
		err = x.withFencedTx(ctx, job, epoch, old, func(c *pgx.Conn, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, pgxUpsert, job, "zombie", old)
			if err == nil {
				err = tx.Commit(ctx)
			}
			tx.Rollback(ctx)
			n, err2 := queryInt(ctx, c, "SELECT 1")
			return first(want(sqlstate(err), "FN001", "a write under the token taken over"), err2, want(n, 1, "after FN001"))
		})
		return "", first(err, x.wantRow(ctx, job, "", 0))
	}},
	{"fence_autocommit", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "", x.fencedWrite(ctx, "autocommit", "auto", func(c *pgx.Conn, job string, token int64) error {
			_, err := c.Exec(ctx, pgxUpsert, job, "auto", token)
			return err
		})
	}},
	{"fence_copy", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "CopyFrom (binary COPY)", x.fencedWrite(ctx, "copy", "copied", func(c *pgx.Conn, job string, token int64) error {
			_, err := c.CopyFrom(ctx, pgx.Identifier{"results"}, []string{"job_key", "payload", "token"}, pgx.CopyFromRows([][]any{{job, "copied", token}}))
			return err
		})
	}},
	{"fence_no_metadata", func(ctx context.Context, x *pgxEnv) (string, error) {
		job := x.jobKey("nometa")
		err := x.withConn(ctx, func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, pgxUpsert, job, "x", 1)
			return want(sqlstate(err), "FN008", "a write without fence metadata")
		})
		return "", first(err, x.wantRow(ctx, job, "", 0))
	}},
	{"fence_pipeline", func(ctx context.Context, x *pgxEnv) (string, error) {
		return "SendBatch (one implicit transaction)", x.fencedWrite(ctx, "pipeline", "batch", func(c *pgx.Conn, job string, token int64) error {
			b := &pgx.Batch{}
			b.Queue("SELECT 1")
			b.Queue(pgxUpsert, job, "batch", token)
			b.Queue(pgxUpsert, job, "batch", token)
			return c.SendBatch(ctx, b).Close()
		})
	}},
}

// fencedWrite acquires a new generation of the check's job, runs write on
// a connection carrying it, and checks that the result row holds payload
// and that it left one receipt: the proxy's, or direct the backstop's.
func (x *pgxEnv) fencedWrite(ctx context.Context, check, payload string, write func(c *pgx.Conn, job string, token int64) error) error {
	job := x.jobKey(check)
	epoch, token, err := x.acquire(ctx, job)
	if err != nil {
		return err
	}
	err = x.withConn(ctx, func(c *pgx.Conn) error { return write(c, job, token) }, fenceParams(job, epoch, token)...)
	return first(err, x.wantRow(ctx, job, payload, token), x.wantReceiptKinds(ctx, job))
}

func fenceParams(job string, epoch, token int64) []string {
	return []string{"fence.job_key", job, "fence.epoch", fmt.Sprint(epoch), "fence.token", fmt.Sprint(token)}
}

// receiptKind is the digest version of the one receipt a fenced write
// leaves: the proxy's own, or straight to PostgreSQL the backstop's.
func (x *pgxEnv) receiptKind() string {
	if x.proxy() {
		return "v1"
	}
	return "backstop-v1"
}

func (x *pgxEnv) acquire(ctx context.Context, job string) (epoch, token int64, err error) {
	err = x.withObserver(ctx, func(obs *pgx.Conn) error {
		return obs.QueryRow(ctx, "SELECT epoch, token FROM fence.acquire($1, 'h1', interval '5 minutes')", job).Scan(&epoch, &token)
	})
	return epoch, token, err
}

// commitOnce writes in a transaction of its own and returns the SQLSTATEs
// of the notices it got.
func (x *pgxEnv) commitOnce(ctx context.Context, job string, epoch, token int64, payload string) ([]string, error) {
	cfg, err := x.config(fenceParams(job, epoch, token)...)
	if err != nil {
		return nil, err
	}
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n.Code) }
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close(context.Background())
	err = pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, pgxUpsert, job, payload, token)
		return err
	})
	return notices, err
}

func (x *pgxEnv) committedGeneration(ctx context.Context, check string) (job string, epoch, token int64, err error) {
	job = x.jobKey(check)
	if epoch, token, err = x.acquire(ctx, job); err != nil {
		return
	}
	_, err = x.commitOnce(ctx, job, epoch, token, "p1")
	return
}

// receiptGeneration is committedGeneration for the checks of the receipts
// the proxy writes (a replay, a conflict): not applicable straight to
// PostgreSQL.
func (x *pgxEnv) receiptGeneration(ctx context.Context, check string) (job string, epoch, token int64, err error) {
	if !x.proxy() {
		return "", 0, 0, errNotApplicable("receipts are written by the proxy")
	}
	return x.committedGeneration(ctx, check)
}

func (x *pgxEnv) wantRow(ctx context.Context, job, payload string, token int64) error {
	return x.withObserver(ctx, func(obs *pgx.Conn) error {
		var p string
		var tk int64
		err := obs.QueryRow(ctx, "SELECT payload, token FROM results WHERE job_key = $1", job).Scan(&p, &tk)
		if errors.Is(err, pgx.ErrNoRows) {
			return want(payload, "", "the row (none)")
		}
		return first(err, want(p+" "+fmt.Sprint(tk), payload+" "+fmt.Sprint(token), "the row"))
	})
}

// wantReceiptKinds checks that job has exactly one receipt, of receiptKind.
func (x *pgxEnv) wantReceiptKinds(ctx context.Context, job string) error {
	return x.withObserver(ctx, func(obs *pgx.Conn) error {
		var got string
		err := obs.QueryRow(ctx, "SELECT coalesce(string_agg(digest_version, ',' ORDER BY token), '') FROM fence.receipts WHERE job_key = $1", job).Scan(&got)
		return first(err, want(got, x.receiptKind(), "receipts (digest versions)"))
	})
}

func (x *pgxEnv) wantReceipts(ctx context.Context, job string, n int64) error {
	return x.withObserver(ctx, func(obs *pgx.Conn) error {
		got, err := queryInt(ctx, obs, "SELECT count(*) FROM fence.receipts WHERE job_key = $1", job)
		return first(err, want(got, n, "receipts"))
	})
}

// runPgx runs every check in every query exec mode, in this process.
func runPgx(ctx context.Context, t *testing.T, tg target) ([]result, error) {
	var out []result
	for _, m := range pgxModes {
		x := &pgxEnv{tg: tg, variant: "pgx " + m.name, mode: m.mode}
		for _, c := range pgxChecks {
			cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			detail, err := c.run(cctx, x)
			cancel()
			r := result{Variant: x.variant, Check: c.name, Status: "ok", Detail: detail}
			var na errNotApplicable
			switch {
			case errors.As(err, &na):
				r.Status, r.Detail = "n/a", na.Error()
			case err != nil:
				r.Status, r.Detail = "fail", err.Error()
			}
			out = append(out, r)
		}
	}
	return out, nil
}
