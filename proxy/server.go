package proxy

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/internal/wire"
	"github.com/pgfence/pgfence/pool"
	"go.uber.org/zap"
)

// Server is a session-mode PostgreSQL proxy.
type Server struct {
	cfg      Config
	log      *zap.Logger
	primary  *pgconn.Config
	replicas []*pgconn.Config
	auth     *authLookup // AuthPostgres: the roles' passwords (auth.go)
	mem      memBudget   // held client messages (session.go)
	// pools bound the server connections clients hold, per database and
	// user (package pool: default_pool_size, max_db_connections, ...).
	pools *pool.Pools
	// mockSecret salts the dummy verifiers of unknown roles (auth.go).
	mockSecret [32]byte
	// oversizedTag names the substitutes for messages over the limit
	// (limits.go).
	oversizedTag string

	clients  atomic.Int64 // sessions counted against MaxClients
	startups startupSlots // connections in startup (startup_slots.go)
	draining atomic.Bool
	shut     chan struct{} // closed by Shutdown (shutOnce): ends Serve's waits
	// shutCtx ends with Shutdown too (shutCancel): the waits for a
	// server connection (pools.go) end with it.
	shutCtx    context.Context
	shutCancel context.CancelFunc
	shutOnce   sync.Once
	parkOnce   sync.Once // starts expireParked (pools.go)

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[net.Conn]*Session // nil Session while in startup
	cancels   map[uint64]cancelTarget
	wg        sync.WaitGroup
	idle      chan struct{} // signalled when a connection ends during shutdown

	ops ops // admin console, metrics, reload: admin.go, metrics.go

	rs *replicas // read routing: replica positions and health (lsn.go); nil without

	// loop relays its sessions (evloop.go): started by the first
	// session that can use it, stopped by Shutdown.
	loop serverLoop
}

// cancelTarget is where a client's CancelRequest goes.
type cancelTarget struct {
	secret  uint32 // the secret we gave the client
	addr    net.Addr
	pid     uint32
	upKey   []byte
	network string
}

// New validates cfg and returns a Server. It opens no connections.
func New(cfg Config, log *zap.Logger) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = zap.NewNop()
	}
	s := &Server{
		cfg:       cfg,
		log:       log,
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[net.Conn]*Session),
		cancels:   make(map[uint64]cancelTarget),
		idle:      make(chan struct{}, 1),
		shut:      make(chan struct{}),
	}
	if cfg.DisableEventLoop {
		if cfg.Poller != "" && cfg.Poller != "poll" {
			return nil, fmt.Errorf("config: DisableEventLoop (no_event_loop) with poller %q: the first means poller \"poll\" now; set only poller", cfg.Poller)
		}
		log.Warn(`no_event_loop is deprecated: every session is relayed by the event loop; it now selects poller = "poll", which is what to set instead`)
		cfg.Poller, s.cfg.Poller = "poll", "poll"
	}
	if err := checkPoller(cfg.Poller); err != nil { // poller_*.go
		return nil, fmt.Errorf("config: %w", err)
	}
	s.loop.poller = cfg.Poller
	if s.primary, err = pgconn.ParseConfig(cfg.Primary); err != nil {
		return nil, fmt.Errorf("config: primary: %w", err)
	}
	for i, r := range cfg.Replicas {
		rc, err := pgconn.ParseConfig(r)
		if err != nil {
			return nil, fmt.Errorf("config: replica %d: %w", i+1, err)
		}
		s.replicas = append(s.replicas, rc)
	}
	s.mockSecret = mockSecret(cfg, s.primary, s.replicas, log) // auth.go
	s.pools = pool.New(func(pool.Key) pool.Limits { return s.live().poolLimits })
	s.shutCtx, s.shutCancel = context.WithCancel(context.Background())
	var tag [8]byte
	rand.Read(tag[:])
	s.oversizedTag = oversizedPrefix + hex.EncodeToString(tag[:]) // limits.go
	s.mem.limit = int64(cfg.MemoryBudget)
	if cu, ok := cfg.Interceptor.(CacheMemoryUser); ok { // the gate's caches share the budget (limits.go)
		s.mem.shrink = cu.UseMemory(s.mem.limit, cacheBudget{&s.mem})
	}
	s.auth = &authLookup{cfg: s.primary, query: cfg.AuthQuery, log: log}
	if heldCost(cfg.MaxMessageSize) > int64(cfg.ClientMemory) && cfg.Interceptor != nil {
		log.Info("one session's share of memory_budget (client_memory) cannot hold a message of max_message_size: gated messages over client_memory / 8 get 53200; raise client_memory (within memory_budget) or lower max_message_size",
			zap.Int("memory_budget", cfg.MemoryBudget), zap.Int("client_memory", cfg.ClientMemory), zap.Int("max_message_size", cfg.MaxMessageSize), zap.Int64("held_message_cost", heldCost(cfg.MaxMessageSize)))
	}
	if cfg.Auth == AuthTrust {
		log.Warn("auth trust: every client is let in without a password, as any user it names; use it for local development only")
	}
	s.initOps()      // admin.go
	s.initReplicas() // route.go
	return s, nil
}

