package proxy

import (
	"errors"
	"net"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// Accept failures and running out of descriptors.
//
// A proxy that runs out of file descriptors (ulimit -n) or kernel memory
// must not stop serving: the sessions it has go on, and new clients wait
// in the listen backlog until descriptors free up. Serve therefore waits
// out the errors accept(2) reports for want of resources, and those of a
// connection that failed before it was taken, backing off as PgBouncer and
// Go's net/http do (5 ms, doubling, at most 1 s), and logs an episode once
// when it begins and once when it ends, however many accepts failed in
// it. Every failed accept is counted (ServerStats.AcceptErrors: SHOW
// FENCE_STATS accept_errors, pgfence_accept_errors_total).
//
// A session the proxy has accepted but cannot open for want of
// descriptors (the upstream dial, the event loop's duplicate sockets) is
// refused with 53000 insufficient_resources, as PostgreSQL refuses a
// backend it cannot start (resourceRefusal, relayRefusal); the client is
// told, its descriptor is closed, and nothing else notices.

// Bounds of the back-off between failed accepts.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// acceptRetryable reports whether Serve should wait and accept again after
// err, rather than stop: the process or the system is out of descriptors
// or kernel memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), or the connection
// being accepted failed before it was taken (ECONNABORTED and the network
// errors Linux's accept(2) passes on from a pending connection, which its
// manual says to treat like EAGAIN), or a listener says the error is a
// timeout or temporary. A closed listener is not retryable.
func acceptRetryable(err error) bool {
	if errors.Is(err, net.ErrClosed) {
		return false
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
			syscall.ECONNABORTED, syscall.EINTR, syscall.EPROTO, syscall.EPERM,
			syscall.ENETDOWN, syscall.ENETUNREACH, syscall.EHOSTDOWN, syscall.EHOSTUNREACH,
			syscall.ENOPROTOOPT, syscall.EOPNOTSUPP:
			return true
		}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	var tmp interface{ Temporary() bool }
	return errors.As(err, &tmp) && tmp.Temporary()
}

// outOfResources reports whether err says the proxy itself ran out of
// descriptors or kernel memory, and what to raise.
func outOfResources(err error) (what string, ok bool) {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return "", false
	}
	switch errno {
	case syscall.EMFILE:
		return "the proxy's file descriptor limit (ulimit -n, systemd LimitNOFILE)", true
	case syscall.ENFILE:
		return "the system's open file limit (fs.file-max)", true
	case syscall.ENOBUFS, syscall.ENOMEM:
		return "the memory the kernel has for sockets", true
	}
	return "", false
}

// resourceRefusal is what a client is told when a connection the proxy
// opens for it (upstream, the auth lookup's, a control connection) cannot
// be opened for want of the proxy's own resources: 53000, as PostgreSQL
// says when it cannot start a backend, rather than an error that blames
// PostgreSQL. It returns nil for any other err.
func resourceRefusal(err error, what string) *ProtocolError {
	limit, ok := outOfResources(err)
	if !ok {
		return nil
	}
	return &ProtocolError{Code: "53000", Msg: "pgfence cannot open " + what + ": it is out of file descriptors or socket memory",
		Hint: "raise " + limit + "; the proxy's log says more", Err: err}
}

// acceptLogEvery is the least time between two log lines saying accept is
// failing. accept(2) takes a descriptor before it looks at the backlog, so
// a process at its limit fails every accept while none is free, whether a
// client waits or not, and one that stays at its limit (sessions ending,
// new ones taking their descriptors) starts an episode with every session
// that ends: the log says so once in this time, the counter counts all.
const acceptLogEvery = 10 * time.Second

// acceptBackoff is the state of Serve's waits between failed accepts. An
// episode runs from the first failure after a success to the next
// success; its start is logged unless another was logged less than
// acceptLogEvery before (then it is logged once it has lasted that long),
// and its end is logged if its start was.
type acceptBackoff struct {
	delay    time.Duration
	failures int64     // in the episode running; 0: none
	since    time.Time // its start
	logged   bool      // its start was logged
	lastLog  time.Time // when a start was last logged
}

// failed records a failed accept and returns how long to wait before the
// next.
func (b *acceptBackoff) failed(s *Server, ln net.Listener, err error) time.Duration {
	s.ops.stats.AcceptErrors.Add(1)
	now := time.Now()
	if b.failures == 0 {
		b.since, b.logged = now, false
	}
	b.failures++
	if !b.logged && (b.lastLog.IsZero() || now.Sub(b.lastLog) >= acceptLogEvery) {
		b.logged, b.lastLog = true, now
		fields := []zap.Field{zap.Stringer("listen", ln.Addr()), zap.Error(err), zap.Int64("failed_accepts_total", s.ops.stats.AcceptErrors.Load())}
		if limit, ok := outOfResources(err); ok {
			fields = append(fields, zap.String("raise", limit))
		}
		s.log.Warn("accept failing; new clients wait in the listen backlog, retrying with back-off until it succeeds (logged once until then)", fields...)
	}
	b.delay = min(max(2*b.delay, acceptBackoffMin), acceptBackoffMax)
	return b.delay
}

// succeeded ends an episode, if one was running, and logs its end if its
// start was logged.
func (b *acceptBackoff) succeeded(s *Server, ln net.Listener) {
	if b.failures == 0 {
		return
	}
	if b.logged {
		s.log.Info("accepting again", zap.Stringer("listen", ln.Addr()), zap.Int64("failed_accepts", b.failures),
			zap.Duration("took", time.Since(b.since)))
	}
	b.delay, b.failures, b.logged = 0, 0, false
}
