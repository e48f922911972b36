package hatest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// haCluster is one etcd, two PostgreSQL nodes under Patroni and the test's
// replication links between them, all on 127.0.0.1, in a directory of its
// own. Ports are base+0.. base+11, inside 61000-61099.
type haCluster struct {
	t     *testing.T
	root  string
	cred  *syscall.Credential
	base  int
	sync  bool
	nodes [2]*haNode
	etcd  *exec.Cmd
}

// haNode is a Patroni member. Its PostgreSQL listens on pgPort; the other
// member streams from it through link (connect_address points there), which
// the test can cut as a network partition would.
type haNode struct {
	name    string
	dataDir string
	conf    string
	log     string
	pgPort  int
	apiPort int
	link    *link
	patroni *exec.Cmd
}

func (c *haCluster) port(i int) int { return c.base + i }

func startHA(t *testing.T, base int, syncMode bool) *haCluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := &haCluster{t: t, base: base, sync: syncMode}
	var err error
	if c.cred, err = serverCredential(); err != nil {
		t.Fatal(err)
	}
	c.root, err = os.MkdirTemp("", "pgfence-ha-")
	if err != nil {
		t.Fatal(err)
	}
	c.chown(c.root)
	t.Cleanup(c.close)

	// etcd
	etcdDir := filepath.Join(c.root, "etcd")
	client := fmt.Sprintf("http://127.0.0.1:%d", c.port(0))
	peer := fmt.Sprintf("http://127.0.0.1:%d", c.port(1))
	c.etcd = c.start("etcd", filepath.Join(c.root, "etcd.log"), "etcd", "--name", "e0", "--data-dir", etcdDir,
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "e0="+peer, "--initial-cluster-state", "new")
	c.poll(ctx, "etcd healthy", func() bool { return httpStatus(client+"/health") == 200 })

	bin, err := pgtest.FindBinDir()
	if err != nil {
		t.Fatal(err)
	}
	for i := range c.nodes {
		n := &haNode{
			name:    fmt.Sprintf("node%d", i),
			pgPort:  c.port(2 + i),
			apiPort: c.port(6 + i),
		}
		dir := filepath.Join(c.root, n.name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		c.chown(dir)
		n.dataDir = filepath.Join(dir, "data")
		n.conf = filepath.Join(dir, "patroni.yml")
		n.log = filepath.Join(c.root, n.name+".log")
		if n.link, err = newLink(fmt.Sprintf("127.0.0.1:%d", c.port(4+i)), fmt.Sprintf("127.0.0.1:%d", n.pgPort)); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(n.conf, []byte(patroniConfig(n, dir, bin, c.port(0), syncMode)), 0o600); err != nil {
			t.Fatal(err)
		}
		c.chown(n.conf)
		c.nodes[i] = n
	}
	// node0 first, so that it bootstraps the cluster and leads.
	c.startNode(c.nodes[0])
	c.poll(ctx, "node0 leads", func() bool { return c.api(c.nodes[0], "/primary") == 200 })
	c.startNode(c.nodes[1])
	c.poll(ctx, "node1 streams from node0", func() bool {
		if c.api(c.nodes[1], "/replica") != 200 {
			return false
		}
		q := "select count(*) = 1 from pg_stat_replication where state = 'streaming'"
		if syncMode {
			q = "select count(*) = 1 from pg_stat_replication where state = 'streaming' and sync_state = 'sync'"
		}
		var ok bool
		err := c.query(ctx, c.nodes[0].pgPort, "postgres", q, &ok)
		return err == nil && ok
	})
	return c
}

func patroniConfig(n *haNode, dir, bin string, etcdPort int, syncMode bool) string {
	return fmt.Sprintf(`scope: pgfence-ha
name: %[1]s
log:
  level: INFO
restapi:
  listen: 127.0.0.1:%[2]d
  connect_address: 127.0.0.1:%[2]d
etcd3:
  hosts: 127.0.0.1:%[3]d
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 3
    maximum_lag_on_failover: 1048576
    synchronous_mode: %[4]v
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: false
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 128MB
        track_commit_timestamp: "on"
        max_connections: 100
        fsync: "off"
        full_page_writes: "off"
        wal_receiver_status_interval: 1s
  initdb:
  - encoding: UTF8
  - locale: C
postgresql:
  listen: 127.0.0.1:%[5]d
  connect_address: %[6]s
  data_dir: %[7]s
  bin_dir: %[8]s
  pgpass: %[9]s/pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
  pg_hba:
  - local all all trust
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
  parameters:
    unix_socket_directories: '%[9]s'
    shared_buffers: 32MB
    log_min_messages: warning
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
  nosync: false
`, n.name, n.apiPort, etcdPort, syncMode, n.pgPort, n.link.addr, n.dataDir, bin, dir)
}

// start starts prog as the server user in a process group of its own,
// killed with the test process, its output appended to logPath.
func (c *haCluster) start(name, logPath, prog string, args ...string) *exec.Cmd {
	c.t.Helper()
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command(prog, args...)
	cmd.Dir = c.root
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "LANG=C.UTF-8", "HOME="+c.root)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c.cred, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s (%s): %v", name, prog, err)
	}
	go func() { cmd.Wait(); f.Close() }()
	return cmd
}

