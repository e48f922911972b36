// Package pgtest starts throwaway PostgreSQL clusters from local binaries:
// a primary and, optionally, a streaming replica, for tests and for
// `pgfence dev`, with the few helpers the packages' tests share around
// them (NewDatabaseWith, Node.MustConnect, Cluster.Client, Poll,
// WaitLockWait, Blocked, SQLState).
//
// It is not a general PostgreSQL manager: clusters live in a temporary
// directory, run with fsync off, trust every local connection, and are
// removed when closed. Server processes are started in their own process
// group with a parent-death signal, and a small reaper process removes the
// data directories if the owning process dies without closing the cluster
// (a panicking test, kill -9), so nothing is left behind.
//
// When the calling process runs as root, initdb and postgres (which refuse
// root) run as an unprivileged user: PGFENCE_PG_USER, else "postgres".
package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Options configure a cluster. The zero value starts a primary only.
type Options struct {
	// Replica adds a streaming replica (pg_basebackup -R, hot_standby=on).
	Replica bool
	// HBA lines are placed before the default rules (trust for every
	// local TCP connection, including replication), so a test can demand
	// SCRAM for a particular role.
	HBA []string
	// Settings are extra postgresql.conf settings for every node.
	Settings map[string]string
	// StartTimeout bounds how long a node may take to accept connections.
	// Zero means 60 seconds.
	StartTimeout time.Duration
	// Port is the port of a node AddStandby makes (zero: a free one), so
	// that a test can name a replica before it exists.
	Port int
}

// Cluster is a running primary with an optional replica.
type Cluster struct {
	BinDir  string
	Primary *Node
	Replica *Node // nil unless Options.Replica

	root      string
	cred      *syscall.Credential
	reaper    *exec.Cmd
	reaperIn  io.WriteCloser
	closeOnce sync.Once
	closeErr  error

	mu       sync.Mutex
	template string
	dbSeq    int
	replicas int     // replicas made by AddReplica and AddStandby
	extra    []*Node // nodes made by AddStandby and AddNode: Close stops them
}

// Node is one PostgreSQL server of a cluster.
type Node struct {
	Name    string // "primary" or "replica"
	Host    string // always 127.0.0.1
	Port    int
	DataDir string
	LogPath string

	c       *Cluster
	timeout time.Duration
	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
}