// Serve accepts connections on ln until Shutdown is called or ctx ends;
// then it closes ln and returns ErrServerClosed (after Shutdown) or
// ctx.Err(). Sessions already open are not affected by ctx: end them with
// Shutdown.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	s.mu.Lock()
	if s.draining.Load() {
		s.mu.Unlock()
		ln.Close()
		return ErrServerClosed
	}
	if s.live().auth == AuthTrust && !s.cfg.AllowRemoteTrust && !isLoopback(ln.Addr()) {
		s.mu.Unlock()
		ln.Close()
		return fmt.Errorf("serve: auth trust on %s, a non-loopback address, would let anyone who can reach it in as any user; use auth postgres, or set allow_remote_trust if you mean it", ln.Addr())
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
	}()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()

	var backoff acceptBackoff // accept.go
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.draining.Load() {
				s.waitConsoleShutdown() // admin_pause.go
				return ErrServerClosed
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !acceptRetryable(err) {
				return fmt.Errorf("accept: %w", err)
			}
			// Out of descriptors (EMFILE) and the like: the sessions
			// open go on, new clients wait in the backlog.
			wait := time.NewTimer(backoff.failed(s, ln, err))
			select {
			case <-wait.C:
			case <-ctx.Done():
				wait.Stop()
			case <-s.shut:
				wait.Stop()
			}
			continue
		}
		backoff.succeeded(s, ln)
		if !s.track(c, nil) {
			c.Close()
			continue
		}
		s.wg.Add(1)
		go s.handle(c)
	}
}

// track registers c (with its session, once it has one); false when the
// server is shutting down and c must not start.
func (s *Server) track(c net.Conn, sess *Session) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.draining.Load() && sess == nil {
		return false
	}
	s.conns[c] = sess
	return true
}

func (s *Server) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	if s.draining.Load() {
		select {
		case s.idle <- struct{}{}:
		default:
		}
	}
}

// Shutdown stops accepting, closes idle sessions at once and the others
// as soon as they are idle (ReadyForQuery 'I' with nothing in flight),
// until ctx ends or Config.ShutdownTimeout passes; then it closes the rest
// (their upstream backends roll back). It returns nil when every session
// ended gracefully.
func (s *Server) Shutdown(ctx context.Context) error {
	s.draining.Store(true)
	s.shutOnce.Do(func() { close(s.shut); s.shutCancel() })
	defer s.closeParked()   // once the sessions have ended: pools.go
	defer s.loop.stop()     // once the sessions have ended (wg.Wait below): evloop.go
	s.stopControl()         // admin_pause.go: ends PAUSE waits
	defer s.closeReplicas() // route.go
	defer s.auth.close()
	s.mu.Lock()
	for ln := range s.listeners {
		ln.Close()
	}
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ShutdownTimeout)
	defer cancel()
	for {
		s.mu.Lock()
		n := 0
		for c, sess := range s.conns {
			switch {
			case sess == nil && s.consoleBusy(c):
				// An admin console answering: its waits end with the
				// shutdown (57P01), then it is closed below.
				n++
			case sess == nil: // still in startup or an idle console: nothing to lose
				c.Close()
			case sess.tryCloseIdle():
				// Ending the upstream ends the session, which then tells
				// the client why.
				sess.closeServer()
			default:
				n++
			}
		}
		s.mu.Unlock()
		if n == 0 {
			break
		}
		select {
		case <-s.idle:
			continue
		case <-time.After(100 * time.Millisecond):
			// Sessions that go idle notice the drain themselves; this
			// re-check only covers idle sessions that never speak again.
			continue
		case <-ctx.Done():
		}
		s.mu.Lock()
		for c, sess := range s.conns {
			if sess != nil {
				sess.closeServer()
			}
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
		return fmt.Errorf("shutdown: closed %d sessions still in a transaction or busy: %w", n, ctx.Err())
	}
	s.wg.Wait()
	return nil
}

