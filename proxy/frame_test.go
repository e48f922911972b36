package proxy

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
)

func TestParseStartup(t *testing.T) {
	body := func(b []byte) []byte { return b[4:] }
	st, err := parseStartup(body(startupBytes(3<<16, "user", "alice", "options", "-c fence.token=18", "_pq_.x", "1", "application_name", "w")))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"user": "alice", "database": "alice", "options": "-c fence.token=18", "application_name": "w"}
	if !reflect.DeepEqual(st.params, want) {
		t.Errorf("params %v, want %v", st.params, want)
	}
	if !reflect.DeepEqual(st.unknown, []string{"_pq_.x"}) || !st.needsNegotiation() {
		t.Errorf("unknown %v, want [_pq_.x] and negotiation", st.unknown)
	}
	cancel := []byte{0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 7, 1, 2, 3, 4}
	st, err = parseStartup(cancel)
	if err != nil || st.kind != startupCancel || st.cancelPID != 7 || !bytes.Equal(st.cancelSecret, []byte{1, 2, 3, 4}) {
		t.Errorf("cancel: got %+v %v", st, err)
	}
	for _, bad := range [][]byte{nil, {0, 3}, {0, 3, 0, 0}, {0, 3, 0, 0, 'u', 0}, {0x04, 0xd2, 0x16, 0x2f, 0}, {0x04, 0xd2, 0x16, 0x2e, 0, 0}} {
		if _, err := parseStartup(bad); err == nil {
			t.Errorf("parseStartup(%q) succeeded, want an error", bad)
		}
	}
}

func TestUsersFile(t *testing.T) {
	v, err := MakeVerifier("alice", "secret")
	if err != nil {
		t.Fatal(err)
	}
	line := QuoteUserLine(`al"ice`, v)
	users, err := parseUsers(strings.NewReader("; comment\n\n# another\n"+line+"\n"), "users.txt")
	if err != nil {
		t.Fatal(err)
	}
	if users[`al"ice`] != v {
		t.Fatalf("got %v, want al\"ice → %s", users, v)
	}
	if _, err := parseUsers(strings.NewReader(`"bob" "md5abc"`), "users.txt"); err == nil || !strings.Contains(err.Error(), "users.txt:1") {
		t.Fatalf("md5 verifier: got %v, want an error naming users.txt:1", err)
	}
	if _, err := parseUsers(strings.NewReader(`"bob`), "users.txt"); err == nil {
		t.Fatal("unterminated quote accepted")
	}
}