// Start creates and starts a cluster. The caller must Close it.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	bin, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 60 * time.Second
	}
	opts.Port = 0 // AddStandby's
	c := &Cluster{BinDir: bin}
	if c.cred, err = serverCredential(); err != nil {
		return nil, err
	}
	c.root, err = os.MkdirTemp("", "pgfence-pgtest-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	if c.cred != nil {
		if err := os.Chown(c.root, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			os.RemoveAll(c.root)
			return nil, fmt.Errorf("chown temp dir: %w", err)
		}
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if err := c.startReaper(); err != nil {
		return nil, err
	}

	p, err := c.newNode(ctx, "primary", opts, "initdb", "-U", "postgres", "--auth=trust", "--no-sync",
		"--no-instructions", "-E", "UTF8", "--locale=C")
	if err != nil {
		return nil, err
	}
	hba := append(append([]string{}, opts.HBA...),
		"host all all 127.0.0.1/32 trust",
		"host replication all 127.0.0.1/32 trust",
	)
	if err := os.WriteFile(filepath.Join(p.DataDir, "pg_hba.conf"), []byte(strings.Join(hba, "\n")+"\n"), 0o600); err != nil {
		return nil, fmt.Errorf("write pg_hba.conf: %w", err)
	}
	if err := c.chown(filepath.Join(p.DataDir, "pg_hba.conf")); err != nil {
		return nil, err
	}
	c.Primary = p
	if err := p.Start(ctx); err != nil {
		return nil, err
	}

	if opts.Replica {
		var r *Node
		r, err = c.newNode(ctx, "replica", opts, "pg_basebackup", "-h", p.Host, "-p", strconv.Itoa(p.Port),
			"-U", "postgres", "-R", "-X", "stream", "-c", "fast", "--no-sync")
		if err != nil {
			return nil, err
		}
		c.Replica = r
		if err := r.Start(ctx); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// newNode makes the data directory of node name with prog (initdb, or
// pg_basebackup from the primary) and args, on a free port, with the base
// settings and opts.Settings. It does not start it.
func (c *Cluster) newNode(ctx context.Context, name string, opts Options, prog string, args ...string) (*Node, error) {
	n := &Node{Name: name, Host: "127.0.0.1", DataDir: filepath.Join(c.root, name), c: c, timeout: opts.StartTimeout}
	n.LogPath = filepath.Join(c.root, name+".log")
	var err error
	if n.Port = opts.Port; n.Port == 0 {
		if n.Port, err = freePort(); err != nil {
			return nil, err
		}
	}
	if err := c.run(ctx, prog, append([]string{"-D", n.DataDir}, args...)...); err != nil {
		return nil, err
	}
	conf := baseSettings(n.Port)
	for k, v := range opts.Settings {
		conf[k] = v
	}
	if err := appendConf(n.DataDir, conf); err != nil {
		return nil, err
	}
	return n, nil
}

func baseSettings(port int) map[string]string {
	return map[string]string{
		"listen_addresses":             "'127.0.0.1'",
		"port":                         strconv.Itoa(port),
		"unix_socket_directories":      "''",
		"fsync":                        "off",
		"full_page_writes":             "off",
		"synchronous_commit":           "on",
		"max_connections":              "300",
		"shared_buffers":               "64MB",
		"max_wal_senders":              "10",
		"wal_keep_size":                "'256MB'",
		"hot_standby":                  "on",
		"hot_standby_feedback":         "on",
		"max_standby_streaming_delay":  "-1",
		"track_commit_timestamp":       "on",
		"log_min_messages":             "warning",
		"log_line_prefix":              "'%m [%p] %a '",
		"wal_receiver_status_interval": "1s",
	}
}

func appendConf(dataDir string, settings map[string]string) error {
	var b bytes.Buffer
	b.WriteString("\n# pgtest\n")
	for k, v := range settings {
		fmt.Fprintf(&b, "%s = %s\n", k, v)
	}
	f, err := os.OpenFile(filepath.Join(dataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("open postgresql.conf: %w", err)
	}
	defer f.Close()
	if _, err := f.Write(b.Bytes()); err != nil {
		return fmt.Errorf("write postgresql.conf: %w", err)
	}
	return nil
}

// serverCredential returns the unprivileged user to run server programs
// as, or nil when the process is not root.
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
		return nil, fmt.Errorf("running as root, PostgreSQL must run as an unprivileged user, but user %q was not found (create it, or set PGFENCE_PG_USER): %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func (c *Cluster) chown(path string) error {
	if c.cred == nil {
		return nil
	}
	if err := os.Chown(path, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
		return fmt.Errorf("chown %s: %w", path, err)
	}
	return nil
}

func (c *Cluster) command(ctx context.Context, prog string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(c.BinDir, prog), args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C")
	cmd.Dir = c.root
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c.cred, Pdeathsig: syscall.SIGQUIT}
	return cmd
}

// run runs a server program to completion.
func (c *Cluster) run(ctx context.Context, prog string, args ...string) error {
	cmd := c.command(ctx, prog, args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", prog, strings.Join(args, " "), err, out)
	}
	return nil
}

// startReaper starts a process that, once our end of its stdin closes
// (Close, or this process dying for any reason), stops any server still
// running and removes the cluster's directory.
func (c *Cluster) startReaper() error {
	pgctl := filepath.Join(c.BinDir, "pg_ctl")
	script := fmt.Sprintf(`read _ignored
for d in %[1]q/*/; do
  [ -f "$d/postmaster.pid" ] && %[2]q -D "$d" stop -m immediate -w >/dev/null 2>&1
done
rm -rf %[1]q`, c.root, pgctl)
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c.cred}
	in, err := cmd.StdinPipe()
	if err != nil {
		return fmt.Errorf("reaper: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start reaper: %w", err)
	}
	c.reaper, c.reaperIn = cmd, in
	return nil
}

// Close stops every node and removes the cluster's files. It is safe to
// call more than once.
func (c *Cluster) Close() error {
	c.closeOnce.Do(func() {
		var errs []error
		c.mu.Lock()
		nodes := append(append([]*Node{}, c.extra...), c.Replica, c.Primary)
		c.mu.Unlock()
		for _, n := range nodes {
			if n != nil {
				if err := n.Stop(); err != nil {
					errs = append(errs, err)
				}
			}
		}
		if c.reaper != nil {
			c.reaperIn.Close()
			if err := c.reaper.Wait(); err != nil {
				errs = append(errs, fmt.Errorf("reaper: %w", err))
			}
		} else if c.root != "" {
			os.RemoveAll(c.root)
		}
		c.closeErr = errors.Join(errs...)
	})
	return c.closeErr
}

// DSN returns a connection string for database db on this node as the
// superuser postgres.
func (n *Node) DSN(db string) string {
	return fmt.Sprintf("postgres://postgres@%s:%d/%s?sslmode=disable", n.Host, n.Port, db)
}

// Addr is host:port.
func (n *Node) Addr() string { return net.JoinHostPort(n.Host, strconv.Itoa(n.Port)) }

// Running reports whether the node's postmaster is running.
func (n *Node) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.running()
}