// handle runs one client connection from startup to close.
func (s *Server) handle(c net.Conn) {
	defer s.wg.Done()
	defer s.untrack(c)
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("panic in connection", zap.Stringer("client", c.RemoteAddr()), zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			c.Close()
		}
	}()
	log := s.log.With(zap.Stringer("client", c.RemoteAddr()))
	slot := s.startupBegin(c) // startup_slots.go
	defer s.startupEnd(slot)
	c.SetDeadline(time.Now().Add(s.cfg.StartupTimeout))
	conn, st, err := s.startup(c)
	if err != nil {
		s.refuse(conn, s.startupError(slot, err), log, "startup failed")
		return
	}
	if st == nil { // cancel request, SSL probe that went away
		conn.Close()
		return
	}
	user, db := st.params["user"], st.params["database"]
	log = log.With(zap.String("user", user), zap.String("database", db))
	if repl, err := st.replication(); err != nil {
		s.refuse(conn, err, log, "startup failed")
		return
	} else if repl {
		s.refuse(conn, &ProtocolError{Code: "0A000", Msg: "pgfence does not proxy replication connections; connect to PostgreSQL directly for replication"}, log, "replication refused")
		return
	}
	if st.needsNegotiation() {
		msg := encode(nil, &pgproto3.NegotiateProtocolVersion{NewestMinorProtocol: 0, UnrecognizedOptions: st.unknown})
		if _, err := conn.Write(msg); err != nil {
			conn.Close()
			return
		}
	}
	if db == AdminDatabase { // the admin console, with its own authentication: admin.go
		// Not counted against max_clients: the console stays reachable
		// however many clients there are.
		s.serveAdmin(conn, st, log, slot)
		return
	}
	proof, err := s.authenticate(conn, st, log)
	if err != nil {
		s.refuse(conn, s.startupError(slot, err), log, "authentication failed")
		return
	}
	s.startupEnd(slot)
	// max_clients counts authenticated sessions only (startup_slots.go).
	if n, limit := s.clients.Add(1), s.live().maxClients; limit > 0 && n > int64(limit) {
		s.clients.Add(-1)
		s.refuse(conn, &ProtocolError{Code: "53300", Msg: "sorry, too many clients already", Err: ErrTooManyClients}, log, "client refused")
		return
	}
	defer s.clients.Add(-1)
	if !s.admit(conn, st, log) { // DISABLE, PAUSE: admin_pause.go
		return
	}
	sig := startupSignature(st.params)
	sv, err := s.serverSlot(conn, user, db, sig, log) // pools.go
	if err != nil {
		s.refuse(conn, err, log, "no server connection")
		return
	}
	defer sv.Release() // after Park: nothing
	if sv.Waited > 0 && !s.admit(conn, st, log) {
		// A DISABLE or PAUSE that came while it waited for its server
		// connection applies to it as to a client arriving now (round
		// 25, BC-L5).
		return
	}
	l, err := s.loop.get() // evloop.go: before an upstream is opened for nothing
	if err != nil {
		s.refuse(conn, relayRefusal(err), log, "event loop unavailable")
		return
	}
	start := time.Now()
	sess, err := s.open(c, conn, st, proof, log, sv, sig)
	if err != nil {
		s.refuse(conn, err, log, "upstream connect failed")
		return
	}
	s.ops.stats.SessionsTotal.Add(1)
	log = sess.log // carries backend_pid
	log.Info("session open", zap.Bool("parked_backend", sess.warm))
	err = sess.run(l)
	s.dropCancelKey(sess)
	if sess.kept {
		s.park(sess, sv) // pools.go
	}
	s.sessionEnded(sess) // admin_pause.go
	fields := []zap.Field{zap.Float64("duration_ms", float64(time.Since(start).Microseconds())/1000)}
	if err != nil {
		fields = append(fields, zap.NamedError("reason", err))
	}
	log.Info("session closed", fields...)
}

