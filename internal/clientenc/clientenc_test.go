package clientenc

import (
	"context"
	"flag"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.fuzz"); f != nil && f.Value.String() != "" {
		os.Exit(m.Run())
	}
	os.Exit(pgtest.Run(m, pgtest.Options{}, nil, &cluster))
}

func TestLookup(t *testing.T) {
	for _, c := range []struct {
		name string
		want ID
	}{
		{"UTF8", UTF8}, {"utf-8", UTF8}, {"Unicode", UTF8}, {"LATIN1", Latin1}, {"iso-8859-1", Latin1},
		{"ISO_8859_1", Latin1}, {"win1252", WIN1252}, {"Windows-1252", WIN1252}, {"SJIS", SJIS},
		{"Shift_JIS", SJIS}, {"mskanji", SJIS}, {"BIG5", BIG5}, {"ISO_8859_5", ISO8859_5},
		{"SQL_ASCII", SQLASCII}, {"SHIFT_JIS_2004", ShiftJIS2004}, {"koi8", KOI8R},
	} {
		if got, ok := Lookup(c.name); !ok || got != c.want {
			t.Errorf("Lookup(%q) = %v, %v; want %v", c.name, got, ok, c.want)
		}
	}
	if _, ok := Lookup("EBCDIC"); ok {
		t.Error("Lookup(EBCDIC) succeeded")
	}
	for id := ID(0); id < numIDs; id++ {
		if got, ok := Lookup(id.String()); !ok || got != id {
			t.Errorf("Lookup(%q) = %v, %v", id, got, ok)
		}
	}
}

// TestAgainstPostgres decodes byte strings the way PostgreSQL does,
// with PostgreSQL itself as the oracle (convert_from runs the same
// verification and conversion as client text). Where both accept a
// string, the two decodings must agree on every ASCII character and its
// position among the characters — the statement's structure — and, for
// encodings x/text maps, on the characters themselves. Where PostgreSQL
// refuses a string Decode must refuse it, or decode it without a quote,
// backslash or semicolon PostgreSQL would not see. The strings mix the
// bytes that matter (quotes, backslash, semicolon, letters) with bytes
// above 0x7F at random, and include each encoding's trickiest pairs.
func TestAgainstPostgres(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rng := rand.New(rand.NewPCG(20261201, 1))
	special := []byte("'\"\\;aZ 0\n")
	crafted := map[ID][][]byte{
		SJIS:    {{0x95, 0x5c}, {0x81, 0x27}, {0x82, 0xa0}, {0xa1}, {0x81, 0x7f}, {0x95, 0x5c, 0x27}},
		BIG5:    {{0xa4, 0x5c}, {0xa1, 0x27}, {0xa4, 0x40}, {0xa5, 0x5c, 0x27}},
		GBK:     {{0x81, 0x5c}, {0xb0, 0xa1}, {0x81, 0x27}, {0x80, 0xfe, 0x41}, {0x80}},
		UHC:     {{0x81, 0x5c}, {0xb0, 0xa1}, {0x81, 0x27}},
		GB18030: {{0x81, 0x30, 0x81, 0x30}, {0x84, 0x31, 0xa4, 0x37}, {0x81, 0x5c}, {0x81, 0x30, 0x27}},
		UTF8:    {{0xc3, 0xa9}, {0xc0, 0xa7}, {0xed, 0xa0, 0x80}, {0xf4, 0x90, 0x80, 0x80}, {0xe2, 0x82}},
		EUCJP:   {{0xa4, 0xa2}, {0x8e, 0xb1}, {0x8f, 0xa1, 0xa1}, {0xa4, 0x27}},
		EUCKR:   {{0xb0, 0xa1}, {0xb0, 0x5c}},
		Latin1:  {{0xe9}, {0xff}},
		WIN1252: {{0x80}, {0x81}, {0x9d}},
	}
	for id := ID(0); id < numIDs; id++ {
		if id == SQLASCII {
			continue
		}
		codec, err := New(id.String(), "UTF8")
		if err != nil {
			t.Fatal(err)
		}
		inputs := crafted[id]
		for i := 0; i < 150; i++ {
			n := 1 + rng.IntN(8)
			b := make([]byte, n)
			for j := range b {
				if rng.IntN(2) == 0 {
					b[j] = special[rng.IntN(len(special))]
				} else {
					b[j] = byte(0x80 + rng.IntN(0x80))
				}
			}
			inputs = append(inputs, b)
		}
		agree, onlyPG, onlyUs := 0, 0, 0
		for _, b := range inputs {
			var pg string
			pgErr := conn.QueryRow(ctx, "SELECT convert_from($1, $2)", b, id.String()).Scan(&pg)
			us, usErr := codec.Decode(b)
			switch {
			case pgErr == nil && usErr == nil:
				agree++
				if got, want := skeleton(us), skeleton(pg); got != want {
					t.Errorf("%s %x: structure %q, PostgreSQL's %q", id, b, got, want)
				}
				if (codec.m == mapUTF8 || codec.m == mapSingle || codec.m == mapXText) && us != pg {
					t.Errorf("%s %x: decoded %q, PostgreSQL %q", id, b, us, pg)
				}
				enc, err := codec.Encode(us)
				if err != nil {
					t.Errorf("%s %x: Encode: %v", id, b, err)
					continue
				}
				if again, err := codec.Decode(enc); err != nil || again != us {
					t.Errorf("%s %x: Encode gave %x, which decodes to %q, %v", id, b, enc, again, err)
				}
			case pgErr == nil:
				onlyPG++ // refused by us only: fail closed (logged below)
			case usErr == nil:
				// Accepted by us only: harmless only if the server
				// refusing it leaves nothing for our reading to get wrong.
				onlyUs++
			default:
				agree++
				var e *Error
				if !errorAs(usErr, &e) || (e.Code != "22021" && e.Code != "22P05") {
					t.Errorf("%s %x: error %v, want 22021 or 22P05", id, b, usErr)
				}
			}
		}
		t.Logf("%-14s agree %3d, refused only by us %3d, accepted only by us %3d", id, agree, onlyPG, onlyUs)
		if onlyPG*10 > len(inputs) {
			t.Errorf("%s: refused %d of %d strings PostgreSQL accepts", id, onlyPG, len(inputs))
		}
	}
}

