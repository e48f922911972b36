package proxy

import (
	"testing"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/rewrite"
)

// TestReadsAlike: which text the gate reads at once while a statement
// that may switch client_encoding or standard_conforming_strings is in
// flight, and which it holds until the server tells it the settings.
func TestReadsAlike(t *testing.T) {
	for _, c := range []struct {
		text     string
		scsOff   bool
		encoding string
		want     bool
	}{
		{`SELECT 'a\\b'; COMMIT`, false, "UTF8", true},                   // a backslash pair reads as one string either way
		{`SELECT E'a\'b'; COMMIT`, false, "UTF8", true},                  // E'' strings do not depend on the setting
		{`SELECT 'a\''; COMMIT; --'`, false, "UTF8", false},              // off: a COMMIT appears
		{`SELECT 'a\''; COMMIT; --'`, true, "UTF8", false},               // on: it disappears
		{`SET fence.job_key = 'a\b'`, false, "UTF8", false},              // the value differs
		{"SELECT 'caf\xc3\xa9'; COMMIT", false, "UTF8", true},            // é in a literal
		{"INSERT INTO \"caf\xc3\xa9\" VALUES (1)", false, "UTF8", false}, // é in a name: another table in another encoding
		{"SET fence.job_key = 'caf\xc3\xa9'", false, "UTF8", false},      // é in a setting's value
		{"SELECT E'\xc3\x81\\'; COMMIT; --'", false, "UTF8", false},      // SJIS takes the backslash in
		{"DO $\xc3\xa9$ BEGIN END $\xc3\xa9$", false, "UTF8", false},     // a tag with é
		{"COMMIT -- \xe9", false, "UTF8", false},                         // not UTF-8: the server may read it as LATIN1
		{"COMMIT -- \xe9", false, "LATIN1", true},                        // LATIN1 é in a comment
		{"SELECT 1 /* \xe9 */; COMMIT", false, "WIN1252", true},
	} {
		h := &fenceSession{f: &Fence{classifier: rewrite.NewClassifier(nil)},
			be: &gateBackend{text: newTextState(map[string]string{"client_encoding": c.encoding, "server_encoding": "UTF8"}, zap.NewNop())}}
		h.be.text.scsOff = c.scsOff
		if got := h.readsAlike([]byte(c.text)); got != c.want {
			t.Errorf("readsAlike(%q, scs off %v, %s) = %v, want %v", c.text, c.scsOff, c.encoding, got, c.want)
		}
	}
}

// BenchmarkReadsAlike: what the gate spends on a text it reads while a
// statement that may switch the lexing settings is in flight (ASCII text
// without a backslash spends nothing: it is not sensitive).
func BenchmarkReadsAlike(b *testing.B) {
	for _, c := range []struct{ name, text string }{
		{"non_ascii_literal", "INSERT INTO results (job_key, payload, token) VALUES ('job', 'caf\xc3\xa9 cr\xc3\xa8me', 7)"},
		{"backslash_literal", `INSERT INTO results (job_key, payload, token) VALUES ('job', 'a\\b', 7)`},
	} {
		b.Run(c.name, func(b *testing.B) {
			h := &fenceSession{f: &Fence{classifier: rewrite.NewClassifier(nil)},
				be: &gateBackend{text: newTextState(map[string]string{"client_encoding": "UTF8", "server_encoding": "UTF8"}, zap.NewNop())}}
			raw := []byte(c.text)
			for i := 0; i < b.N; i++ {
				if !h.readsAlike(raw) {
					b.Fatal("does not read alike")
				}
			}
		})
	}
}
