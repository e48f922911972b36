package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testbin"
)

// devSection is one step of the walkthrough pgfence dev prints: its comment
// ("# A: alice takes the lease ...") and the shell lines under it, exactly as
// printed (minus the two-space indent).
type devSection struct {
	header string
	script string
}

// devWalk is what the test learns from pgfence dev's stdout.
type devWalk struct {
	primary, replica, entry string
	console                 string // the printed psql line for the admin console
	sections                []devSection
}

// devSteps are the walkthrough's steps in order: the terminal each runs in
// (A is alice, B is bob; the others run in a fresh shell) and the start of
// the comment the template prints for it. The test fails if the template's
// steps change, so the assertions below stay about the lines a newcomer
// actually reads.
var devSteps = []struct {
	term, header string
}{
	{"A", "# A: alice takes the lease"},
	{"B", "# B, once alice's"},
	{"A", "# A: alice wakes up"},
	{"B", "# B: bob lost the answer"},
	{"B", "# B: the same token with different content"},
	{"anyone", "# anyone:"},
	{"state", "# the state"},
}

// TestDevWalkthrough builds the pgfence binary, starts `pgfence dev`, runs the
// printed walkthrough in bash as a newcomer would (terminal A for alice,
// terminal B for bob, each keeping its own epoch/token/PGOPTIONS), checks
// every outcome the walkthrough promises, then presses Ctrl-C and checks that
// no server process, listening port or temp directory is left behind.
func TestDevWalkthrough(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and starts a cluster")
	}
	for _, tool := range []string{"bash", "psql"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found: %v", tool, err)
		}
	}
	dir := t.TempDir()
	bin := testbin.Pgfence(t)

	before := pgtestDirs(t)

	// Start pgfence dev in a process group of its own, so that SIGINT to
	// the group is what Ctrl-C in its terminal would send.
	pr, pw := io.Pipe()
	var stderr bytes.Buffer
	dev := exec.Command(bin, "dev", "--listen", "127.0.0.1:0")
	dev.Env = cleanEnv(nil)
	dev.Stdout = pw
	dev.Stderr = &stderr
	dev.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{}) // closed once dev.Wait returned waitErr
	var waitErr error
	go func() {
		waitErr = dev.Wait()
		pw.Close()
		close(exited)
	}()
	stopReading := make(chan struct{})
	var stopOnce sync.Once
	t.Cleanup(func() {
		stopOnce.Do(func() { close(stopReading) })
		select {
		case <-exited:
		default:
			// The test failed with pgfence dev running: kill it; its
			// pgtest reaper stops the servers and removes the files.
			syscall.Kill(-dev.Process.Pid, syscall.SIGKILL)
			<-exited
		}
	})
	// The reader never blocks on the test: once the test stops listening
	// (it failed, or it is done), the rest of the output is discarded, so
	// the pipe never stalls pgfence dev or dev.Wait.
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-stopReading:
				io.Copy(io.Discard, pr)
				return
			}
		}
		io.Copy(io.Discard, pr)
	}()

	walk, printed := readWalkthrough(t, lines, &stderr)
	t.Logf("pgfence dev printed:\n%s", printed)
	if walk.primary == "" || walk.entry == "" || walk.replica == "" {
		t.Fatalf("DSNs not found (primary %q, replica %q, pgfence %q)", walk.primary, walk.replica, walk.entry)
	}
	ports := map[string]string{"primary": hostPort(t, walk.primary), "replica": hostPort(t, walk.replica), "pgfence": hostPort(t, walk.entry)}
	root := ownedPgtestDir(t, before, ports["primary"])
	if n := processesMentioning(t, root); len(n) == 0 {
		t.Fatalf("no process mentions the cluster directory %s while pgfence dev runs", root)
	}

	// The terminals: each step's lines run in a new bash that first loads
	// what its terminal's earlier steps left in the shell (eval of the lease
	// output, export PGOPTIONS) and saves it afterwards. No psqlrc is read
	// (HOME is the test's directory): the printed lines themselves must
	// make psql show the SQLSTATEs the walkthrough promises. They are run
	// unchanged.
	termEnv := cleanEnv([]string{"HOME=" + dir})
	term := func(name, script string) string {
		t.Helper()
		state := filepath.Join(dir, "terminal-"+name+".sh")
		full := fmt.Sprintf("if [ -f %[1]q ]; then . %[1]q; fi\n%[2]s\ndeclare -p job_key holder epoch token expires_at PGOPTIONS >%[1]q 2>/dev/null\ntrue\n", state, script)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", "-c", full)
		cmd.Dir = dir
		cmd.Env = termEnv
		out, err := cmd.CombinedOutput()
		t.Logf("terminal %s:\n%s\n--- output:\n%s", name, script, out)
		if err != nil {
			t.Fatalf("terminal %s: bash: %v", name, err)
		}
		return string(out)
	}
	termVar := func(name, v string) string {
		t.Helper()
		state := filepath.Join(dir, "terminal-"+name+".sh")
		out, err := exec.Command("bash", "-c", fmt.Sprintf(". %q; printf %%s \"$%s\"", state, v)).Output()
		if err != nil {
			t.Fatalf("terminal %s: read $%s: %v", name, v, err)
		}
		return string(out)
	}
	psqlPrimary := func(sql string) string {
		t.Helper()
		cmd := exec.Command("psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", walk.primary, "-c", sql)
		cmd.Env = cleanEnv(nil)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("psql %q: %v\n%s", sql, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	mustContain := func(step int, out string, want ...string) {
		t.Helper()
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("step %q: output lacks %q:\n%s", devSteps[step].header, w, out)
			}
		}
	}
	mustNotContain := func(step int, out string, bad ...string) {
		t.Helper()
		for _, b := range bad {
			if strings.Contains(out, b) {
				t.Errorf("step %q: output has %q:\n%s", devSteps[step].header, b, out)
			}
		}
	}

	s := walk.sections

	// A: alice takes the lease and stalls.
	term("A", s[0].script)
	aliceToken, aliceEpoch := termVar("A", "token"), termVar("A", "epoch")
	job := termVar("A", "job_key")
	if _, err := strconv.ParseInt(aliceToken, 10, 64); err != nil {
		t.Fatalf("alice has no token after %q: token=%q", s[0].header, aliceToken)
	}
	if opts := termVar("A", "PGOPTIONS"); !strings.Contains(opts, "fence.token="+aliceToken) || !strings.Contains(opts, "fence.epoch="+aliceEpoch) {
		t.Fatalf("alice's PGOPTIONS %q does not carry her epoch %s and token %s", opts, aliceEpoch, aliceToken)
	}

	// Alice's 10 s pass: end her lease now rather than wait for it.
	if got := psqlPrimary(fmt.Sprintf("UPDATE fence.leases SET expires_at = now() - interval '1s' WHERE job_key = '%s' AND holder = 'alice'", job)); got != "UPDATE 1" {
		t.Fatalf("expire alice's lease: %q", got)
	}

	// B: bob takes over and writes.
	out := term("B", s[1].script)
	bobToken := termVar("B", "token")
	bt, err := strconv.ParseInt(bobToken, 10, 64)
	if at, _ := strconv.ParseInt(aliceToken, 10, 64); err != nil || bt <= at {
		t.Fatalf("bob's token %q is not larger than alice's %s", bobToken, aliceToken)
	}
	mustContain(1, out, "INSERT 0 1")
	mustNotContain(1, out, "ERROR")

	// A: alice's late write is refused as stale.
	out = term("A", s[2].script)
	mustContain(2, out, "ERROR:  FN001")
	mustNotContain(2, out, "INSERT 0")
	if got := termVar("A", "token"); got != aliceToken {
		t.Errorf("terminal A lost alice's token: %q, want %s", got, aliceToken)
	}

	// B: bob's retry is an idempotent replay.
	out = term("B", s[3].script)
	mustContain(3, out, "NOTICE:", "idempotent replay")
	mustNotContain(3, out, "ERROR")

	// B: same token, different content: FN003.
	out = term("B", s[4].script)
	mustContain(4, out, "ERROR:  FN003")

	// anyone: no token: FN008.
	out = term("anyone", s[5].script)
	mustContain(5, out, "ERROR:  FN008")

	// The state: bob's result stands.
	out = term("state", s[6].script)
	mustContain(6, out, "from bob", "max_issued_token", "committed_at")
	mustNotContain(6, out, "ERROR", "from alice", "something else")
	if got, want := psqlPrimary(fmt.Sprintf("SELECT payload, token FROM results WHERE job_key = '%s'", job)), "from bob|"+bobToken; got != want {
		t.Errorf("results row: %q, want %q", got, want)
	}
	if got := psqlPrimary("SELECT count(*) FROM results"); got != "1" {
		t.Errorf("results has %s rows, want 1", got)
	}

	// The admin console answers, as pgfence serve's does.
	if walk.console == "" {
		t.Error("pgfence dev printed no console line")
	} else if out := term("console", walk.console); !strings.Contains(out, "SHOW") {
		t.Errorf("console line %q: got\n%s\nwant the console's help", walk.console, out)
	}

	// Ctrl-C.
	if err := syscall.Kill(-dev.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	var rest []string
	timeout := time.After(2 * time.Minute)
	for lines != nil {
		select {
		case l, ok := <-lines:
			if !ok {
				lines = nil
				break
			}
			rest = append(rest, l)
		case <-timeout:
			t.Fatalf("pgfence dev did not exit within 2 minutes of SIGINT; printed:\n%s\nstderr:\n%s", strings.Join(rest, "\n"), stderr.String())
		}
	}
	<-exited
	if waitErr != nil {
		t.Errorf("pgfence dev exited with %v; stderr:\n%s", waitErr, stderr.String())
	}
	if tail := strings.Join(rest, "\n"); !strings.Contains(tail, "pgfence dev: done") {
		t.Errorf("pgfence dev did not report it was done after SIGINT:\n%s", tail)
	}
	// The proxy logged as pgfence serve does: JSON, as stderr is no terminal.
	if logs := stderr.String(); !strings.Contains(logs, `"msg":"listening"`) || !strings.Contains(logs, `"msg":"session open"`) {
		t.Errorf("pgfence dev's proxy did not log its listener and sessions; stderr:\n%s", logs)
	}

	// Nothing left behind.
	if procs := processesMentioning(t, root); len(procs) > 0 {
		t.Errorf("processes still mention %s after pgfence dev exited:\n%s", root, strings.Join(procs, "\n"))
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("cluster directory %s still exists (stat: %v)", root, err)
	}
	for name, addr := range ports {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			t.Errorf("%s address %s still accepts connections after pgfence dev exited", name, addr)
		}
	}
	if pgtestDirs(t)[root] {
		t.Errorf("%s is still listed in %s", root, os.TempDir())
	}
}

