package main

import (
	"bytes"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func printed(t *testing.T, o output, asJSON bool) string {
	t.Helper()
	var b bytes.Buffer
	if err := o.print(&b, asJSON); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// The outputs every command prints with: text, or one line of JSON.
func TestOutput(t *testing.T) {
	at := time.Date(2030, 1, 2, 3, 4, 5, 600, time.UTC)
	kvs := keyValues(field{"job_key", "nightly report"}, field{"holder", "o'brien"}, field{"token", int64(7)},
		field{"expires_at", at}, field{"released", true})
	type row struct {
		Name string `json:"name"`
		N    int    `json:"n"`
	}
	cells := func(r row) []string { return []string{r.Name, "x"} }
	for _, tt := range []struct {
		name   string
		o      output
		asJSON bool
		want   string
	}{
		{"key=value lines a shell evals, in order", kvs, false,
			"job_key='nightly report'\nholder='o'\\''brien'\ntoken=7\nexpires_at=2030-01-02T03:04:05.0000006Z\nreleased=true\n"},
		{"key=value as one JSON object", kvs, true,
			`{"expires_at":"2030-01-02T03:04:05.0000006Z","holder":"o'brien","job_key":"nightly report","released":true,"token":7}` + "\n"},
		{"a list without rows", listing([]row(nil), "no rows", []string{"NAME", "X"}, cells), false, "no rows\n"},
		{"a list without rows as JSON", listing([]row(nil), "no rows", []string{"NAME", "X"}, cells), true, "[]\n"},
		{"a table", listing([]row{{"a", 1}, {"long name", 2}}, "no rows", []string{"NAME", "X"}, cells), false,
			"NAME       X\na          x\nlong name  x\n"},
		{"rows as a JSON array", listing([]row{{"a", 1}}, "no rows", nil, cells), true, `[{"name":"a","n":1}]` + "\n"},
		{"indented JSON", output{json: row{"a", 1}, indent: true}, true, "{\n  \"name\": \"a\",\n  \"n\": 1\n}\n"},
		{"text", output{json: row{"a", 1}, text: textf("%s has %d", "a", 1)}, false, "a has 1\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := printed(t, tt.o, tt.asJSON); got != tt.want {
				t.Errorf("got %q, want %q", got, tt.want)
			}
		})
	}
	// A failed write is the command's error, not silence.
	if err := textf("x")(failingWriter{}); err == nil {
		t.Error("textf to a failing writer: no error")
	}
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, io.ErrClosedPipe }

// A value a worker chose (a lease's holder) cannot forge lines of a table
// or of key=value output, nor reach the terminal as control characters;
// key=value output still reads back exactly under bash's eval (round 25,
// BC-L4).
func TestOutputControlCharacters(t *testing.T) {
	evil := "w1\nnightly-report  free\x1b]0;owned\x07'\\"
	type row struct{ Holder string }
	table := printed(t, listing([]row{{evil}}, "none", []string{"holder"}, func(r row) []string { return []string{r.Holder} }), false)
	if lines := strings.Count(table, "\n"); lines != 2 || strings.ContainsAny(table, "\x1b\x07") {
		t.Fatalf("table with a control-character holder:\n%q", table)
	}
	kv := printed(t, keyValues(field{"holder", evil}), false)
	if strings.Count(kv, "\n") != 1 || strings.ContainsAny(kv, "\x1b\x07") {
		t.Fatalf("key=value with a control-character holder: %q", kv)
	}
	out, err := exec.Command("bash", "-c", `eval "$1"; printf %s "$holder"`, "-", kv).Output()
	if err != nil {
		t.Fatalf("bash eval of %q: %v", kv, err)
	}
	if string(out) != evil {
		t.Fatalf("bash read back %q, want %q", out, evil)
	}
}
