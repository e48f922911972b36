package proxy

import (
	"sort"
	"sync"
	"testing"
)

// TestBypass is the adversarial suite: every attempt to get around the
// fence, grouped by class (TestBypass/<class>/<case>). Each class lives in
// a file of its own (bypass_<class>_test.go) and registers itself from an
// init function with registerBypass; each case runs its attempt directly
// against PostgreSQL and, where that makes sense, through the proxy, and
// asserts the exact SQLSTATE and, on a separate connection, that nothing
// it must not change changed.
func TestBypass(t *testing.T) {
	bypassMu.Lock()
	names := make([]string, 0, len(bypassClasses))
	for name := range bypassClasses {
		names = append(names, name)
	}
	bypassMu.Unlock()
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, bypassClasses[name])
	}
}

var (
	bypassMu      sync.Mutex
	bypassClasses = map[string]func(t *testing.T){}
)

// registerBypass adds a class of attempts to TestBypass. Call it from an
// init function; a class name may be registered once.
func registerBypass(class string, run func(t *testing.T)) {
	bypassMu.Lock()
	defer bypassMu.Unlock()
	if _, dup := bypassClasses[class]; dup {
		panic("bypass class registered twice: " + class)
	}
	bypassClasses[class] = run
}