func (c *haCluster) startNode(n *haNode) {
	n.patroni = c.start(n.name, n.log, "patroni", n.conf)
}

// killNode is the nemesis: the node dies as a machine does, Patroni and
// PostgreSQL at once (SIGKILL), so nothing is shut down cleanly and the
// leader key is left to expire.
func (c *haCluster) killNode(n *haNode) {
	c.t.Helper()
	if n.patroni != nil {
		syscall.Kill(-n.patroni.Process.Pid, syscall.SIGKILL)
	}
	if pid := postmasterPID(n.dataDir); pid > 0 {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			c.t.Fatalf("kill postmaster of %s: %v", n.name, err)
		}
	} else {
		c.t.Fatalf("no postmaster.pid in %s", n.dataDir)
	}
}

func postmasterPID(dataDir string) int {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	return pid
}

func (c *haCluster) close() {
	for _, n := range c.nodes {
		if n == nil {
			continue
		}
		if n.patroni != nil {
			syscall.Kill(-n.patroni.Process.Pid, syscall.SIGKILL)
		}
		if pid := postmasterPID(n.dataDir); pid > 0 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if n.link != nil {
			n.link.close()
		}
	}
	if c.etcd != nil {
		syscall.Kill(-c.etcd.Process.Pid, syscall.SIGKILL)
	}
	if c.t.Failed() || os.Getenv("PGFENCE_HA_KEEP") != "" {
		c.t.Logf("logs kept in %s", c.root)
		for _, n := range c.nodes {
			if n != nil {
				c.t.Logf("%s (patroni) log tail:\n%s", n.name, tail(n.log, 40))
			}
		}
		return
	}
	os.RemoveAll(c.root)
}

func (c *haCluster) chown(path string) {
	if c.cred != nil {
		if err := os.Chown(path, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			c.t.Fatal(err)
		}
	}
}

// api is the status of GET path on n's Patroni REST API (0: unreachable).
func (c *haCluster) api(n *haNode, path string) int {
	return httpStatus(fmt.Sprintf("http://127.0.0.1:%d%s", n.apiPort, path))
}

// patronictl runs patronictl list with n's configuration and returns its
// output (for the log: the members, their roles, timelines and lag).
func (c *haCluster) patronictl(n *haNode) string {
	cmd := exec.Command("patronictl", "-c", n.conf, "list")
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "LANG=C.UTF-8")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Sprintf("patronictl list: %v\n%s", err, out)
	}
	return string(out)
}

func httpStatus(url string) int {
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get(url)
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// poll calls cond every 100 ms until it holds, failing the test when ctx
// ends first.
func (c *haCluster) poll(ctx context.Context, what string, cond func() bool) {
	c.t.Helper()
	start := time.Now()
	err := pgtest.PollEvery(ctx, 100*time.Millisecond, func() (bool, error) { return cond(), nil })
	if err != nil {
		c.t.Fatalf("waiting for %s: %v (after %v)", what, err, time.Since(start).Round(time.Millisecond))
	}
	c.t.Logf("%s (%v)", what, time.Since(start).Round(time.Millisecond))
}

// dsn is a DSN of database db on the PostgreSQL at port as user.
func dsn(port int, user, db string) string {
	return fmt.Sprintf("host=127.0.0.1 port=%d user=%s dbname=%s sslmode=disable connect_timeout=5", port, user, db)
}

// query runs a one-row query as postgres on the server at port.
func (c *haCluster) query(ctx context.Context, port int, db, q string, dst ...any) error {
	conn, err := pgx.Connect(ctx, dsn(port, "postgres", db))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, q).Scan(dst...)
}

func serverCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	name := os.Getenv("PGFENCE_PG_USER")
	if name == "" {
		name = "postgres"
	}
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("running as root, Patroni and PostgreSQL must run as an unprivileged user, but user %q was not found (create it, or set PGFENCE_PG_USER): %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func tail(path string, lines int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	l := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return string(bytes.Join(l, []byte("\n")))
}

// link is the network between one node's PostgreSQL and the member that
// streams from it: a TCP relay the test can cut (every connection closed,
// new ones refused), as a partition would.
type link struct {
	addr   string
	target string
	ln     net.Listener
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	cut    bool
}

func newLink(addr, target string) (*link, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	l := &link{addr: addr, target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	go l.serve()
	return l, nil
}

func (l *link) serve() {
	for {
		c, err := l.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", l.target)
		if err != nil {
			c.Close()
			continue
		}
		l.mu.Lock()
		if l.cut {
			l.mu.Unlock()
			c.Close()
			u.Close()
			continue
		}
		l.conns[c], l.conns[u] = struct{}{}, struct{}{}
		l.mu.Unlock()
		go func() { io.Copy(u, c); u.Close(); c.Close() }()
		go func() { io.Copy(c, u); u.Close(); c.Close() }()
	}
}

// Cut closes every connection through the link and refuses new ones.
func (l *link) Cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cut = true
	l.ln.Close()
	for c := range l.conns {
		c.Close()
	}
}

func (l *link) close() { l.Cut() }