// readWalkthrough reads pgfence dev's stdout until the last step of the
// walkthrough is printed, and returns it parsed along with the text.
func readWalkthrough(t *testing.T, lines <-chan string, stderr *bytes.Buffer) (devWalk, string) {
	t.Helper()
	var w devWalk
	var text strings.Builder
	var cur *devSection
	var q shellQuote
	timeout := time.After(3 * time.Minute)
	for {
		if len(w.sections) == len(devSteps) && cur != nil && cur.script != "" && q.closed() {
			break
		}
		var line string
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("pgfence dev exited before printing the walkthrough:\n%s\nstderr:\n%s", text.String(), stderr.String())
			}
			line = l
		case <-timeout:
			t.Fatalf("no complete walkthrough within 3 minutes:\n%s\nstderr:\n%s", text.String(), stderr.String())
		}
		text.WriteString(line + "\n")
		trimmed := strings.TrimSpace(line)
		switch {
		case cur != nil && !q.closed():
			// Inside a quoted string: part of the current command.
			cur.script += "\n" + strings.TrimPrefix(line, "  ")
			q.feed(line)
		case cur == nil && strings.HasPrefix(line, "  console:"):
			w.console = strings.TrimSpace(strings.TrimPrefix(line, "  console:"))
		case strings.HasPrefix(line, "  primary:"), strings.HasPrefix(line, "  replica:"), strings.HasPrefix(line, "  pgfence:"):
			f := strings.Fields(line)
			if len(f) < 2 {
				t.Fatalf("bad DSN line %q", line)
			}
			switch f[0] {
			case "primary:":
				w.primary = f[1]
			case "replica:":
				w.replica = f[1]
			case "pgfence:":
				w.entry = f[1]
			}
		case strings.HasPrefix(line, "  #"):
			if cur != nil && cur.script == "" {
				cur.header += "\n" + trimmed // a comment of more than one line
				break
			}
			n := len(w.sections)
			if n == len(devSteps) {
				t.Fatalf("the walkthrough has more steps than the test knows (%d); the new one: %q", n, trimmed)
			}
			if !strings.HasPrefix(trimmed, devSteps[n].header) {
				t.Fatalf("walkthrough step %d is %q, the test expects %q: keep TestDevWalkthrough in sync with devWalkthrough", n+1, trimmed, devSteps[n].header)
			}
			w.sections = append(w.sections, devSection{header: trimmed})
			cur = &w.sections[n]
		case cur != nil && strings.HasPrefix(line, "  ") && trimmed != "":
			if cur.script != "" {
				cur.script += "\n"
			}
			cur.script += strings.TrimPrefix(line, "  ")
			q.feed(line)
		}
	}
	return w, text.String()
}

