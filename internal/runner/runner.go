// Package runner runs a command while holding a pgfence lease: it is the
// engine behind `pgfence run`.
//
// Run acquires the lease for a job key, starts the command with the lease's
// fencing metadata in PGOPTIONS (so every libpq client the command starts,
// psql included, presents it) and in PGFENCE_* variables, renews the lease
// in the background, tells the command to stop when the lease is lost, and
// releases the lease when the command exits.
//
// The runner is a courtesy, not the guarantee: a command that keeps running
// after its lease was taken over cannot commit a write to a protected table,
// because the gate (the proxy, or the backstop trigger on a direct
// connection) refuses its stale token with FN001. Stopping the command early
// only saves it wasted work.
//
// After a failover that voided the lease's generation (FN015: the new
// primary cannot prove it has every takeover of the job), the job is free:
// Run stops the command, acquires the lease again and runs the command
// again under the new generation, up to Config.FailoverRestarts times. A
// re-run is what a takeover of the job by a new holder would be; the new
// generation's token is above every token issued before the failover.
//
// It is not a process supervisor otherwise: it never restarts a command
// that failed or lost its lease to another holder, and signals only the
// command's own process (a shell script that starts
// other programs should exec the last one, or trap TERM and pass it on). The
// command stays in the runner's process group, so a terminal's Ctrl-C
// reaches it directly as well as forwarded. If the runner itself is killed
// with SIGKILL, the command keeps running unrenewed: once the lease expires
// and another holder takes over, the gate refuses its writes.
package runner

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
)

// Exit codes of `pgfence run` other than the command's own.
const (
	// ExitUsage (EX_USAGE): invalid flags or configuration.
	ExitUsage = 64
	// ExitUnavailable (EX_UNAVAILABLE): the database could not be reached
	// to acquire the lease. The command did not run.
	ExitUnavailable = 69
	// ExitInternal (EX_SOFTWARE): pgfence itself failed, typically the
	// database could not be reached to acquire the lease.
	ExitInternal = 70
	// ExitLeaseHeld (EX_TEMPFAIL): another holder has a live lease for the
	// job (with --wait: still held when the wait timed out). The command
	// did not run; try again later.
	ExitLeaseHeld = 75
	// ExitLeaseLost: the lease was taken over, or could not be renewed
	// before it expired, while the command ran, or its generation turned
	// out void after a failover (FN015) and no FailoverRestarts were left.
	// The command was told to stop; its writes after the takeover were
	// refused by the gate.
	ExitLeaseLost = 76
	// ExitMaxRuntime: the command ran longer than Config.MaxRuntime and
	// was stopped (KillSignal, then SIGKILL after Grace), as timeout(1)
	// exits.
	ExitMaxRuntime = 124
	// ExitCannotExecute: the command was found but could not be started.
	ExitCannotExecute = 126
	// ExitNotFound: the command was not found.
	ExitNotFound = 127
	// ExitSignalBase: a command killed by signal N makes run exit with
	// ExitSignalBase+N, as a shell does; so does run itself when a signal
	// interrupts it before the command started.
	ExitSignalBase = 128
)

var (
	// ErrLeaseHeld is returned when another holder has a live lease.
	ErrLeaseHeld = errors.New("lease held by another holder")
	// ErrLeaseLost is returned when the lease was lost while the command ran.
	ErrLeaseLost = errors.New("lease lost")
	// ErrInterrupted is returned when a signal arrived before the command
	// started.
	ErrInterrupted = errors.New("interrupted before the command started")
	// ErrMaxRuntime is returned when the command ran past MaxRuntime.
	ErrMaxRuntime = errors.New("command ran longer than its maximum runtime")
)

