package proxy

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

// FuzzStartup: parseStartup never panics, and a session startup it accepts
// re-encodes to one that parses to the same parameters. Corpus:
// proxy/testdata/fuzz/FuzzStartup.
func FuzzStartup(f *testing.F) {
	f.Add(startupBytes(3<<16, "user", "u", "database", "d")[4:])
	f.Add(startupBytes(3<<16|2, "user", "u", "_pq_.x", "y", "options", "-c fence.token=1")[4:])
	f.Add([]byte{0x04, 0xd2, 0x16, 0x2f})
	f.Add([]byte{0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 1, 0, 0, 0, 2})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parseStartup(b)
		if err != nil {
			var pe *ProtocolError
			if !errors.As(err, &pe) || len(pe.Code) != 5 {
				t.Fatalf("error %v is not a ProtocolError with a SQLSTATE", err)
			}
			return
		}
		if st.kind != startupSession {
			return
		}
		if st.params["user"] == "" || st.params["database"] == "" {
			t.Fatalf("accepted startup without user/database: %v", st.params)
		}
		var kv []string
		for _, k := range st.order {
			if strings.ContainsRune(k, 0) || strings.ContainsRune(st.params[k], 0) {
				t.Fatalf("NUL inside parameter %q", k)
			}
			kv = append(kv, k, st.params[k])
		}
		again, err := parseStartup(startupBytes(st.version, kv...)[4:])
		if err != nil || !reflect.DeepEqual(again.params, st.params) {
			t.Fatalf("re-encoded startup: %v, params %v, want %v", err, again, st.params)
		}
	})
}
