package proxy

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite/plan"
)

func init() { registerBypass("literal", bypassLiteral) }

// literalHostile are client values the proxy may put into SQL it builds:
// dollar tags (its own and others), quotes, backslashes in every
// position, a NUL, invalid UTF-8, characters whose UTF-8 ends in a byte
// that is a lead byte in SJIS, BIG5 and GBK, and SQL after a closed quote.
var literalHostile = []struct{ name, v string }{
	{"dollar_tag", "1$pgfence$; select 1; $pgfence$"},
	{"dollar_tag_end_of_body", "x; END$pgfence$; select pg_catalog.pg_sleep(0); DO $pgfence$BEGIN"},
	{"empty_dollar_tag", "$$ $$"},
	{"quote", "1'; select 1; --"},
	{"doubled_quote", "''''"},
	{"backslash_quote", `1\'; select 1; --`},
	{"trailing_backslash", `1\`},
	{"backslashes", `\\\x27\u0027`},
	{"nul", "1\x00'; select 1; --"},
	{"invalid_utf8", "1\xff\xfe'\\"},
	{"multibyte_then_backslash", "\u00c1\\'; select 1; --"},
	{"multibyte_lead_bytes", "\u0101\u0141\u0901\\\\'"},
	{"astral", "\U0001F600\\'"},
	{"control", "a\tb\nc\rd\x1be\x7f"},
	{"comment", "1 /* ' */ -- '"},
}

// literalWant is what a value reads as in PostgreSQL: NULs and invalid
// UTF-8 become U+FFFD.
func literalWant(v string) string {
	var b strings.Builder
	for _, r := range v { // each invalid byte is one utf8.RuneError
		if r == 0 {
			r = utf8.RuneError
		}
		b.WriteRune(r)
	}
	return b.String()
}

// bypassLiteral: no client text is ever put in SQL the proxy builds except
// as a literal PostgreSQL reads back as that text, whatever the session's
// client_encoding and standard_conforming_strings (issue 30, A-L2: a
// fence.token of '1$pgfence$…' ended the DO body of the proxy's refusal
// and made it a syntax error). Each value goes through every builder
// (plan.Literal, plan.RaiseSQL, plan.GateSQL, plan.CommitSQL,
// noSchemaProbe, fenceCheckQuery) in sessions with SJIS, BIG5, GBK and
// UTF8 and standard_conforming_strings off and on; and, through the
// proxy, as the value of a fence setting a protected write then reads.
func bypassLiteral(t *testing.T) {
	c := newCast(t)
	type session struct{ enc, scs string }
	sessions := []session{{"UTF8", "on"}, {"UTF8", "off"}, {"SJIS", "on"}, {"SJIS", "off"}, {"BIG5", "off"}, {"GBK", "off"}}
	conns := map[session]*pgconn.PgConn{}
	for _, s := range sessions {
		conn := c.connect(t, "direct", c.worker, nil)
		if _, err := conn.Exec(ctxT(t), fmt.Sprintf("set client_encoding = '%s'; set standard_conforming_strings = %s; set escape_string_warning = off", s.enc, s.scs)).ReadAll(); err != nil {
			t.Fatal(err)
		}
		conns[s] = conn
	}
	// equal: sql's one value is v, compared in the server's encoding.
	equal := func(v string) string {
		return "OPERATOR(pg_catalog.=) pg_catalog.convert_from(E'\\\\x" + hex.EncodeToString([]byte(literalWant(v))) + "'::pg_catalog.bytea, 'UTF8')"
	}
	for _, h := range literalHostile {
		t.Run(h.name, func(t *testing.T) {
			for _, s := range sessions {
				conn := conns[s]
				t.Run(s.enc+"_scs_"+s.scs, func(t *testing.T) {
					before := c.state(t)
					// Literal reads back as the value.
					rs, err := conn.Exec(ctxT(t), "SELECT ("+plan.Literal(h.v)+" "+equal(h.v)+")::pg_catalog.text").ReadAll()
					if err != nil || len(rs) != 1 || len(rs[0].Rows) != 1 || string(rs[0].Rows[0][0]) != "true" {
						t.Fatalf("Literal(%q) = %s: %v %v", h.v, plan.Literal(h.v), rs, err)
					}
					// RaiseSQL raises exactly the error, the value in its
					// message and hint (a session whose client_encoding
					// cannot carry a character of the message gets 22P05
					// instead: PostgreSQL's own conversion of the error).
					e := &fence.Error{Code: "FN008", Message: "bad " + h.v, Hint: h.v + " hint"}
					_, err = conn.Exec(ctxT(t), plan.RaiseSQL(e)).ReadAll()
					var pe *pgconn.PgError
					if !errors.As(err, &pe) || !(pe.Code == "FN008" || s.enc != "UTF8" && pe.Code == "22P05") {
						t.Fatalf("%s: got %v (SQLSTATE %q), want FN008", plan.RaiseSQL(e), err, pgtest.SQLState(err))
					}
					if s.enc == "UTF8" && (pe.Message != literalWant(e.Message) || pe.Hint != literalWant(e.Hint)) {
						t.Fatalf("%s: message %q hint %q, want %q, %q", plan.RaiseSQL(e), pe.Message, pe.Hint, literalWant(e.Message), literalWant(e.Hint))
					}
					// The probe of a fence schema raises nothing here (the
					// database has one), whatever its message.
					if _, err = conn.Exec(ctxT(t), noSchemaProbe(e)).ReadAll(); err != nil {
						t.Fatalf("%s: %v", noSchemaProbe(e), err)
					}
					// The gate and the commit step: the value is the job key
					// and the step, which nobody acquired (FN005).
					g := fence.Generation{JobKey: h.v, Epoch: 1, Token: 1, Step: h.v}
					for _, sql := range []string{plan.GateSQL(g), plan.CommitSQL(true, g, []byte{1, 2}, h.v), plan.CommitSQL(false, g, []byte{1}, "v")} {
						_, err = conn.Exec(ctxT(t), "BEGIN; "+sql+"; COMMIT").ReadAll()
						if _, rerr := conn.Exec(ctxT(t), "ROLLBACK").ReadAll(); rerr != nil {
							t.Fatal(rerr)
						}
						code := pgtest.SQLState(err)
						if code != "FN005" && code != "22023" && !(s.enc != "UTF8" && code == "22P05") && !(err == nil && strings.Contains(sql, "commit_if_written")) {
							t.Fatalf("%s: got %v (SQLSTATE %q), want FN005 (an unknown job)", sql, err, code)
						}
					}
					// The replica's fence check reads the key as a value.
					for _, reached := range []bool{false, true} {
						sql := fenceCheckQuery(requirement{job: h.v, epoch: 1, token: 1}, reached)
						if _, err = conn.Exec(ctxT(t), sql).ReadAll(); err != nil && pgtest.SQLState(err) != "42501" {
							t.Fatalf("%s: %v", sql, err)
						}
					}
					c.unchanged(t, before)
				})
			}
		})
	}
	// Through the proxy: the value of a fence setting that a protected
	// write then needs, in the refusal the proxy raises.
	t.Run("fence_settings_through_proxy", func(t *testing.T) {
		for _, h := range literalHostile {
			if strings.ContainsRune(h.v, 0) || !utf8.ValidString(h.v) {
				continue // a query cannot carry it (the literal cases above do)
			}
			for _, setting := range []string{"fence.token", "fence.epoch"} {
				t.Run(h.name+"_"+strings.TrimPrefix(setting, "fence."), func(t *testing.T) {
					q := strings.ReplaceAll(h.v, "'", "''")
					before := c.state(t)
					conn := c.connect(t, "proxy", c.worker, &c.current)
					_, err := conn.Exec(ctxT(t), "BEGIN; SET LOCAL "+setting+" = E'"+strings.ReplaceAll(q, `\`, `\\`)+"'; INSERT INTO inh VALUES (55, 'job', 'x'); COMMIT").ReadAll()
					if code := pgtest.SQLState(err); code == "" || code == "42601" || code == "XX000" || code[:2] == "08" {
						t.Fatalf("got %v (SQLSTATE %q), want the proxy's refusal", err, code)
					}
					c.unchanged(t, before)
				})
			}
		}
	})
}