func (n *Node) running() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

// Start starts the node (again) and waits until it accepts connections.
func (n *Node) Start(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.running() {
		return nil
	}
	logf, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("open %s log: %w", n.Name, err)
	}
	// The postmaster must outlive ctx; it is bound to the cluster instead.
	cmd := n.c.command(context.Background(), "postgres", "-D", n.DataDir)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", n.Name, err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		logf.Close()
		close(exited)
	}()
	n.cmd, n.exited = cmd, exited
	return n.waitReady(ctx)
}

func (n *Node) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, n.timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		conn, err := pgconn.Connect(ctx, n.DSN("postgres")+"&connect_timeout=2")
		if err == nil {
			conn.Close(ctx)
			return nil
		}
		select {
		case <-n.exited:
			return fmt.Errorf("%s exited during start-up:\n%s", n.Name, n.logTail())
		case <-ctx.Done():
			return fmt.Errorf("%s did not accept connections within %s (last error: %v):\n%s", n.Name, n.timeout, err, n.logTail())
		case <-tick.C:
		}
	}
}

// Stop shuts the node down (fast shutdown: open transactions roll back)
// and waits for it to exit.
func (n *Node) Stop() error {
	return n.stop(syscall.SIGINT)
}

// Kill stops the node with an immediate shutdown, as a crash would.
func (n *Node) Kill() error {
	return n.stop(syscall.SIGQUIT)
}

func (n *Node) stop(sig syscall.Signal) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.running() {
		return nil
	}
	if err := n.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s: %w", n.Name, err)
	}
	select {
	case <-n.exited:
	case <-time.After(60 * time.Second):
		n.cmd.Process.Kill()
		<-n.exited
		return fmt.Errorf("%s did not stop within 60s; killed", n.Name)
	}
	return nil
}

// Restart stops and starts the node (a fast restart).
func (n *Node) Restart(ctx context.Context) error {
	if err := n.Stop(); err != nil {
		return err
	}
	return n.Start(ctx)
}

func (n *Node) logTail() string {
	b, err := os.ReadFile(n.LogPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Connect opens a pgx connection to db on the node.
func (n *Node) Connect(ctx context.Context, db string) (*pgx.Conn, error) {
	return pgx.Connect(ctx, n.DSN(db))
}