// Config describes one run. Zero values take the documented defaults.
type Config struct {
	// JobKey names the lease (required).
	JobKey string
	// TTL is the lease duration granted by each acquire and renew
	// (required, positive).
	TTL time.Duration
	// Holder identifies this run in fence.leases. Zero means
	// DefaultHolder of this process.
	Holder string
	// DSN is the database connection string. Empty means libpq's
	// environment variables (PGHOST, PGPORT, PGDATABASE, ...).
	DSN string
	// ConnConfig, when set, is used instead of DSN.
	ConnConfig *pgx.ConnConfig
	// Wait retries acquisition while the lease is held by another (and
	// while the database is unreachable) instead of failing fast.
	Wait bool
	// WaitTimeout bounds Wait; zero means wait until ctx ends.
	WaitTimeout time.Duration
	// WaitPoll is the pause between acquisition attempts while waiting.
	// Zero means min(1s, TTL/4).
	WaitPoll time.Duration
	// LockTimeout bounds each acquisition attempt's wait for the job's
	// fence row while another session's open transaction holds it (a
	// gated write that has not committed); the blocking sessions are
	// logged after a second and named in ErrLockTimeout. Zero means no
	// limit.
	LockTimeout time.Duration
	// MaxRuntime, when positive, stops the command once it has run that
	// long, as a lost lease does, and Run returns ExitMaxRuntime.
	MaxRuntime time.Duration
	// RenewEvery is the renewal interval. Zero means TTL/3. It must be
	// shorter than TTL.
	RenewEvery time.Duration
	// Grace is how long the command has to exit after KillSignal before it
	// is killed with SIGKILL. Zero means 10s.
	Grace time.Duration
	// KillSignal tells the command its lease is lost. Zero means SIGTERM.
	KillSignal syscall.Signal
	// FailoverRestarts is how many times one run acquires the lease again
	// and runs the command again after a failover voided its generation
	// (FN015, from a renewal or from a renewal tried right after the
	// command exited non-zero). Zero means never: the run ends with
	// ExitLeaseLost, as for a takeover. A takeover by another holder
	// (FN001) is never restarted. `pgfence run` defaults it to 3.
	FailoverRestarts int

	// Command is the program and its arguments (required).
	Command []string
	// Dir is the command's working directory; empty means ours.
	Dir string
	// Env is the command's environment before the fence variables are
	// added. Nil means os.Environ().
	Env []string
	// Stdin, Stdout and Stderr of the command. Nil means ours.
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Signals delivers the signals to forward to the command (the caller
	// subscribes to SIGINT, SIGTERM, SIGHUP). A signal that arrives before
	// the command started abandons the run with ErrInterrupted. Nil means
	// no forwarding.
	Signals <-chan os.Signal
}

// DefaultHolder is the holder a lease is recorded with when none is
// given: HOST:PID of process pid, the one that keeps the lease.
func DefaultHolder(pid int) string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	return host + ":" + strconv.Itoa(pid)
}

// setAcquireDefaults checks and defaults what acquiring needs.
func (c *Config) setAcquireDefaults() error {
	if c.JobKey == "" {
		return errors.New("a job key is required")
	}
	if c.TTL <= 0 {
		return fmt.Errorf("ttl must be positive, got %s", c.TTL)
	}
	if c.Holder == "" {
		c.Holder = DefaultHolder(os.Getpid())
	}
	if c.WaitTimeout < 0 {
		return fmt.Errorf("wait timeout must not be negative, got %s", c.WaitTimeout)
	}
	if c.LockTimeout < 0 {
		return fmt.Errorf("lock timeout must not be negative, got %s", c.LockTimeout)
	}
	if c.WaitPoll <= 0 {
		c.WaitPoll = min(time.Second, c.TTL/4)
	}
	return nil
}

func (c *Config) setDefaults() error {
	if err := c.setAcquireDefaults(); err != nil {
		return err
	}
	if len(c.Command) == 0 || c.Command[0] == "" {
		return errors.New("a command is required")
	}
	if c.FailoverRestarts < 0 {
		return fmt.Errorf("failover restarts must not be negative, got %d", c.FailoverRestarts)
	}
	if c.MaxRuntime < 0 {
		return fmt.Errorf("max runtime must not be negative, got %s", c.MaxRuntime)
	}
	if c.RenewEvery == 0 {
		c.RenewEvery = c.TTL / 3
	}
	if c.RenewEvery <= 0 || c.RenewEvery >= c.TTL {
		return fmt.Errorf("renew interval %s must be positive and shorter than the ttl %s", c.RenewEvery, c.TTL)
	}
	if c.Grace == 0 {
		c.Grace = 10 * time.Second
	}
	if c.Grace < 0 {
		return fmt.Errorf("grace must not be negative, got %s", c.Grace)
	}
	if c.KillSignal == 0 {
		c.KillSignal = syscall.SIGTERM
	}
	if c.Env == nil {
		c.Env = os.Environ()
	}
	if c.Stdin == nil {
		c.Stdin = os.Stdin
	}
	if c.Stdout == nil {
		c.Stdout = os.Stdout
	}
	if c.Stderr == nil {
		c.Stderr = os.Stderr
	}
	return nil
}

