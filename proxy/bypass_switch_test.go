package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("switch", bypassSwitch) }

// switchObjects is the attacker's code (round 8, attacker O's H1): sw()
// sets the fence settings named in attack.set ("name=value,...") at
// session level, and every object here runs it where the proxy cannot
// see: a function, a trigger, a column default, a view, an operator, a
// cast. pb(table, k) sets them transaction-locally, writes a row of table
// under them and puts them back, all within one statement.
const switchObjects = `
create function public.sw() returns text language plpgsql as $$
declare kv text;
begin
  foreach kv in array string_to_array(current_setting('attack.set'), ',') loop
    perform set_config(split_part(kv, '=', 1), split_part(kv, '=', 2), false);
  end loop;
  return current_setting('attack.set');
end $$;
create function public.sw_trg() returns trigger language plpgsql as $$ begin perform sw(); return new; end $$;
create trigger notes_sw before insert on notes for each row execute function sw_trg();
create table public.dflt (x text default sw());
create view public.vsw as select sw() as x;
create function public.sw_op(int, int) returns int language plpgsql as $$ begin perform sw(); return 1; end $$;
create operator public.#~# (leftarg = int, rightarg = int, function = sw_op);
create type public.swt as enum ('a');
create function public.swt_text(swt) returns text language plpgsql as $$ begin perform sw(); return 'a'; end $$;
create cast (swt as text) with function swt_text(swt);
create function public.pb(tbl text, k int) returns text language plpgsql as $$
declare kv text; names text[] := '{}'; olds text[] := '{}'; i int;
begin
  foreach kv in array string_to_array(current_setting('attack.set'), ',') loop
    names := names || split_part(kv, '=', 1);
    olds := olds || coalesce(current_setting(split_part(kv, '=', 1), true), '');
    perform set_config(split_part(kv, '=', 1), split_part(kv, '=', 2), true);
  end loop;
  execute format('insert into %s values (%s, %L, %L)', tbl, k, current_setting('fence.job_key'), 'pb');
  for i in 1..coalesce(array_length(names, 1), 0) loop
    perform set_config(names[i], olds[i], true);
  end loop;
  return 'put back';
end $$;
`

