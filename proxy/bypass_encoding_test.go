package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// The gate reads the client's text as the server does, whatever its
// client_encoding and standard_conforming_strings (issue 18 §1): a byte
// over 0x7F in a comment, an identifier or a literal must not hide a
// COMMIT, a PREPARE TRANSACTION or a protected write from it, and text it
// cannot read is refused on a fenced session, never forwarded unread.
func init() { registerBypass("encoding", bypassEncoding) }

// encConn is a raw connection through the gate for job r's lease,
// speaking client_encoding enc from the startup packet.
func (e *reservedEnv) encConn(t *testing.T, enc string, extra ...string) *pgconn.PgConn {
	t.Helper()
	cfg, err := pgconn.ParseConfig(e.proxy.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = pgoptions(e.lease, extra...)
	if enc != "" {
		cfg.RuntimeParams["client_encoding"] = enc
	}
	return connectConfig(t, cfg)
}

// exec runs raw text (bytes in the session's encoding) as one simple
// query and returns the first error.
func rawExec(ctx context.Context, c *pgconn.PgConn, text []byte) error {
	_, err := c.Exec(ctx, string(text)).ReadAll()
	return err
}

// sample returns the bytes of a character of enc that is not ASCII, and,
// when enc has one, of a character whose last byte is a backslash (SJIS
// 表, BIG5 功, ...), both checked with PostgreSQL itself.
func (e *reservedEnv) sample(t *testing.T, enc string) (plain, backslash []byte) {
	t.Helper()
	ctx := ctxT(t)
	d := e.direct(t)
	for _, ch := range []string{"é", "ж", "表", "α", "ש", "ก", "ä"} {
		var b []byte
		if err := d.QueryRow(ctx, "SELECT convert_to($1, $2)", ch, enc).Scan(&b); err == nil && len(b) > 0 && b[0] >= 0x80 {
			plain = b
			break
		}
	}
	for lead := 0x81; lead <= 0xfe && backslash == nil; lead++ {
		b := []byte{byte(lead), '\\'}
		var s string
		if err := d.QueryRow(ctx, "SELECT convert_from($1, $2)", b, enc).Scan(&s); err == nil && !strings.Contains(s, "\\") {
			backslash = b
		}
	}
	if plain == nil {
		t.Fatalf("no non-ASCII character found for %s", enc)
	}
	return plain, backslash
}

// gatedThen begins a transaction, writes job r's result through c (the
// gate's write: a receipt is due at COMMIT), then sends last, which ends
// the transaction in a way the gate must see.
func (e *reservedEnv) gatedThen(t *testing.T, c *pgconn.PgConn, payload string, last []byte) error {
	t.Helper()
	ctx := ctxT(t)
	if err := rawExec(ctx, c, []byte("BEGIN")); err != nil {
		t.Fatal(err)
	}
	ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', '%s', %d)", payload, e.lease.Token)
	if err := rawExec(ctx, c, []byte(ins)); err != nil {
		t.Fatalf("%s: %v", ins, err)
	}
	return rawExec(ctx, c, last)
}

// wantGatedCommit runs on c the gated write of payload, then last, which
// must commit it, and checks the commit and its receipt.
func (e *reservedEnv) wantGatedCommit(t *testing.T, c *pgconn.PgConn, payload string, last []byte) {
	t.Helper()
	if err := e.gatedThen(t, c, payload, last); err != nil {
		t.Fatal(err)
	}
	e.wantCommittedWithReceipt(t, payload)
}

func (e *reservedEnv) wantCommittedWithReceipt(t *testing.T, payload string) {
	t.Helper()
	e.wantResult(t, "r", payload, e.lease.Token)
	e.wantReceipt(t, "")
}

func bypassEncoding(t *testing.T) {
	encodings := []string{"LATIN1", "WIN1252", "LATIN2", "KOI8R", "WIN1251", "ISO_8859_7", "SJIS", "BIG5", "GBK", "UHC", "GB18030", "EUC_JP", "EUC_KR", "UTF8"}

	// A non-ASCII byte in a comment after COMMIT: the COMMIT must get its
	// receipt step (before the fix the text was forwarded unread).
	for _, enc := range encodings {
		t.Run("comment_hides_commit_"+strings.ToLower(enc), func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			plain, _ := e.sample(t, enc)
			c := e.encConn(t, enc)
			e.wantGatedCommit(t, c, "x", append([]byte("COMMIT -- "), plain...))
		})
	}

	// A backslash that is the second byte of a character, with
	// standard_conforming_strings off: read byte by byte, it escapes the
	// closing quote and the COMMIT after it is inside a string.
	for _, enc := range []string{"SJIS", "BIG5", "GBK", "GB18030"} { // UHC's second bytes are never a backslash
		for _, scs := range []string{"off", "on"} {
			t.Run(fmt.Sprintf("trail_backslash_%s_scs_%s", strings.ToLower(enc), scs), func(t *testing.T) {
				t.Parallel()
				e := newReservedEnv(t)
				_, bs := e.sample(t, enc)
				if bs == nil {
					t.Fatalf("%s has no character ending in a backslash", enc)
				}
				c := e.encConn(t, enc, "-c standard_conforming_strings="+scs)
				open := []byte("SELECT '")
				if scs == "on" {
					open = []byte("SELECT E'")
				}
				q := append(append(open, bs...), []byte("'; COMMIT; --'")...)
				e.wantGatedCommit(t, c, "y", q)
			})
		}
	}

	// With standard_conforming_strings off, \' inside a string is a
	// quote: PostgreSQL reads 'a\'' as the string a' and runs the COMMIT
	// after it, where a reading with the setting on sees one string to
	// the end. Off from the startup packet, by SET, and from a DO block.
	for _, c := range []struct{ name, option, change string }{
		{"startup", "-c standard_conforming_strings=off", ""},
		{"set", "", "SET standard_conforming_strings = off"},
		{"do_block", "", "DO $$ BEGIN PERFORM set_config('standard_conforming_strings', 'off', false); END $$"},
	} {
		t.Run("scs_off_hides_commit_"+c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			var extra []string
			if c.option != "" {
				extra = append(extra, c.option)
			}
			conn := e.encConn(t, "UTF8", extra...)
			if c.change != "" {
				mustExec(t, conn, c.change)
			}
			e.wantGatedCommit(t, conn, "q", []byte(`SELECT 'a\''; COMMIT; --'`))
		})
	}

	// Pipelined simple queries: the encoding changes in the first, the
	// second (sent before the first's answer) is LATIN1.
	t.Run("change_pipelined_simple", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "UTF8")
		mustExec(t, c, "BEGIN")
		ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'm', %d)", e.lease.Token)
		mustExec(t, c, ins)
		fe := c.Frontend()
		fe.Send(&pgproto3.Query{String: "SET client_encoding = 'LATIN1'"})
		fe.Send(&pgproto3.Query{String: "COMMIT -- \xe9"})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for rfq := 0; rfq < 2; {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.ErrorResponse:
				t.Fatalf("error %s: %s", m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				rfq++
			}
		}
		e.wantCommittedWithReceipt(t, "m")
	})

	// PREPARE TRANSACTION behind a non-ASCII comment is refused (FN009)
	// like a visible one.
	t.Run("comment_hides_prepare_transaction", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		plain, _ := e.sample(t, "LATIN1")
		c := e.encConn(t, "LATIN1")
		before := e.snapshot(t)
		err := e.gatedThen(t, c, "z", append([]byte("PREPARE TRANSACTION 'p' -- "), plain...))
		wantCode(t, err, fence.CodeUnsupported)
		e.unchanged(t, before)
	})

	// A protected write whose literal and whose comment carry LATIN1
	// bytes is gated, and stored as the server reads it.
	t.Run("latin1_literal_write_gated", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "LATIN1")
		q := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'caf\xe9', %d) -- \xe9", e.lease.Token)
		mustExec(t, c, q)
		e.wantCommittedWithReceipt(t, "café")
	})

	// A stale writer in LATIN1 is refused as in UTF8.
	t.Run("latin1_stale_write_refused", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "LATIN1")
		e.takeover(t, "r", "w2", e.lease)
		before := e.snapshot(t)
		q := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'caf\xe9', %d)", e.lease.Token)
		wantCode(t, rawExec(ctxT(t), c, []byte(q)), fence.CodeStale)
		e.unchanged(t, before)
	})

	// Text invalid in the session's encoding is refused (22021), not
	// forwarded.
	for _, c := range []struct{ enc, text string }{
		{"UTF8", "COMMIT -- \xe9"},
		{"UTF8", "INSERT INTO results VALUES ('r', '\xc0\xa7', 1)"},
		{"SJIS", "COMMIT -- \x81\x20"},
		{"EUC_JP", "COMMIT -- \xa4\x27"},
		{"GB18030", "COMMIT -- \x81\x30\x27"},
	} {
		t.Run("invalid_"+strings.ToLower(c.enc), func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, c.enc)
			mustExec(t, conn, "BEGIN")
			ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'w', %d)", e.lease.Token)
			mustExec(t, conn, ins)
			before := e.snapshot(t)
			wantCode(t, rawExec(ctxT(t), conn, []byte(c.text)), "22021")
			e.unchanged(t, before)
			mustExec(t, conn, "ROLLBACK")
		})
	}

	// A statement the parser rejects on a fenced session is refused, not
	// passed through (42601), and the transaction aborts as the server's
	// own syntax error would abort it.
	t.Run("unparsable_refused", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "")
		before := e.snapshot(t)
		err := e.gatedThen(t, c, "s", []byte("COMMIT; SELEC 1"))
		wantCode(t, err, "42601")
		e.unchanged(t, before)
		wantCode(t, rawExec(ctxT(t), c, []byte("SELECT 1")), "25P02")
	})

	// The encoding changes in the middle of the session: by SET, by
	// set_config, from inside a DO block (which the gate cannot read).
	for _, c := range []struct{ name, change string }{
		{"set", "SET client_encoding = 'LATIN1'"},
		{"set_names", "SET NAMES 'LATIN1'"},
		{"set_config", "SELECT set_config('client_encoding', 'LATIN1', false)"},
		{"do_block", "DO $$ BEGIN PERFORM set_config('client_encoding', 'LATIN1', false); END $$"},
		{"set_config_not_literal", "SELECT set_config(name, 'LATIN1', false) FROM pg_settings WHERE name = 'client_encoding'"},
	} {
		t.Run("change_by_"+c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			mustExec(t, conn, c.change)
			e.wantGatedCommit(t, conn, "l", []byte("COMMIT -- \xe9"))
		})
	}

	// In one extended-protocol batch: the encoding changes, then a
	// protected write and a COMMIT in LATIN1 follow before the Sync. The
	// gate reads the settings back inside the batch.
	t.Run("change_inside_pipeline", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "UTF8")
		fe := c.Frontend()
		send := func(q string) {
			fe.Send(&pgproto3.Parse{Query: q})
			fe.Send(&pgproto3.Bind{})
			fe.Send(&pgproto3.Execute{})
		}
		send("BEGIN")
		send("DO $$ BEGIN PERFORM set_config('client_encoding', 'LATIN1', false); END $$")
		send(fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'p\xe9', %d)", e.lease.Token))
		send("COMMIT -- \xe9")
		rawUntil(t, c, 'Z', &pgproto3.Sync{})
		e.wantCommittedWithReceipt(t, "pé")
	})

	// COPY FROM a protected table, named with a comment in LATIN1, is
	// gated.
	t.Run("copy_from_behind_latin1_comment", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		c := e.encConn(t, "LATIN1")
		data := fmt.Sprintf("r\tcopi\xe9\t%d\n", e.lease.Token)
		if _, err := c.CopyFrom(ctxT(t), strings.NewReader(data), "COPY results (job_key, payload, token) FROM STDIN -- \xe9"); err != nil {
			t.Fatal(err)
		}
		e.wantCommittedWithReceipt(t, "copié")
	})
}
