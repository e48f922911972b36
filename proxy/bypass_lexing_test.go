package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Text is never classified under lexing rules that may have changed and
// not yet been confirmed (issue 30, HIGH 3, third bullet). Client code
// the proxy cannot see into — a view's function, a trigger, a column's
// default, an operator, a domain's check, a function named like a
// built-in — may switch standard_conforming_strings off or
// client_encoding to SJIS; the server reports the new value only when
// the statement ends, and a query pipelined behind it would be read under
// the old rules: `SELECT 'a\” ; COMMIT ; --'` is one SELECT to a reader
// with the setting on and a COMMIT to the server with it off. While
// such a statement is in flight, the gate reads later text that the
// settings could change only once every reading it could have agrees, or
// once the server has told it the settings.
func init() { registerBypass("lexing", bypassLexing) }

// lexingSchema is the attacker's toolkit: flip() switches
// standard_conforming_strings off for the session (sjis() switches
// client_encoding to SJIS, latin1() to LATIN1), and every way to run it
// unseen.
const lexingSchema = `
CREATE FUNCTION flip() RETURNS int LANGUAGE plpgsql AS $$
BEGIN PERFORM set_config('standard_conforming_strings', 'off', false); RETURN 1; END $$;
CREATE FUNCTION sjis() RETURNS int LANGUAGE plpgsql AS $$
BEGIN PERFORM set_config('client_encoding', 'SJIS', false); RETURN 1; END $$;
CREATE FUNCTION latin1() RETURNS int LANGUAGE plpgsql AS $$
BEGIN PERFORM set_config('client_encoding', 'LATIN1', false); RETURN 1; END $$;
CREATE VIEW v_flip AS SELECT flip() AS x;
CREATE VIEW v_sjis AS SELECT sjis() AS x;
CREATE VIEW v_latin1 AS SELECT latin1() AS x;
CREATE FUNCTION flip_trg() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM flip(); RETURN NEW; END $$;
CREATE TABLE lex_trig (note text);
CREATE TRIGGER lex_trig_flip BEFORE INSERT ON lex_trig FOR EACH ROW EXECUTE FUNCTION flip_trg();
CREATE FUNCTION sjis_trg() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM sjis(); RETURN NEW; END $$;
CREATE TABLE lex_sjis (note text);
CREATE TRIGGER lex_sjis_flip BEFORE INSERT ON lex_sjis FOR EACH ROW EXECUTE FUNCTION sjis_trg();
CREATE TABLE lex_default (x int DEFAULT flip());
CREATE FUNCTION flip_op(int, int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN flip(); END $$;
CREATE OPERATOR #@# (LEFTARG = int, RIGHTARG = int, FUNCTION = flip_op);
CREATE FUNCTION flip_check(int) RETURNS bool LANGUAGE plpgsql AS $$ BEGIN RETURN flip() = 1; END $$;
CREATE DOMAIN flipdom AS int CHECK (flip_check(VALUE));
CREATE FUNCTION public.lower(int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN flip(); END $$;
CREATE FUNCTION flip_idx(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN flip(); END $$;
CREATE TABLE lex_indexed (x int);
CREATE INDEX ON lex_indexed (flip_idx(x));
`

// hiddenCommit is one SELECT read with standard_conforming_strings on,
// a SELECT and a COMMIT with it off.
const hiddenCommit = `SELECT 'a\''; COMMIT; --'`

// sjisHiddenCommit is one SELECT read as UTF-8 (\xc3\x81 is Á, and \'
// escapes the quote), a SELECT and a COMMIT read as SJIS (\xc3 is a
// character of its own and \x81\x5c is one: the backslash is part of it).
const sjisHiddenCommit = "SELECT E'\xc3\x81\\'; COMMIT; --'"

func newLexingEnv(t *testing.T) *reservedEnv {
	t.Helper()
	e := newReservedEnv(t)
	execOK(t, e.direct(t), lexingSchema)
	return e
}