// refuse reports err to the client where the protocol allows, logs it
// and closes.
func (s *Server) refuse(c net.Conn, err error, log *zap.Logger, what string) {
	s.countRefusal(err)
	var pe *ProtocolError
	var pg *pgconn.PgError
	if errors.As(err, &pe) || errors.As(err, &pg) || errors.Is(err, errUpstream) {
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(encode(nil, errorResponse(err)))
	}
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		log.Debug(what, zap.Error(err))
	} else {
		log.Info(what, zap.Error(err))
	}
	c.Close()
}

// startup runs the startup phase: SSL/GSSENC negotiation, cancel
// requests, and the startup message. It returns the connection to use
// (TLS-wrapped or not) and the startup, or nil after a cancel request.
func (s *Server) startup(c net.Conn) (net.Conn, *startup, error) {
	var buf [256]byte
	tlsDone := false
	for {
		b, err := readStartupPacket(c, buf[:0])
		if err != nil {
			return c, nil, err
		}
		st, err := parseStartup(b)
		if err != nil {
			return c, nil, err
		}
		switch st.kind {
		case startupSSL:
			if tlsDone {
				return c, nil, &ProtocolError{Code: "08P01", Msg: "SSLRequest after TLS was established"}
			}
			tlsCfg := s.live().tls
			if tlsCfg == nil {
				if _, err := c.Write([]byte{'N'}); err != nil {
					return c, nil, err
				}
				continue
			}
			if _, err := c.Write([]byte{'S'}); err != nil {
				return c, nil, err
			}
			// Over a transport of ours, which the event loop can
			// take over once the session is on it (tlsconn.go).
			tc := tls.Server(&tlsTransport{Conn: c}, tlsCfg)
			if err := tc.Handshake(); err != nil {
				return c, nil, fmt.Errorf("tls handshake: %w", err)
			}
			c, tlsDone = tc, true
		case startupGSSENC:
			if _, err := c.Write([]byte{'N'}); err != nil {
				return c, nil, err
			}
		case startupCancel:
			s.cancel(st)
			return c, nil, nil
		default:
			return c, st, nil
		}
	}
}

var errUpstream = errors.New("upstream connection failed")

// upstreamConfig is base (the primary's or a replica's settings) for a
// client: its user and database and its startup parameters. The
// credentials are upstreamCredentials' (auth.go).
func (s *Server) upstreamConfig(base *pgconn.Config, user, db string, params map[string]string) *pgconn.Config {
	pc := base.Copy()
	pc.User, pc.Database = user, db
	pc.Password = "" // presented only by upstreamCredentials' rules
	rp := make(map[string]string, len(pc.RuntimeParams)+len(params))
	for k, v := range pc.RuntimeParams {
		rp[k] = v
	}
	for k, v := range params {
		if k != "user" && k != "database" {
			rp[k] = v
		}
	}
	pc.RuntimeParams = rp
	if pc.ConnectTimeout == 0 {
		pc.ConnectTimeout = s.cfg.ConnectTimeout
	}
	if mayTLS(pc) {
		// pgconn makes its tls.Client over the connection dialed: one
		// of our transports, which the event loop can take over
		// (tlsconn.go).
		dial := pc.DialFunc
		if dial == nil {
			dial = (&net.Dialer{}).DialContext
		}
		pc.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &tlsTransport{Conn: c}, nil
		}
	}
	return pc
}

// mayTLS reports whether pgconn may connect with TLS for pc.
func mayTLS(pc *pgconn.Config) bool {
	if pc.TLSConfig != nil {
		return true
	}
	for _, f := range pc.Fallbacks {
		if f.TLSConfig != nil {
			return true
		}
	}
	return false
}

// connectAs opens a connection to base's server as the client's role
// (user, database and startup parameters), authenticated with what the
// client proved (proof). The primary's and the replicas' connections are
// opened the same way. ending, when not nil, ends the dial as soon as it
// is closed (a routed session's replica dial runs detached on the loop,
// offClient, and nothing else would stop it before ConnectTimeout; its
// connection, once the loop has stopped, would be closed only at the
// Server's shutdown), and a connection that completes after that is
// closed at once.
//
// Cancelling the context alone is not enough: the startup exchange on the
// new connection (startUpstream) heeds only the context's deadline, so
// ending closes the connection being dialed itself.
func (s *Server) connectAs(base *pgconn.Config, user, db string, params map[string]string, proof *Proof, ending <-chan struct{}) (*pgconn.HijackedConn, error) {
	pc := s.upstreamConfig(base, user, db, params) // a copy of base
	ctx, cancel := context.WithTimeout(context.Background(), pc.ConnectTimeout)
	defer cancel()
	creds := s.upstreamCredentials(base, user, proof)
	if ending == nil {
		return dialUpstream(ctx, pc, creds)
	}
	d := &endableDial{}
	pc.DialFunc = d.wrap(pc.DialFunc)
	finished := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-ending:
			cancel()
			d.end()
		case <-finished:
		}
	}()
	hj, err := dialUpstream(ctx, pc, creds)
	close(finished)
	<-watched // d.end has run, or never will
	if err != nil {
		if isClosed(ending) {
			return nil, fmt.Errorf("%w: %w", errSessionClosing, err)
		}
		return nil, err
	}
	if isClosed(ending) {
		hj.Conn.Close()
		return nil, errSessionClosing
	}
	return hj, nil
}

