package proxy

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/startup: the proxy reads a startup packet's settings as
// PostgreSQL does (issue 30, B-M5). The server applies the "options"
// switches first and the packet's other parameters after them, and reads
// options with getopt (grouped flags, attached arguments); a proxy that
// read them otherwise gated and receipted one generation (or step) while
// the server's backstop checked another: a receipt for a job that wrote
// nothing, whose retry is then answered "replay". Each case connects as
// the worker with a packet, writes to a protected table and reads the
// server's settings back: every receipt the write left must name the
// generation and step the server held. A packet the proxy cannot read
// with certainty is refused (08P01), one the server refuses is refused as
// the server does (42601), and neither changes anything.
func init() { registerBypass("startup", testBypassStartup) }

func testBypassStartup(t *testing.T) {
	c := newCast(t)
	gen := func(l fence.Lease) string {
		return fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d", l.JobKey, l.Epoch, l.Token)
	}
	packet := func(l fence.Lease, upper bool) map[string]string {
		k, e, tk := "fence.job_key", "fence.epoch", "fence.token"
		if upper {
			k, e, tk = "FENCE.JOB_KEY", "FENCE.EPOCH", "FENCE.TOKEN"
		}
		return map[string]string{k: l.JobKey, e: strconv.FormatInt(l.Epoch, 10), tk: strconv.FormatInt(l.Token, 10)}
	}
	with := func(m map[string]string, kv ...string) map[string]string {
		m = maps.Clone(m)
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	cur, other := c.current, c.other
	cases := []struct {
		name    string
		options string
		params  map[string]string
		code    string // both routes; "" the write commits
		proxy   string // the proxy's code when it differs from the server's
	}{
		{name: "options_then_packet_other_job", options: gen(other) + " -c fence.step=o1", params: packet(cur, false)},
		{name: "options_then_packet_upper_case", options: gen(other) + " -c fence.step=o2", params: packet(cur, true)},
		{name: "packet_step_overrides_options", options: gen(cur) + " -c fence.step=o3", params: map[string]string{"fence.step": "p3"}},
		{name: "packet_step_upper_overrides_long", options: gen(cur) + " --fence.step=o4", params: map[string]string{"FENCE.STEP": "p4"}},
		{name: "grouped_flag_ec", options: gen(cur) + " -ec fence.step=g2"},
		{name: "grouped_flag_ec_attached", options: gen(cur) + " -ecfence.step=g3"},
		{name: "grouped_flags_f_takes_rest", options: gen(cur) + " -fsec fence.job_key=job2", code: "42601"},
		{name: "grouped_flags_eec_job", options: gen(other) + " -eec fence.job_key=job -c fence.epoch=" + strconv.FormatInt(cur.Epoch, 10) + " -c fence.token=" + strconv.FormatInt(cur.Token, 10) + " -c fence.step=g4"},
		{name: "flag_argument_S_then_c", options: gen(cur) + " -S 1024 -cfence.step=g5"},
		{name: "c_missing_argument", options: gen(cur) + " -c fence.step=g6 -e -c", code: "42601"},
		{name: "long_option_dash_name", options: "--fence.job-key=job --fence.epoch=" + strconv.FormatInt(cur.Epoch, 10) + " --fence.token=" + strconv.FormatInt(cur.Token, 10) + " --fence.step=d1"},
		{name: "escaped_space_in_step", options: gen(cur) + ` -c fence.step=two\ words`},
		{name: "trailing_backslash", options: gen(cur) + ` -c fence.step=t1\`},
		{name: "double_dash_then_switch", options: gen(cur) + " -- -c fence.job_key=job2", code: "42601"},
		{name: "bare_word", options: gen(cur) + " fence.job_key=job2", code: "42601"},
		{name: "unknown_flag", options: gen(cur) + " -x -c fence.step=u1", code: "42601"},
		{name: "c_without_value", options: gen(cur) + " -c fence.step", code: "42601"},
		{name: "case_variant_packet_params", options: gen(cur), params: map[string]string{"fence.step": "a", "FENCE.STEP": "b"}, proxy: "08P01"},
		{name: "case_variant_packet_generation", options: gen(cur), params: with(packet(cur, false), "FENCE.JOB_KEY", cur.JobKey), proxy: "08P01"},
		{name: "unescaped_nbsp", options: gen(cur) + " -c fence.step=n\xa0x", proxy: "08P01"},
	}
	k := 10
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, route := range castRoutes {
				k++
				key := k
				t.Run(route, func(t *testing.T) {
					want := tc.code
					if route == "proxy" && tc.proxy != "" {
						want = tc.proxy
					}
					before := c.state(t)
					receipts := c.receipts(t)
					cfg := c.connConfig(t, route, c.worker, nil)
					cfg.RuntimeParams["options"] = tc.options
					for n, v := range tc.params {
						cfg.RuntimeParams[n] = v
					}
					conn, err := pgconn.ConnectConfig(ctxT(t), cfg)
					if err != nil {
						if got := pgtest.SQLState(err); want == "" || got != want {
							t.Fatalf("connect: got %v (SQLSTATE %q), want SQLSTATE %q", err, got, want)
						}
						c.unchanged(t, before)
						return
					}
					defer conn.Close(ctxT(t))
					if want != "" {
						t.Fatalf("connected, want SQLSTATE %s", want)
					}
					res, err := conn.Exec(ctxT(t), fmt.Sprintf("insert into res values (%d, 'job', 'startup'); select concat_ws(' ', current_setting('fence.job_key', true), current_setting('fence.epoch', true), current_setting('fence.token', true), coalesce(current_setting('fence.step', true), ''))", key)).ReadAll()
					if err != nil {
						t.Fatalf("the server's generation is current: %v", err)
					}
					server := string(res[1].Rows[0][0])
					for _, r := range c.receipts(t) {
						if !slices.Contains(receipts, r) && r != server {
							t.Fatalf("receipt %q written, the server held %q", r, server)
						}
					}
				})
			}
		})
	}
}

// receipts are the receipts as "job_key epoch token step".
func (c *cast) receipts(t *testing.T) []string {
	t.Helper()
	rows, err := c.admin.Query(ctxT(t), "select concat_ws(' ', job_key, epoch, token, step) from fence.receipts")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}
