package fence_test

import (
	"bytes"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fence"
)

var update = flag.Bool("update", false, "rewrite testdata/digest_v1.golden")

// digestCases are fixed inputs whose v1 digests are pinned in
// testdata/digest_v1.golden: the encoding must never change silently.
var digestCases = []struct {
	name string
	fill func(d *fence.Digest)
}{
	{"empty", func(d *fence.Digest) {}},
	{"one_statement_no_params", func(d *fence.Digest) {
		d.Statement("INSERT INTO results (job_key, payload) VALUES ('a', 'b')", nil)
	}},
	{"statement_with_params", func(d *fence.Digest) {
		d.Statement("INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3)", []fence.Param{
			{Format: 0, TypeOID: 25, Value: []byte("report")},
			{Format: 0, TypeOID: 0, Null: true},
			{Format: 1, TypeOID: 20, Value: []byte{0, 0, 0, 0, 0, 0, 0, 17}},
		})
	}},
	{"empty_value_is_not_null", func(d *fence.Digest) {
		d.Statement("UPDATE t SET v = $1", []fence.Param{{Format: 0, TypeOID: 25, Value: []byte{}}})
	}},
	{"copy", func(d *fence.Digest) {
		d.Statement("COPY results FROM STDIN", nil)
		d.CopyData([]byte("a\tb\t17\n"))
		d.CopyData([]byte("c\td\t17\n"))
		d.EndCopy()
	}},
	{"savepoint_rollback", func(d *fence.Digest) {
		d.Statement("INSERT INTO t VALUES (1)", nil)
		m := d.Mark()
		d.Statement("INSERT INTO t VALUES (2)", nil)
		d.Rollback(m)
		d.Statement("INSERT INTO t VALUES (3)", nil)
	}},
}

func TestDigestGolden(t *testing.T) {
	var b strings.Builder
	for _, c := range digestCases {
		var d fence.Digest
		c.fill(&d)
		fmt.Fprintf(&b, "%s %s\n", c.name, hex.EncodeToString(d.Sum()))
	}
	const path = "testdata/digest_v1.golden"
	if *update {
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := b.String(); got != string(want) {
		t.Fatalf("v1 digests changed (a new encoding needs a new DigestVersion):\ngot:\n%s\nwant:\n%s", got, want)
	}
	if fence.DigestVersion != "v1" {
		t.Fatalf("DigestVersion: got %q, want v1", fence.DigestVersion)
	}
}

func sum(fill func(d *fence.Digest)) []byte {
	var d fence.Digest
	fill(&d)
	return d.Sum()
}

func TestDigestProperties(t *testing.T) {
	p := func(v string) fence.Param { return fence.Param{TypeOID: 25, Value: []byte(v)} }
	distinct := map[string]func(d *fence.Digest){
		"ab|c":        func(d *fence.Digest) { d.Statement("S", []fence.Param{p("ab"), p("c")}) },
		"a|bc":        func(d *fence.Digest) { d.Statement("S", []fence.Param{p("a"), p("bc")}) },
		"null":        func(d *fence.Digest) { d.Statement("S", []fence.Param{{TypeOID: 25, Null: true}}) },
		"empty":       func(d *fence.Digest) { d.Statement("S", []fence.Param{p("")}) },
		"binary":      func(d *fence.Digest) { d.Statement("S", []fence.Param{{Format: 1, TypeOID: 25}}) },
		"two_stmts":   func(d *fence.Digest) { d.Statement("S", nil); d.Statement("T", nil) },
		"swapped":     func(d *fence.Digest) { d.Statement("T", nil); d.Statement("S", nil) },
		"copy_S":      func(d *fence.Digest) { d.CopyData([]byte("S")); d.EndCopy() },
		"statement_S": func(d *fence.Digest) { d.Statement("S", nil) },
		"nothing":     func(d *fence.Digest) {},
	}
	seen := map[string]string{}
	for name, fill := range distinct {
		h := hex.EncodeToString(sum(fill))
		if other, ok := seen[h]; ok {
			t.Errorf("%s and %s have the same digest", name, other)
		}
		seen[h] = name
	}
	// COPY chunk boundaries do not matter.
	a := sum(func(d *fence.Digest) { d.CopyData([]byte("abc")); d.CopyData([]byte("def")); d.EndCopy() })
	b := sum(func(d *fence.Digest) { d.CopyData([]byte("ab")); d.CopyData([]byte("cdef")); d.EndCopy() })
	if !bytes.Equal(a, b) {
		t.Error("COPY digest depends on chunk boundaries")
	}
	// An open COPY counts as ended; Sum does not change the Digest.
	var d fence.Digest
	d.CopyData([]byte("abcdef"))
	open := d.Sum()
	if !bytes.Equal(open, a) || !bytes.Equal(d.Sum(), a) {
		t.Error("Sum with an open COPY differs from the ended COPY")
	}
	// Reset and Rollback(0) give the empty digest.
	empty := sum(func(d *fence.Digest) {})
	d.Reset()
	if !d.Empty() || !bytes.Equal(d.Sum(), empty) {
		t.Error("Reset did not empty the digest")
	}
	d.Statement("S", nil)
	d.Rollback(0)
	if !d.Empty() || !bytes.Equal(d.Sum(), empty) || len(d.Sum()) != 32 {
		t.Error("Rollback(0) did not empty the digest")
	}
}

func TestDigestStatementDoesNotAllocate(t *testing.T) {
	var d fence.Digest
	params := []fence.Param{{TypeOID: 25, Value: []byte("report")}, {TypeOID: 20, Value: []byte("17")}, {Null: true}}
	sql := "INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3)"
	for range 64 {
		d.Statement(sql, params) // grow the buffers
	}
	d.Reset()
	allocs := testing.AllocsPerRun(1000, func() {
		d.Statement(sql, params)
		if d.Len() >= 64 {
			d.Reset()
		}
	})
	if allocs != 0 {
		t.Fatalf("Statement allocates: got %v allocs per call, want 0", allocs)
	}
}

func BenchmarkDigestStatement(b *testing.B) {
	var d fence.Digest
	params := []fence.Param{{TypeOID: 25, Value: []byte("report")}, {TypeOID: 20, Value: []byte("17")}}
	for b.Loop() {
		d.Statement("INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3)", params)
		if d.Len() >= 1024 {
			d.Reset()
		}
	}
}