// Run acquires the lease, runs the command under it and releases it. It
// returns the exit code `pgfence run` should exit with and, when that code
// is pgfence's own rather than the command's, an error saying why
// (ErrLeaseHeld, ErrLeaseLost, ErrInterrupted or another failure). A
// command that ran and exited non-zero is not an error: the code is its own.
//
// Cancelling ctx before the command starts abandons the run; afterwards it
// stops the command like a lost lease does (KillSignal, then SIGKILL after
// Grace).
func Run(ctx context.Context, cfg Config, log *zap.Logger) (int, error) {
	if err := cfg.setDefaults(); err != nil {
		return ExitUsage, err
	}
	r, err := newRun(cfg, log)
	if err != nil {
		return ExitUsage, err
	}
	defer r.store.close()
	return r.run(ctx)
}

// Acquire takes the lease as Run does before it starts the command (with
// cfg's Wait, WaitTimeout and LockTimeout; Command and the renewal fields
// are ignored) and returns it with the exit code for a failure: ExitUsage,
// ExitUnavailable, ExitLeaseHeld (held by another holder, or a wait ran
// out) or ExitInternal. The lease is not renewed: the caller renews and
// releases it.
func Acquire(ctx context.Context, cfg Config, log *zap.Logger) (fence.Lease, int, error) {
	if err := cfg.setAcquireDefaults(); err != nil {
		return fence.Lease{}, ExitUsage, err
	}
	r, err := newRun(cfg, log)
	if err != nil {
		return fence.Lease{}, ExitUsage, err
	}
	defer r.store.close()
	l, err := r.acquire(ctx)
	if err != nil {
		return fence.Lease{}, acquireExitCode(err), err
	}
	return l.Lease, 0, nil
}

// newRun is a run of cfg (its defaults set) with its lease store; the
// caller closes the store.
func newRun(cfg Config, log *zap.Logger) (*run, error) {
	connCfg := cfg.ConnConfig
	if connCfg == nil {
		var err error
		if connCfg, err = pgx.ParseConfig(cfg.DSN); err != nil {
			return nil, fmt.Errorf("parse database connection string: %w", err)
		}
	}
	// Every acquire, renewal and release fails with FN016 when its
	// commit's wait for the synchronous standby was cancelled (PostgreSQL
	// answers success with only a WARNING): the command never starts on a
	// takeover the standby did not confirm (docs/failover.md).
	connCfg = connCfg.Copy()
	fence.WatchSyncRep(&connCfg.Config)
	log = log.With(zap.String("job_key", cfg.JobKey), zap.String("holder", cfg.Holder))
	return &run{cfg: cfg, log: log, store: &leases{cfg: connCfg, log: log, lockTimeout: cfg.LockTimeout}}, nil
}

// acquireExitCode is the exit code for an acquisition that failed with err.
func acquireExitCode(err error) int {
	var ce *pgconn.ConnectError
	switch {
	case errors.Is(err, ErrLeaseHeld), errors.Is(err, ErrLockTimeout), fence.Code(err) == fence.CodeUnconfirmed:
		return ExitLeaseHeld
	case errors.As(err, &ce):
		return ExitUnavailable
	}
	return ExitInternal
}

type run struct {
	cfg   Config
	log   *zap.Logger
	store *leases
}