// skeleton keeps the ASCII characters and turns each run of other
// characters into one '~': what a parser's tokens depend on. (Runs, as
// the private-use mapping makes a character of every byte.)
func skeleton(s string) string {
	var b strings.Builder
	prevHigh := false
	for _, r := range s {
		if r < 0x80 {
			b.WriteRune(r)
			prevHigh = false
			continue
		}
		if !prevHigh {
			b.WriteByte('~')
		}
		prevHigh = true
	}
	return b.String()
}

func errorAs(err error, e **Error) bool {
	x, ok := err.(*Error)
	if ok {
		*e = x
	}
	return ok
}

func TestSQLASCII(t *testing.T) {
	utf, _ := New("SQL_ASCII", "UTF8")
	if _, err := utf.Decode([]byte{0xe9}); err == nil {
		t.Error("SQL_ASCII client, UTF8 database: 0xe9 accepted; PostgreSQL checks it as UTF8")
	}
	if s, err := utf.Decode([]byte("caf\xc3\xa9")); err != nil || s != "café" {
		t.Errorf("got %q, %v", s, err)
	}
	raw, _ := New("SQL_ASCII", "SQL_ASCII")
	s, err := raw.Decode([]byte("x\xe9\\'"))
	if err != nil {
		t.Fatal(err)
	}
	if b, err := raw.Encode(s); err != nil || string(b) != "x\xe9\\'" {
		t.Errorf("round trip: %x, %v", b, err)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(uint8(SJIS), []byte{0x95, 0x5c, 0x27})
	f.Add(uint8(BIG5), []byte{0xa1, 0x27})
	f.Add(uint8(UTF8), []byte("café"))
	f.Fuzz(func(t *testing.T, enc uint8, b []byte) {
		id := ID(enc % uint8(numIDs))
		c, err := New(id.String(), "UTF8")
		if err != nil {
			t.Fatal(err)
		}
		s, err := c.Decode(b)
		if err != nil {
			return
		}
		e, err := c.Encode(s)
		if err != nil {
			t.Fatalf("%s: Decode(%x) = %q, Encode: %v", id, b, s, err)
		}
		if again, err := c.Decode(e); err != nil || again != s {
			t.Fatalf("%s: %x → %q → %x → %q, %v", id, b, s, e, again, err)
		}
	})
}

// TestSameASCII: text whose ASCII bytes every client encoding reads as
// themselves, and text one of them reads otherwise (a trailing byte that
// is ASCII: a backslash, a quote's neighbour, GB18030's digits).
func TestSameASCII(t *testing.T) {
	for _, c := range []struct {
		b    string
		want bool
	}{
		{"SELECT 'a\\''; COMMIT", true},
		{"SELECT 'caf\xc3\xa9'", true},          // UTF-8 é: every pairing keeps the quote
		{"SELECT '\xe9'", true},                 // LATIN1 é: a lead byte before a quote is invalid where it would pair
		{"SELECT E'\xc3\x81\\'; COMMIT", false}, // SJIS: 0x81 0x5C is one character
		{"SELECT '\x95\\'", false},
		{"SELECT '\x81\x30\x81\x30'", false}, // GB18030: four bytes, two of them digits
		{"SELECT '\xa4\xa2'", true},          // EUC-JP あ: both bytes high
		{"SELECT '\xa4a'", false},            // BIG5/GBK/UHC: 0xA4 0x61 is one character
		{"SELECT '\xe2\x82\xac'", true},      // UTF-8 €: BIG5 pairs 0xAC with the quote, which its conversion refuses
	} {
		if got := SameASCII([]byte(c.b)); got != c.want {
			t.Errorf("SameASCII(%q) = %v, want %v", c.b, got, c.want)
		}
	}
}

// FuzzSameASCII: when SameASCII holds, every encoding that decodes the
// text reads exactly its ASCII bytes, in order, as its ASCII characters.
func FuzzSameASCII(f *testing.F) {
	f.Add([]byte("SELECT E'\xc3\x81\\'; COMMIT"))
	f.Add([]byte("SELECT 'caf\xc3\xa9'"))
	f.Add([]byte{0x81, 0x30, 0x81, 0x30, 0x27})
	f.Add([]byte{0xa4, 0x61, 0x5c})
	f.Fuzz(func(t *testing.T, b []byte) {
		if !SameASCII(b) {
			return
		}
		var want []byte
		for _, x := range b {
			if x < 0x80 {
				want = append(want, x)
			}
		}
		for id := ID(0); id < numIDs; id++ {
			c, err := New(id.String(), "UTF8")
			if err != nil {
				t.Fatal(err)
			}
			s, err := c.Decode(b)
			if err != nil {
				continue
			}
			var got []byte
			for i := 0; i < len(s); i++ {
				if s[i] < 0x80 {
					got = append(got, s[i])
				}
			}
			if string(got) != string(want) {
				t.Fatalf("%s reads %x with ASCII %q, want %q", id, b, got, want)
			}
		}
	})
}

// TestASCIITrails: only the encodings SameASCII checks let a multi-byte
// character take an ASCII byte in; in every other one, no character that
// starts with a byte above 0x7F has an ASCII byte after it.
func TestASCIITrails(t *testing.T) {
	for id := ID(0); id < numIDs; id++ {
		if slices.Contains(asciiTrails, id) {
			continue
		}
		for lead := 0x80; lead <= 0xff; lead++ {
			for _, x := range []byte{0x01, '\'', '\\', ';', '0', 'A', 0x7f} {
				for pos := 1; pos < 4; pos++ {
					b := []byte{byte(lead), 0xa1, 0xa1, 0xa1}
					b[pos] = x
					if n := verify(id, b); n > pos {
						t.Errorf("%s: %x is a character of %d bytes with the ASCII byte %#x in it", id, b[:n], n, x)
					}
				}
			}
		}
	}
}