// bypassSwitch (round 8, O-H1): code the proxy cannot see changes
// fence.step, or the generation, inside a transaction that writes a
// protected table. The gate and the receipt ran under the settings the
// proxy believed, the backstop under the server's: two receipts for one
// transaction, and a later genuine write under the believed step was
// refused FN003. The same with fence.gate called by hand (the fence
// package's Gate) straight to PostgreSQL, and with a function that sets
// the settings transaction-locally, writes and puts them back within one
// statement (no route needed: the backstop alone made two receipts). A
// transaction is entered under one generation and step, and every later
// gate, backstop write or commit under another is refused (FN009) by the
// database, so the transaction rolls back: never two receipts. After the
// refusal a genuine write under the believed step, in a new session, is
// applied with exactly one receipt.
func bypassSwitch(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	// A second generation of the worker's own (the generation switch).
	x, err := fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w, nil), "jobx", "x", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c.as(t, c.owner, switchObjects+fmt.Sprintf("grant insert on dflt to %[1]s; grant select on vsw to %[1]s;", w))

	type vector struct {
		name string
		pre  string // its own request before the transaction ("" none)
		sql  string // %[1]d a protected row's key, %[2]s its table, %[3]d another key
	}
	write := "insert into %[2]s values (%[1]d, current_setting('fence.job_key'), 'w')"
	vectors := []vector{
		{"function_earlier_request", "select sw()", write},
		{"function_same_query", "", "select sw(); " + write},
		{"trigger", "", "insert into notes (note) values ('t'); " + write},
		{"column_default", "", "insert into dflt default values; " + write},
		{"view", "", "select * from vsw; " + write},
		{"operator", "", "select 1 #~# 1; " + write},
		{"cast", "", "select 'a'::swt::text; " + write},
		{"put_back_after_write", "", write + "; select pb('%[2]s', %[3]d)"},
		{"put_back_before_write", "", "select pb('%[2]s', %[3]d); " + write},
		{"put_back_in_the_write", "", "insert into %[2]s select %[1]d, current_setting('fence.job_key'), pb('%[2]s', %[3]d)"},
	}
	// The step switch writes app.ledger (keyed: its job-key check reads
	// the settings again after the statement), the generation switch res
	// (no job-key column: nothing but the generation is checked).
	kinds := []struct {
		name, table string
		set         func(believed string) string
		wrong       func(believed string) string // counts the receipts of the switched settings
		next        func() int
	}{
		{"step", "app.ledger",
			func(b string) string { return "fence.step=z" + b },
			func(b string) string {
				return fmt.Sprintf("select count(*) from fence.receipts where step = 'z%s'", b)
			},
			counter(1000)},
		{"generation", "res",
			func(string) string {
				return fmt.Sprintf("fence.job_key=jobx,fence.epoch=%d,fence.token=%d", x.Epoch, x.Token)
			},
			func(string) string { return "select count(*) from fence.receipts where job_key = 'jobx'" },
			counter(2)},
	}
	control := counter(5000)
	for _, k := range kinds {
		for _, v := range vectors {
			// direct: fence.gate by hand under the believed settings, as
			// the fence package's Gate does; backstop: no gate at all,
			// only where the code itself writes twice (put back).
			routes := []string{"proxy", "direct"}
			if v.name[:3] == "put" {
				routes = append(routes, "backstop")
			}
			for _, route := range routes {
				t.Run(k.name+"/"+v.name+"/"+route, func(t *testing.T) {
					b := fmt.Sprintf("%s_%s_%s", k.name, v.name, route)
					sql := fmt.Sprintf(v.sql, k.next(), k.table, k.next())
					if route == "direct" {
						sql = fmt.Sprintf("select fence.gate('job', %d, %d, '%s'); ", cur.Epoch, cur.Token, b) + sql
					}
					r := route
					if r == "backstop" {
						r = "direct"
					}
					conn := c.connect(t, r, w, cur)
					if err := castExec(ctxT(t), conn, fmt.Sprintf("set fence.step = '%s'; set attack.set = '%s'", b, k.set(b)), ""); err != nil {
						t.Fatal(err)
					}
					before := c.state(t)
					if v.pre != "" {
						if err := castExec(ctxT(t), conn, v.pre, ""); err != nil {
							t.Fatalf("%s: %v", v.pre, err)
						}
					}
					err := castExec(ctxT(t), conn, sql, "")
					if got := pgtest.SQLState(err); got != fence.CodeUnsupported {
						t.Errorf("%s: got %v (SQLSTATE %q), want SQLSTATE %s; receipts now:\n  %v", sql, err, got, fence.CodeUnsupported, c.receiptsOf(t, b))
					}
					c.unchanged(t, before)
					// The genuine write under the believed settings, in a
					// new session: applied, with exactly one receipt.
					ok := c.connect(t, r, w, cur)
					if err := castExec(ctxT(t), ok, fmt.Sprintf("set fence.step = '%s'; insert into app.ledger values (%d, 'job', 'ok')", b, control()), ""); err != nil {
						t.Fatalf("the genuine write under step %q: %v", b, err)
					}
					if n := c.count(t, "select count(*) from fence.receipts where job_key = 'job' and step = $1", b); n != 1 {
						t.Fatalf("%d receipts of step %q, want 1", n, b)
					}
					if n := c.count(t, k.wrong(b)); n != 0 {
						t.Fatalf("%d receipts under the switched settings, want none", n)
					}
				})
			}
		}
	}
	// The control: the same code, then the settings set where pgfence
	// sees them (SET) before the write: applied, one receipt.
	for _, route := range castRoutes {
		t.Run("control/visible_set_after_function/"+route, func(t *testing.T) {
			b := "control_" + route
			conn := c.connect(t, route, w, cur)
			if err := castExec(ctxT(t), conn, "set attack.set = 'fence.step=z"+b+"'; select sw()", ""); err != nil {
				t.Fatal(err)
			}
			if err := castExec(ctxT(t), conn, fmt.Sprintf("set fence.step = '%s'; insert into app.ledger values (%d, 'job', 'c')", b, control()), ""); err != nil {
				t.Fatalf("a write under a step set by SET: %v", err)
			}
			if n := c.count(t, "select count(*) from fence.receipts where step in ($1, 'z' || $1)", b); n != 1 {
				t.Fatalf("%d receipts, want 1", n)
			}
		})
	}
}

// counter returns successive ints from first.
func counter(first int) func() int {
	n := first - 1
	return func() int { n++; return n }
}

// receiptsOf lists the receipts of step b, of its switched step and of
// job jobx (for the failure message).
func (c *cast) receiptsOf(t *testing.T, b string) []string {
	t.Helper()
	return c.lines(t, fmt.Sprintf("select concat_ws(' ', job_key, step, digest_version, backstop_xid) from fence.receipts where step = '%s' or step = 'z%s' or job_key = 'jobx'", b, b))
}
