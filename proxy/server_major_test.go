package proxy

import "testing"

func TestServerMajor(t *testing.T) {
	for v, want := range map[string]int{
		"15.18 (Debian 15.18-0+deb12u1)": 15, "17.2": 17, "16beta1": 16, "9.6.24": 9, "": 0, "x": 0, "99999999999": 0,
	} {
		if got := serverMajor(v); got != want {
			t.Errorf("serverMajor(%q) = %d, want %d", v, got, want)
		}
	}
}