// endableDial tracks the connections a dial makes, so that end closes
// them, and any made later as soon as they are made.
type endableDial struct {
	mu    sync.Mutex
	conns []net.Conn
	ended bool
}

func (d *endableDial) wrap(dial pgconn.DialFunc) pgconn.DialFunc {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.ended {
			c.Close()
			return nil, errSessionClosing
		}
		d.conns = append(d.conns, c)
		return c, nil
	}
}

func (d *endableDial) end() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ended = true
	for _, c := range d.conns {
		c.Close()
	}
}

// open connects upstream for an authenticated client, finishes the
// client's startup (ParameterStatus, BackendKeyData, ReadyForQuery) and
// returns the session.
//
// BackendKeyData carries the upstream backend's real process id, so that
// pg_backend_pid(), the PID of the session's own notifications and
// pg_stat_activity agree with what the driver was told; the secret is the
// proxy's own, so a cancel request still comes to the proxy, which checks
// it and forwards the backend's real key (which the client never sees).
// The session is bound to that backend for its life: when the backend
// goes, the client's connection is closed, never moved to another one.
//
// The backend is the one parked in slot (server_reuse: pools.go) when
// there is one that can still serve, else a new one; sig is the client's
// startup signature, under which the session parks it.
func (s *Server) open(raw, c net.Conn, st *startup, proof *Proof, log *zap.Logger, slot *pool.Slot, sig string) (*Session, error) {
	user, db := st.params["user"], st.params["database"]
	hj, born := s.takeParked(slot, user, log)
	warm := hj != nil
	var err error
	if !warm {
		hj, err = s.connectAs(s.primary, user, db, st.params, proof, nil)
		born = time.Now()
	}
	if err != nil {
		var pg *pgconn.PgError
		var pe *ProtocolError
		switch {
		case errors.As(err, &pg):
			log.Info("upstream refused connection", zap.Error(err))
			return nil, pg
		case errors.As(err, &pe):
			log.Info("upstream connection not authenticated", zap.Error(err))
			return nil, pe
		}
		if pe := resourceRefusal(err, "a connection to PostgreSQL"); pe != nil { // accept.go
			log.Warn("upstream connect failed: out of descriptors", zap.Error(err))
			return nil, pe
		}
		log.Warn("upstream connect failed", zap.Error(err))
		return nil, fmt.Errorf("%w: %w", errUpstream, err)
	}
	sess := &Session{
		srv:        s,
		User:       user,
		Database:   db,
		ClientAddr: c.RemoteAddr(),
		Params:     st.params,
		backend:    backend{server: hj.Conn, BackendPID: hj.PID, ServerParams: hj.ParameterStatuses},
		client:     c,
		log:        log.With(zap.Uint32("backend_pid", hj.PID)),
		proof:      proof,
		closing:    make(chan struct{}),
		upKey:      hj.SecretKey,
		born:       born,
		sig:        sig,
		warm:       warm,
	}
	sess.st.SetTx(hj.TxStatus)
	sess.lastServerType = 'Z' // its startup ended with ReadyForQuery
	size := s.cfg.BufferSize
	sess.cw = newClientWriter(c, size, s.rs != nil)
	sess.sw = bufio.NewWriterSize(hj.Conn, size)
	sess.cf = wire.Framer{R: bufio.NewReaderSize(c, size), Max: s.cfg.MaxMessageSize, Flush: sess.sw.Flush, From: "client", Client: true}
	if s.rs != nil {
		// sw switches between primary and replica (replica.go).
		sess.cf.Flush = func() error { return sess.sw.Flush() }
	}
	sess.sf = wire.Framer{R: bufio.NewReaderSize(hj.Conn, size), Flush: sess.cw.Flush, From: "server"}
	s.initSessionInfo(sess, c, hj.Conn) // admin.go

	secret := s.addCancelKey(hj)
	var out []byte
	names := make([]string, 0, len(hj.ParameterStatuses))
	for k := range hj.ParameterStatuses {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		out = encode(out, &pgproto3.ParameterStatus{Name: k, Value: hj.ParameterStatuses[k]})
	}
	var key [4]byte
	binary.BigEndian.PutUint32(key[:], secret)
	out = encode(out, &pgproto3.BackendKeyData{ProcessID: hj.PID, SecretKey: key[:]})
	out = encode(out, &pgproto3.ReadyForQuery{TxStatus: hj.TxStatus})
	sess.cancelPID, sess.cancelSecret = hj.PID, secret
	if s.cfg.Interceptor != nil {
		h, err := s.cfg.Interceptor.Open(sess)
		if err != nil {
			s.dropCancelKey(sess)
			hj.Conn.Close()
			return nil, err
		}
		sess.h = h
	}
	abandon := func() { // the session never runs: undo what Open did
		s.dropCancelKey(sess)
		if sess.h != nil {
			sess.h.Close(sess)
		}
		hj.Conn.Close()
	}
	if !s.track(raw, sess) {
		abandon()
		return nil, &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence is shutting down"}
	}
	if _, err := c.Write(out); err != nil {
		abandon()
		return nil, fmt.Errorf("client: %w", err)
	}
	c.SetDeadline(time.Time{})
	return sess, nil
}

