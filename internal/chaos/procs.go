package chaos

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// proxyProc is one `pgfence serve` process on a fixed address, so that it
// can be killed with SIGKILL and started again where its clients expect it.
type proxyProc struct {
	name    string
	bin     string
	addr    string
	args    []string
	logPath string
	db      string

	mu  sync.Mutex
	cmd *exec.Cmd
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func newProxyProc(name, bin, primary, replica, db, logPath string) (*proxyProc, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	return &proxyProc{
		name: name, bin: bin, addr: addr, logPath: logPath, db: db,
		args: []string{"serve", "--listen", addr, "--primary", primary, "--replica", replica, "--auth", "trust",
			"--replica-poll", "20ms", "--log-level", "warn"},
	}, nil
}

// dsn is a client DSN for the chaos database through this proxy.
func (p *proxyProc) dsn(appName string) string {
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&application_name=%s", p.addr, p.db, appName)
}

// start starts the process and waits until it answers a query.
func (p *proxyProc) start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); logf.Close(); close(exited) }()
	p.cmd = cmd
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := pgconn.Connect(ctx, p.dsn("chaos-probe")+"&connect_timeout=2")
		if err == nil {
			_, err = c.Exec(ctx, "SELECT 1").ReadAll()
			c.Close(ctx)
			if err == nil {
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited during start-up (log: %s)", p.name, p.logPath)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer within 30s: %v (log: %s)", p.name, err, p.logPath)
		}
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proxyProc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	for i := 0; i < 500; i++ {
		if syscall.Kill(p.cmd.Process.Pid, 0) != nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	p.cmd = nil
}

// stop asks for a graceful shutdown, then kills.
func (p *proxyProc) stop() {
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		for syscall.Kill(cmd.Process.Pid, 0) == nil {
			time.Sleep(20 * time.Millisecond)
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
	p.kill()
}

// slotProc is the `pgfence run` process a worker slot is running, with
// the holder name it acquired its lease under.
type slotProc struct {
	holder  string
	records string
	steps   int // commits the worker makes under its token
	cmd     *exec.Cmd
	done    chan struct{}
}

// children returns the pids of the runner's children (the worker). Each
// thread lists the children it forked, and the Go runtime forks from any.
func (sp *slotProc) children() []int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", sp.cmd.Process.Pid))
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}

func (sp *slotProc) signalGroup(sig syscall.Signal) error {
	return syscall.Kill(-sp.cmd.Process.Pid, sig)
}

func (sp *slotProc) exited() bool {
	select {
	case <-sp.done:
		return true
	default:
		return false
	}
}

// terminate ends the run: SIGCONT (it may be stopped), SIGTERM to the
// runner (forwarded to the worker), SIGKILL to the group after grace.
func (sp *slotProc) terminate(grace time.Duration) {
	sp.signalGroup(syscall.SIGCONT)
	sp.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-sp.done:
	case <-time.After(grace):
		sp.signalGroup(syscall.SIGKILL)
		<-sp.done
	}
}