func (r *run) run(ctx context.Context) (int, error) {
	var deadline time.Time // MaxRuntime bounds the whole run, restarts included
	for restarts := 0; ; restarts++ {
		lease, sig, err := r.acquireInterruptibly(ctx)
		if err != nil {
			if sig != nil {
				return signalCode(sig), fmt.Errorf("%w: %s", ErrInterrupted, sig)
			}
			if restarts > 0 {
				err = fmt.Errorf("acquire the lease again after a failover: %w", err)
			}
			return acquireExitCode(err), err
		}
		fields := []zap.Field{zap.Int64("epoch", lease.Epoch), zap.Int64("token", lease.Token), zap.Time("expires_at", lease.ExpiresAt)}
		if restarts > 0 {
			fields = append(fields, zap.Int("failover_restart", restarts))
		}
		r.log.Info("lease acquired", fields...)
		if deadline.IsZero() && r.cfg.MaxRuntime > 0 {
			deadline = time.Now().Add(r.cfg.MaxRuntime)
		}
		out := r.supervise(ctx, lease, deadline)
		if out.void == nil && out.err == nil && out.code != 0 && !out.interrupted && r.cfg.FailoverRestarts > 0 {
			// The command failed. If it failed because its writes were
			// refused with FN015 before the next renewal would have told
			// us, a renewal says so now (one round trip, only after a
			// failure).
			if err := r.check(ctx, lease); fence.IsFailover(err) {
				out.void = fmt.Errorf("renew after the command exited %d: %w", out.code, err)
			}
		}
		if out.void != nil {
			why := ""
			switch {
			case out.interrupted || ctx.Err() != nil:
				why = "the run was interrupted"
			case !deadline.IsZero() && !time.Now().Before(deadline):
				why = fmt.Sprintf("the maximum runtime %s is over", r.cfg.MaxRuntime)
			case restarts >= r.cfg.FailoverRestarts:
				why = fmt.Sprintf("no failover restarts are left (%d allowed)", r.cfg.FailoverRestarts)
			}
			if why == "" {
				r.logRestart(ctx, lease, out, restarts+1)
				continue
			}
			// The void lease holds nothing: there is nothing to release.
			return ExitLeaseLost, fmt.Errorf("%w: its generation is void after a failover and %s (command exit code %d): %w",
				ErrLeaseLost, why, out.code, out.void)
		}
		if !out.lostConfirmed {
			if err := r.release(ctx, lease); isGone(err) && !errors.Is(out.err, ErrLeaseLost) {
				// Taken over after the last renewal: the command's last writes
				// may have been refused. Say so whatever the command exited with.
				return ExitLeaseLost, fmt.Errorf("%w: release found it taken over (command exit code %d): %w", ErrLeaseLost, out.code, err)
			}
		}
		return out.code, out.err
	}
}

// check renews lease l, to learn whether its generation is still valid
// after the command failed; the answer is the database's. A failover
// breaks the connection the renewals used, and the first use of a broken
// connection fails without reaching a server, so an attempt that got no
// answer from the database is made once more, on a new connection.
func (r *run) check(ctx context.Context, l held) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	_, err := r.store.renew(cctx, l.JobKey, l.Token, r.cfg.TTL)
	var pgErr *pgconn.PgError
	if err != nil && !errors.As(err, &pgErr) && cctx.Err() == nil {
		r.store.close()
		_, err = r.store.renew(cctx, l.JobKey, l.Token, r.cfg.TTL)
	}
	if err != nil && !fence.IsFailover(err) {
		r.log.Debug("renewal after the command failed", zap.Int64("token", l.Token), zap.Error(err))
	}
	return err
}

// logRestart says, before the run acquires the lease again, that lease l's
// generation is void after a failover, with the era the server is in now
// when it can be read (one query, only after a failover).
func (r *run) logRestart(ctx context.Context, l held, out outcome, restart int) {
	fields := []zap.Field{
		zap.Int64("void_token", l.Token), zap.Int("command_exit_code", out.code),
		zap.Int("failover_restart", restart), zap.Int("failover_restarts", r.cfg.FailoverRestarts),
	}
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if e, err := r.store.currentEra(ectx); err == nil {
		fields = append(fields, zap.Int32("era", e.era), zap.Int32("timeline", e.timeline), zap.String("era_reason", e.reason))
	} else {
		r.log.Debug("reading the current era failed", zap.Error(err))
	}
	r.log.Warn("failover: the lease's generation is void (FN015) and the job is free; acquiring the lease again and running the command again under a new generation",
		append(fields, zap.Error(out.void))...)
}

// acquireInterruptibly acquires the lease; a signal from cfg.Signals or the
// end of ctx abandons the attempt. When a signal abandoned it, the signal
// is returned.
func (r *run) acquireInterruptibly(ctx context.Context) (held, os.Signal, error) {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := make(chan os.Signal, 1)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case s := <-r.cfg.Signals: // a nil channel never delivers
			got <- s
			cancel()
		case <-stop:
		}
	}()
	lease, err := r.acquire(actx)
	close(stop)
	<-done
	select {
	case s := <-got:
		if err == nil {
			r.release(ctx, lease)
			err = ErrInterrupted
		}
		return held{}, s, err
	default:
	}
	return lease, nil, err
}