// addCancelKey makes the cancel secret the client gets with the upstream
// backend's PID, and remembers the backend's real key. A backend PID is
// unique among the primary's live backends; an entry left by a session
// whose backend has exited and whose PID was reused is replaced.
func (s *Server) addCancelKey(hj *pgconn.HijackedConn) (secret uint32) {
	var b [4]byte
	rand.Read(b[:])
	secret = binary.BigEndian.Uint32(b[:])
	addr := hj.Conn.RemoteAddr()
	s.mu.Lock()
	s.cancels[uint64(hj.PID)] = cancelTarget{secret: secret, addr: addr, network: addr.Network(), pid: hj.PID, upKey: hj.SecretKey}
	s.mu.Unlock()
	return secret
}

// dropCancelKey forgets sess's cancel key, unless a newer session with a
// reused PID has replaced it.
func (s *Server) dropCancelKey(sess *Session) {
	s.mu.Lock()
	if t, ok := s.cancels[uint64(sess.cancelPID)]; ok && t.secret == sess.cancelSecret {
		delete(s.cancels, uint64(sess.cancelPID))
	}
	s.mu.Unlock()
}

// cancel forwards a client's CancelRequest to the upstream backend that
// serves it. Unknown keys are ignored, as PostgreSQL does.
func (s *Server) cancel(st *startup) {
	if s.cancelConsole(st) { // a console's ^C: admin.go
		return
	}
	s.mu.Lock()
	t, ok := s.cancels[uint64(st.cancelPID)]
	s.mu.Unlock()
	var want [4]byte
	binary.BigEndian.PutUint32(want[:], t.secret)
	if !ok || subtle.ConstantTimeCompare(want[:], st.cancelSecret) != 1 {
		s.log.Info("cancel request with unknown key ignored")
		return
	}
	t = s.cancelRoute(st.cancelPID, t) // the replica, while the session reads there (route.go)
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ConnectTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, t.network, t.addr.String())
	if err != nil {
		s.log.Warn("cancel: dial upstream", zap.Error(err))
		return
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(s.cfg.ConnectTimeout))
	pkt := make([]byte, 12, 12+len(t.upKey))
	binary.BigEndian.PutUint32(pkt[0:], uint32(12+len(t.upKey)))
	binary.BigEndian.PutUint32(pkt[4:], codeCancel)
	binary.BigEndian.PutUint32(pkt[8:], t.pid)
	pkt = append(pkt, t.upKey...)
	if _, err := c.Write(pkt); err != nil {
		s.log.Warn("cancel: write upstream", zap.Error(err))
		return
	}
	// PostgreSQL closes the connection once it has processed the request.
	io.Copy(io.Discard, c)
}