// shellQuote tracks whether shell text fed line by line leaves a quoted
// string open, so a multi-line psql -c "..." is read whole.
type shellQuote struct {
	single, double bool
}

func (q *shellQuote) closed() bool { return !q.single && !q.double }

func (q *shellQuote) feed(line string) {
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case q.single:
			if c == '\'' {
				q.single = false
			}
		case c == '\\':
			i++
		case q.double:
			if c == '"' {
				q.double = false
			}
		case c == '\'':
			q.single = true
		case c == '"':
			q.double = true
		}
	}
}

func hostPort(t *testing.T, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Port() == "" {
		t.Fatalf("DSN %q: no host:port (%v)", dsn, err)
	}
	return u.Host
}

// pgtestDirs lists the pgtest cluster directories in the temp directory.
func pgtestDirs(t *testing.T) map[string]bool {
	t.Helper()
	ents, err := os.ReadDir(os.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{}
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), "pgfence-pgtest-") {
			dirs[filepath.Join(os.TempDir(), e.Name())] = true
		}
	}
	return dirs
}

// ownedPgtestDir finds, among the pgtest directories created since before,
// the one whose primary serves addr (the port in its postmaster.pid).
func ownedPgtestDir(t *testing.T, before map[string]bool, addr string) string {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	var found []string
	for d := range pgtestDirs(t) {
		if before[d] {
			continue
		}
		b, err := os.ReadFile(filepath.Join(d, "primary", "postmaster.pid"))
		if err != nil {
			continue
		}
		if l := strings.Split(string(b), "\n"); len(l) > 3 && strings.TrimSpace(l[3]) == port {
			found = append(found, d)
		}
	}
	if len(found) != 1 {
		t.Fatalf("want one new pgfence-pgtest-* directory serving port %s, found %v", port, found)
	}
	return found[0]
}