// acquire tries once, or with cfg.Wait until acquired or timed out.
func (r *run) acquire(ctx context.Context) (held, error) {
	var deadline time.Time
	if r.cfg.WaitTimeout > 0 {
		deadline = time.Now().Add(r.cfg.WaitTimeout)
	}
	logged, lastHeld := false, false
	for {
		attemptCtx, cancel := ctx, context.CancelFunc(func() {})
		if !deadline.IsZero() {
			attemptCtx, cancel = context.WithDeadline(ctx, deadline)
		}
		sent := time.Now()
		lease, err := r.store.acquire(attemptCtx, r.cfg.JobKey, r.cfg.Holder, r.cfg.TTL)
		timedOut := attemptCtx.Err() != nil
		cancel()
		if err == nil {
			// The database computed expires_at from a clock reading taken
			// after we sent the request, so sent+TTL is never later.
			lease.localDeadline = sent.Add(r.cfg.TTL)
			return lease, nil
		}
		if ctx.Err() != nil {
			return held{}, fmt.Errorf("acquire lease: %w", ctx.Err())
		}
		isHeld := fence.IsLeaseHeld(err)
		switch {
		case timedOut && (isHeld || lastHeld):
			// An attempt answered FN002 after the deadline passed is as
			// held as an earlier one.
			return held{}, fmt.Errorf("%w: still held after waiting %s", ErrLeaseHeld, r.cfg.WaitTimeout)
		case timedOut:
			return held{}, fmt.Errorf("acquire lease: gave up after waiting %s: %w", r.cfg.WaitTimeout, err)
		case isHeld && !r.cfg.Wait:
			return held{}, fmt.Errorf("%w: %w", ErrLeaseHeld, err)
		case !isHeld && !r.cfg.Wait:
			return held{}, fmt.Errorf("acquire lease: %w", err)
		case isHeld && !logged:
			r.log.Info("lease held by another holder; waiting", zap.Error(err))
			logged = true
		case !isHeld:
			r.log.Warn("acquire lease failed; retrying", zap.Error(err))
		}
		lastHeld = isHeld
		pause := r.cfg.WaitPoll
		if !deadline.IsZero() {
			left := time.Until(deadline)
			if left <= 0 {
				if isHeld {
					return held{}, fmt.Errorf("%w: still held after waiting %s: %w", ErrLeaseHeld, r.cfg.WaitTimeout, err)
				}
				return held{}, fmt.Errorf("acquire lease: gave up after waiting %s: %w", r.cfg.WaitTimeout, err)
			}
			pause = min(pause, left)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return held{}, fmt.Errorf("acquire lease: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// release gives the lease back and returns the database's answer. A
// failure is only logged here: the lease expires on its own anyway; the
// caller looks for a lease that was no longer ours (isGone).
func (r *run) release(ctx context.Context, l held) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := r.store.release(rctx, l.JobKey, l.Token)
	switch {
	case err == nil:
		r.log.Info("lease released", zap.Int64("epoch", l.Epoch), zap.Int64("token", l.Token))
	case isGone(err):
		r.log.Warn("lease not released: another holder took it over", zap.Int64("token", l.Token), zap.Error(err))
	default:
		r.log.Warn("release lease failed; it will expire on its own", zap.Int64("token", l.Token), zap.Error(err))
	}
	return err
}

// outcome is how one run of the command ended.
type outcome struct {
	// code is the exit code: the command's, or pgfence's own when err is
	// set.
	code int
	err  error
	// lostConfirmed reports that the database said the lease is no longer
	// ours (so there is nothing to release).
	lostConfirmed bool
	// void is set when a renewal found the generation void after a
	// failover (FN015); code is then the command's own and err nil: the
	// caller decides whether to run the command again.
	void error
	// interrupted reports that a signal was forwarded to the command or
	// ctx ended: someone else asked it to stop.
	interrupted bool
}

// supervise starts the command and renews the lease until the command
// exits. A positive deadline stops the command then (MaxRuntime).
func (r *run) supervise(ctx context.Context, l held, deadline time.Time) outcome {
	cmd := exec.Command(r.cfg.Command[0], r.cfg.Command[1:]...)
	cmd.Dir = r.cfg.Dir
	cmd.Env = childEnv(r.cfg.Env, l)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = r.cfg.Stdin, r.cfg.Stdout, r.cfg.Stderr
	// Unblock Wait when grandchildren keep inherited pipes open.
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		c := ExitCannotExecute
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
			c = ExitNotFound
		}
		return outcome{code: c, err: fmt.Errorf("start command: %w", err)}
	}
	log := r.log.With(zap.Int("pid", cmd.Process.Pid))
	log.Debug("command started", zap.Strings("command", r.cfg.Command))

	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	rctx, stopRenew := context.WithCancel(context.WithoutCancel(ctx))
	lost := make(chan lossReport, 1)
	renewDone := make(chan struct{})
	rn := &renewer{store: r.store, cfg: &r.cfg, log: r.log, lease: l, deadline: l.localDeadline}
	go func() {
		defer close(renewDone)
		rn.run(rctx, lost)
	}()

	var (
		loss      *lossReport
		killTimer <-chan time.Time
		ctxDone   = ctx.Done()
		stopping  bool
		maxRun    <-chan time.Time
		overran   bool
		asked     bool
	)
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		maxRun = t.C
	}
	stopChild := func(why string) {
		if stopping {
			return
		}
		stopping = true
		log.Info("stopping command", zap.String("reason", why), zap.Stringer("signal", r.cfg.KillSignal), zap.Int64("grace_ms", r.cfg.Grace.Milliseconds()))
		_ = cmd.Process.Signal(r.cfg.KillSignal)
		killTimer = time.After(r.cfg.Grace)
	}
	var waitErr error
loop:
	for {
		select {
		case waitErr = <-exited:
			break loop
		case s := <-r.cfg.Signals:
			asked = true
			log.Info("forwarding signal to command", zap.Stringer("signal", s))
			_ = cmd.Process.Signal(s)
		case rep := <-lost:
			loss = &rep
			logLoss(log, l, rep)
			if rep.void {
				stopChild("generation void after a failover")
			} else {
				stopChild("lease lost")
			}
		case <-ctxDone:
			asked = true
			ctxDone = nil
			stopChild("run cancelled")
		case <-maxRun:
			maxRun = nil
			overran = true
			stopChild(fmt.Sprintf("ran longer than the maximum runtime %s", r.cfg.MaxRuntime))
		case <-killTimer:
			killTimer = nil
			log.Warn("command still running after grace; killing it", zap.Int64("grace_ms", r.cfg.Grace.Milliseconds()))
			_ = cmd.Process.Kill()
		}
	}
	stopRenew()
	<-renewDone
	if loss == nil {
		select {
		case rep := <-lost:
			loss = &rep
			logLoss(log, l, rep)
		default:
		}
	}

	code := exitCode(cmd.ProcessState)
	log.Info("command exited", zap.Int("exit_code", code), zap.NamedError("wait_error", waitErrOnly(waitErr)))
	switch {
	case loss != nil && loss.void:
		return outcome{code: code, lostConfirmed: true, void: loss.err, interrupted: asked}
	case loss != nil:
		return outcome{code: ExitLeaseLost, lostConfirmed: loss.confirmed, interrupted: asked,
			err: fmt.Errorf("%w while the command ran (command exit code %d): %w", ErrLeaseLost, code, loss.err)}
	case overran:
		return outcome{code: ExitMaxRuntime, interrupted: asked,
			err: fmt.Errorf("%w %s; it was stopped (command exit code %d)", ErrMaxRuntime, r.cfg.MaxRuntime, code)}
	}
	return outcome{code: code, interrupted: asked}
}

// logLoss logs the loss of lease l.
func logLoss(log *zap.Logger, l held, rep lossReport) {
	if rep.void {
		log.Warn("failover: the lease's generation is void (FN015)", zap.Int64("token", l.Token), zap.Error(rep.err))
		return
	}
	log.Warn("lease lost", zap.Int64("token", l.Token), zap.Bool("taken_over", rep.confirmed), zap.Error(rep.err))
}

// waitErrOnly keeps errors from Wait other than the command's exit status.
func waitErrOnly(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil
	}
	return err
}

// exitCode maps a finished process to a shell-style exit code.
func exitCode(ps *os.ProcessState) int {
	if ps == nil {
		return ExitInternal
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return ExitSignalBase + int(ws.Signal())
	}
	return ps.ExitCode()
}

func signalCode(s os.Signal) int {
	if ss, ok := s.(syscall.Signal); ok {
		return ExitSignalBase + int(ss)
	}
	return ExitInternal
}