// pipelined sends each text as a simple query in one write, before any
// answer, and reads every answer, failing on an error.
func pipelined(t *testing.T, c *pgconn.PgConn, texts ...[]byte) {
	t.Helper()
	fe := c.Frontend()
	for _, q := range texts {
		fe.Send(&pgproto3.Query{String: string(q)})
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	for rfq := 0; rfq < len(texts); {
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
}

func bypassLexing(t *testing.T) {
	// In a gated transaction, a statement whose client code switches the
	// rules, and pipelined behind it, before its answer, a text whose
	// COMMIT only the new rules show: the gate must see the COMMIT and
	// put the receipt step before it.
	for _, v := range []struct{ name, sql, hidden string }{
		{"view_scs", "SELECT x FROM v_flip", hiddenCommit},
		{"subquery_view_scs", "SELECT * FROM (SELECT x FROM v_flip) s", hiddenCommit},
		{"cte_view_scs", "WITH w AS (SELECT x FROM v_flip) SELECT * FROM w", hiddenCommit},
		{"copy_view_scs", "COPY (SELECT x FROM v_flip) TO STDOUT", hiddenCommit},
		{"trigger_scs", "INSERT INTO lex_trig VALUES ('t')", hiddenCommit},
		{"column_default_scs", "INSERT INTO lex_default DEFAULT VALUES", hiddenCommit},
		{"operator_scs", "SELECT 1 #@# 1", hiddenCommit},
		{"domain_check_scs", "SELECT 1::flipdom", hiddenCommit},
		{"builtin_name_scs", "SELECT lower(1)", hiddenCommit},
		{"index_expression_scs", "INSERT INTO lex_indexed VALUES (1)", hiddenCommit},
		{"view_sjis", "SELECT x FROM v_sjis", sjisHiddenCommit},
		{"trigger_sjis", "INSERT INTO lex_sjis VALUES ('t')", sjisHiddenCommit},
		// Text the old rules cannot read at all (LATIN1 é is not UTF-8)
		// is read with the new ones, not refused.
		{"view_latin1", "SELECT x FROM v_latin1", "COMMIT -- \xe9"},
	} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			e := newLexingEnv(t)
			c := e.encConn(t, "UTF8")
			mustExec(t, c, "BEGIN")
			mustExec(t, c, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'lexed', %d)", e.lease.Token))
			pipelined(t, c, []byte(v.sql), []byte(v.hidden))
			e.wantCommittedWithReceipt(t, "lexed")
		})
	}

	// The extended protocol, one batch outside a transaction: the
	// vector, then a statement that is a read with the setting on and a
	// protected write with it off. The gate must see the write (gate it,
	// and end the batch with its receipt), not leave it to the backstop.
	hiddenWrite := `WITH x AS (SELECT 'a\''), y AS (UPDATE results SET payload = $h$hidden$h$ WHERE job_key = $h$r$h$ RETURNING 1) SELECT 1 --') SELECT 1` + "\n"
	for _, v := range []struct{ name, sql string }{
		{"extended_view", "SELECT x FROM v_flip"},
		{"extended_trigger", "INSERT INTO lex_trig VALUES ('t')"},
		{"extended_operator", "SELECT 1 #@# 1"},
		{"extended_builtin_name", "SELECT lower(1)"},
	} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			e := newLexingEnv(t)
			c := e.encConn(t, "UTF8")
			mustExec(t, c, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'seed', %d)", e.lease.Token))
			mustExec(t, c, "SET fence.step = 'hidden'")
			rawUntil(t, c, 'Z',
				&pgproto3.Parse{Query: v.sql}, &pgproto3.Bind{}, &pgproto3.Execute{},
				&pgproto3.Parse{Query: hiddenWrite}, &pgproto3.Bind{}, &pgproto3.Execute{},
				&pgproto3.Sync{})
			e.wantResult(t, "r", "hidden", e.lease.Token)
			e.wantReceipt(t, "hidden") // the proxy's digest (v1), not the backstop's
		})
	}

	// Text that reads alike whichever rules apply is read at once, and
	// correctly: a doubled backslash, an E'' string, a non-ASCII
	// character in a literal.
	for _, q := range []string{`SELECT 'a\\b'; COMMIT`, `SELECT E'a\'b'; COMMIT`, "SELECT 'caf\xc3\xa9'; COMMIT"} {
		t.Run(fmt.Sprintf("agreeing_%q", q), func(t *testing.T) {
			t.Parallel()
			e := newLexingEnv(t)
			c := e.encConn(t, "UTF8")
			mustExec(t, c, "BEGIN")
			mustExec(t, c, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'agreed', %d)", e.lease.Token))
			pipelined(t, c, []byte("SELECT x FROM v_flip"), []byte(q))
			e.wantCommittedWithReceipt(t, "agreed")
		})
	}
}