// processesMentioning lists the processes whose command line contains s
// (postgres -D <dir>/primary, the pgtest reaper).
func processesMentioning(t *testing.T, s string) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	var procs []string
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cmdline := string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
		if strings.Contains(cmdline, s) {
			procs = append(procs, e.Name()+": "+cmdline)
		}
	}
	return procs
}

// A busy port is reported before anything starts, naming the address and
// how to pick another, by pgfence dev and by make dev's script (which
// checks before the build).
func TestDevPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	next := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port + 1)
	before := pgtestDirs(t)
	code, stdout, stderr := pgfenceExit(t, nil, "dev", "--listen", addr)
	if code != exitUnavailable || stdout != "" {
		t.Errorf("pgfence dev on a busy port: exit %d, stdout %q; want %d and nothing", code, stdout, exitUnavailable)
	}
	for _, want := range []string{addr + ": the address is in use", "--listen 127.0.0.1:" + next, "make dev PORT=" + next} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr)
		}
	}
	for d := range pgtestDirs(t) {
		if !before[d] {
			t.Errorf("a cluster was started (%s) although the port was busy", d)
		}
	}

	cmd := exec.Command("./scripts/dev.sh", port)
	cmd.Dir = filepath.Join("..", "..")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitUnavailable {
		t.Fatalf("scripts/dev.sh %s: %v, want exit %d\n%s", port, err, exitUnavailable, out)
	}
	for _, want := range []string{"port " + port + " on 127.0.0.1 is in use", "make dev PORT=" + next} {
		if !strings.Contains(string(out), want) {
			t.Errorf("scripts/dev.sh output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "building") {
		t.Errorf("scripts/dev.sh built before finding the port busy:\n%s", out)
	}
}
