package proxy

import (
	"context"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// This file holds the console's control of databases and sessions —
// PAUSE/RESUME, KILL, KILL_CLIENT, DISABLE/ENABLE, RECONNECT, WAIT_CLOSE,
// SHUTDOWN — and the hooks the relay calls for them.
//
// PAUSE drains new transactions, for a primary switchover: a session's
// next message that would start a transaction (the session idle, nothing
// in flight) waits until RESUME; transactions already running finish;
// PAUSE returns once no session of the paused database is inside a
// transaction or has a request in flight. New connections to a paused
// database wait after authentication, before the proxy connects upstream.
//
// The relay's side, for both kinds of session on the event loop
// (pass-through and intercepted), is one pair of calls around each client message: holdMessage before the
// message is looked at, releaseMessage once it has been handled. Between
// the two the session counts one more request in flight (Session.st), and
// holdMessage checks the pause only after that increment, while PAUSE
// sets the pause before it looks at the counts: whichever comes first, a
// message cannot start a transaction that PAUSE does not see (Go's
// atomics are sequentially consistent). A held message is not read any
// further: the event loop, which must not block, stops reading that client (its bytes stay
// where they are, the relay costs nothing while held) and RESUME posts the
// session back to the loop thread (admin_pause_loop.go).

// dbControl is the state of PAUSE, DISABLE, RECONNECT and the console
// commands that wait.
type dbControl struct {
	// active: a pause (of all or of some databases) is in effect; the
	// relays' cheap check (one atomic load per message).
	active atomic.Bool
	// waiters counts console commands waiting for sessions (PAUSE,
	// WAIT_CLOSE): while non-zero, sessions signal becoming idle and
	// ending.
	waiters atomic.Int32

	mu       sync.Mutex
	all      bool            // PAUSE without a database
	dbs      map[string]bool // PAUSE db, KILL db
	disabled map[string]bool // DISABLE db
	// resumed is closed (and replaced) at every RESUME: new clients
	// waiting to be admitted (admit) wait on it.
	resumed chan struct{}
	// parked are the event loop's held sessions, woken at the next
	// RESUME (each checks again, and parks again if still paused).
	parked []func()
	// changed is closed (and replaced) when a session becomes idle or
	// ends while a console command waits.
	changed chan struct{}
	// admitting are the new connections waiting for RESUME.
	admitting map[*admission]struct{}
	admitWG   sync.WaitGroup // the waiting new clients, until they are refused or go on
	stop      chan struct{}  // closed when the server shuts down
	stopped   bool
}

// admission is a new connection waiting for RESUME, as SHOW CLIENTS and
// SHOW POOLS show it.
type admission struct {
	id         uint64
	user, db   string
	addr, self net.Addr
	app        string
	since      time.Time
	mono       int64
}

func (p *dbControl) pausedLocked(db string) bool { return p.all || p.dbs[db] }

// paused reports whether db is paused now.
func (p *dbControl) paused(db string) bool {
	if !p.active.Load() {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pausedLocked(db)
}

// resumedChan returns the channel the next RESUME closes, or nil when db
// is not paused.
func (p *dbControl) resumedChan(db string) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.pausedLocked(db) {
		return nil
	}
	return made(&p.resumed)
}

// stopChan is closed when the server shuts down.
func (p *dbControl) stopChan() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stop == nil && p.stopped {
		close(made(&p.stop))
	}
	return made(&p.stop)
}

// changedChan returns a channel closed at the next idle transition or
// session end.
func (p *dbControl) changedChan() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return made(&p.changed)
}

// made returns the channel *c, made first when it is nil (the caller holds
// the lock that guards it).
func made(c *chan struct{}) chan struct{} {
	if *c == nil {
		*c = make(chan struct{})
	}
	return *c
}

// notify wakes the waiting console commands.
func (p *dbControl) notify() {
	if p.waiters.Load() == 0 {
		return
	}
	p.mu.Lock()
	if p.changed != nil {
		close(p.changed)
		p.changed = nil
	}
	p.mu.Unlock()
}

// wake ends the current pause wait: goroutines recheck, parked loop
// sessions are posted back to the loop. p.mu held; the returned
// functions are called after unlocking.
func (p *dbControl) wakeLocked() []func() {
	if p.resumed != nil {
		close(p.resumed)
		p.resumed = nil
	}
	p.active.Store(p.all || len(p.dbs) > 0)
	w := p.parked
	p.parked = nil
	return w
}

// ---------------------------------------------------------------------------
// The relay's hooks

// holdMessage is called before a client message of type typ is handled.
// It counts the message as in flight until releaseMessage, and reports
// true (having counted nothing) when the message must wait because it
// would start a transaction in a paused database: the caller waits
// (waitResume, or park on the event loop) and calls it again.
func (s *Session) holdMessage(typ byte) bool {
	if s.st.Add(1) != 1 || typ == 'X' {
		return false // something in flight, or shutting down, or leaving
	}
	p := &s.srv.ops.ctl
	if p.active.Load() && s.TxStatus() == 'I' && p.paused(s.Database) {
		s.releaseMessage(true)
		return true
	}
	if hs := s.info.holdSince.Swap(0); hs != 0 {
		s.info.stats.waitNs.Add(monoNow() - hs)
	}
	s.info.stats.beginQuery()
	return false
}

// releaseMessage ends what holdMessage counted. handled is false when the
// message stays to be handled again (the Handler waits for an answer on
// the loop, or it has not arrived whole): its query goes on.
func (s *Session) releaseMessage(handled bool) {
	if s.st.Add(-1) != 0 {
		return
	}
	if handled {
		s.idleNow()
	} else {
		s.srv.ops.ctl.notify()
	}
}

// readyForQuery is called at every ReadyForQuery from upstream, after
// the transaction status is stored and the in-flight count decremented
// to n.
func (s *Session) readyForQuery(n int64) {
	if n == 0 {
		s.idleNow()
	}
}

// idleNow: nothing is in flight any more.
func (s *Session) idleNow() {
	s.info.stats.endQuery(s.TxStatus())
	s.srv.ops.ctl.notify()
}

// park registers wake, to be called from any goroutine when the pause
// that held the session's message may have ended. It reports false, not
// registering, when the session's database is not paused any more (the
// caller goes on at once).
func (s *Session) park(wake func()) bool {
	p := &s.srv.ops.ctl
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.pausedLocked(s.Database) {
		return false
	}
	s.info.holdSince.CompareAndSwap(0, monoNow())
	p.parked = append(p.parked, wake)
	return true
}

// killedReason is what the client is told when the console ended its
// session (KILL, KILL_CLIENT, SHUTDOWN), or nil.
func (s *Session) killedReason() *ProtocolError { return s.info.killed.Load() }

// kill ends the session at once, telling the client why; its
// transaction, if any, rolls back.
func (s *Session) kill(why string) {
	s.info.killed.CompareAndSwap(nil, &ProtocolError{Code: "57P01", Msg: "terminating connection due to administrator command: " + why})
	s.closeServer()
}

// admit lets a new, authenticated client of db go on to connect
// upstream: it refuses a disabled database and waits while db is paused.
// It reports false when it has refused the client (and closed c).
func (s *Server) admit(c net.Conn, st *startup, log *zap.Logger) bool {
	p := &s.ops.ctl
	user, db := st.params["user"], st.params["database"]
	refuse := func(err error) bool {
		s.refuse(c, err, log, "client refused")
		return false
	}
	if err := p.refuseDisabled(db); err != nil {
		return refuse(err)
	}
	if !p.paused(db) {
		return true
	}
	a := &admission{id: s.ops.nextID.Add(1), user: user, db: db, addr: c.RemoteAddr(), self: c.LocalAddr(),
		app: st.params["application_name"], since: time.Now(), mono: monoNow()}
	shutdown := &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence is shutting down"}
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return refuse(shutdown)
	}
	if p.admitting == nil {
		p.admitting = map[*admission]struct{}{}
	}
	p.admitting[a] = struct{}{}
	// Shutdown waits for the refusal to be written (stopControl) before it
	// closes the connections still in startup, this one among them.
	p.admitWG.Add(1)
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.admitting, a)
		p.mu.Unlock()
		s.ops.dbStats.waited(db, monoNow()-a.mono)
		p.admitWG.Done()
	}()
	log.Info("database paused: the new client waits for RESUME")
	c.SetDeadline(time.Time{})
	stop := p.stopChan()
	for {
		ch := p.resumedChan(db)
		if ch == nil {
			break
		}
		select {
		case <-ch:
		case <-stop:
			return refuse(shutdown)
		}
	}
	c.SetDeadline(time.Now().Add(s.cfg.StartupTimeout))
	if err := p.refuseDisabled(db); err != nil {
		return refuse(err)
	}
	return true
}

// refuseDisabled is the error for a new client of a disabled database.
func (p *dbControl) refuseDisabled(db string) error {
	p.mu.Lock()
	off := p.disabled[db]
	p.mu.Unlock()
	if !off {
		return nil
	}
	return &ProtocolError{Code: "55000", Msg: fmt.Sprintf("database %q is not currently accepting connections: an admin ran DISABLE on the pgfence console (ENABLE lifts it)", db)}
}

// sessionEnded is called once a session's relay has ended.
func (s *Server) sessionEnded(sess *Session) {
	s.ops.dbStats.sessionEnded(sess)
	s.ops.ctl.notify()
}

// stopControl ends every wait of the console's commands and of new
// clients: the server is shutting down. It returns once the new clients
// that waited for RESUME have been told (57P01).
func (s *Server) stopControl() {
	p := &s.ops.ctl
	p.mu.Lock()
	p.stopped = true
	if p.stop != nil {
		select {
		case <-p.stop:
		default:
			close(p.stop)
		}
	}
	p.mu.Unlock()
	p.admitWG.Wait()
}

// ---------------------------------------------------------------------------
// The commands

// sessionsOf returns the open sessions of db, or all of them for "".
func (s *Server) sessionsOf(db string) []*Session {
	var out []*Session
	for _, ss := range s.sessions() {
		if (db == "" || ss.Database == db) && !ss.info.ended.Load() {
			out = append(out, ss)
		}
	}
	return out
}

// waitFor waits until cond holds, re-checking when a session becomes idle
// or ends; the console's cancel request or the server's shutdown end the
// wait early (err 57014 or 57P01).
func (s *Server) waitFor(con *console, cond func() bool) *pgproto3.ErrorResponse {
	p := &s.ops.ctl
	p.waiters.Add(1)
	defer p.waiters.Add(-1)
	stop := p.stopChan()
	for {
		ch := p.changedChan() // before checking: no change is missed
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-con.cancel:
			return adminError("57014", "canceling statement due to user request", "")
		case <-stop:
			return adminError("57P01", "terminating connection: pgfence is shutting down", "")
		}
	}
}

// drained reports whether no session of db ("" all) is inside a
// transaction or has a request in flight.
func (s *Server) drained(db string) bool {
	for _, ss := range s.sessionsOf(db) {
		if ss.st.Pending() > 0 || ss.TxStatus() != 'I' {
			return false
		}
	}
	return true
}

func (s *Server) cmdPause(con *console, db string) *pgproto3.ErrorResponse {
	if db == AdminDatabase {
		return adminError("55000", "cannot pause admin db: "+db, "")
	}
	p := &s.ops.ctl
	p.mu.Lock()
	if p.all {
		p.mu.Unlock()
		return adminError("55000", "already suspended/paused", "RESUME ends the pause")
	}
	if db == "" {
		p.all = true
	} else {
		if p.dbs == nil {
			p.dbs = map[string]bool{}
		}
		p.dbs[db] = true
	}
	p.active.Store(true)
	p.mu.Unlock()
	con.log.Info("PAUSE command issued", zap.String("paused", orAll(db)))
	if err := s.waitFor(con, func() bool { return s.drained(db) }); err != nil {
		if err.Code == "57014" {
			// As PgBouncer: a PAUSE given up resumes.
			p.mu.Lock()
			if db == "" {
				p.all = false
			} else {
				delete(p.dbs, db)
			}
			w := p.wakeLocked()
			p.mu.Unlock()
			runAll(w)
			con.log.Info("PAUSE canceled: resumed", zap.String("paused", orAll(db)))
			err.Hint = "the pause was lifted"
		}
		return err
	}
	con.log.Info("paused: no transaction open", zap.String("paused", orAll(db)))
	return nil
}

func orAll(db string) string {
	if db == "" {
		return "(all)"
	}
	return db
}

func runAll(fs []func()) {
	for _, f := range fs {
		f()
	}
}

func (s *Server) cmdResume(con *console, db string) *pgproto3.ErrorResponse {
	p := &s.ops.ctl
	p.mu.Lock()
	switch {
	case s.draining.Load():
		p.mu.Unlock()
		return adminError("55000", "pooler is shutting down", "")
	case db == "" && !p.all:
		paused := sortedKeys(p.dbs)
		p.mu.Unlock()
		hint := ""
		if len(paused) > 0 {
			hint = "paused databases (RESUME each): " + strings.Join(paused, ", ")
		}
		return adminError("55000", "pooler is not paused/suspended", hint)
	case db == "":
		p.all = false
	case !p.dbs[db]:
		p.mu.Unlock()
		return adminError("55000", fmt.Sprintf("database %s is not paused", db), "")
	default:
		delete(p.dbs, db)
	}
	w := p.wakeLocked()
	p.mu.Unlock()
	runAll(w)
	con.log.Info("RESUME command issued", zap.String("resumed", orAll(db)))
	return nil
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k, v := range m {
		if v {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

// cmdKill ends every session of db (or of every database) at once and
// pauses the database(s), as PgBouncer's KILL: new clients wait for
// RESUME db.
func (s *Server) cmdKill(con *console, db string) *pgproto3.ErrorResponse {
	if db == AdminDatabase {
		return adminError("55000", "cannot kill admin db: "+db, "")
	}
	p := &s.ops.ctl
	sess := s.sessionsOf(db)
	p.mu.Lock()
	if p.all {
		p.mu.Unlock()
		return adminError("55000", "already suspended/paused", "")
	}
	if p.dbs == nil {
		p.dbs = map[string]bool{}
	}
	if db != "" {
		p.dbs[db] = true
	}
	for _, ss := range sess {
		p.dbs[ss.Database] = true
	}
	p.active.Store(len(p.dbs) > 0)
	p.mu.Unlock()
	for _, ss := range sess {
		ss.kill("KILL on the pgfence console")
	}
	con.log.Info("KILL command issued", zap.String("database", orAll(db)), zap.Int("sessions", len(sess)))
	return nil
}

func (s *Server) cmdKillClient(con *console, arg string) *pgproto3.ErrorResponse {
	var id uint64
	if _, err := fmt.Sscanf(arg, "%d", &id); err != nil || arg == "" {
		return adminError("22023", "invalid client pointer supplied", "give the id column of SHOW CLIENTS")
	}
	for _, ss := range s.sessionsOf("") {
		if ss.info.id == id && ss.killedReason() == nil {
			ss.kill("KILL_CLIENT on the pgfence console")
			con.log.Info("KILL_CLIENT command issued", zap.Uint64("id", id), zap.String("user", ss.User), zap.String("database", ss.Database))
			return nil
		}
	}
	return adminError("42704", "client not found", "give the id column of SHOW CLIENTS")
}

func (s *Server) cmdDisable(con *console, db string, on bool) *pgproto3.ErrorResponse {
	verb := map[bool]string{true: "disable", false: "enable"}[on]
	switch {
	case db == "":
		return adminError("42601", "a database is required", "")
	case db == AdminDatabase:
		return adminError("55000", fmt.Sprintf("cannot %s admin db: %s", verb, db), "")
	}
	p := &s.ops.ctl
	p.mu.Lock()
	if on {
		if p.disabled == nil {
			p.disabled = map[string]bool{}
		}
		p.disabled[db] = true
	} else {
		delete(p.disabled, db)
	}
	p.mu.Unlock()
	con.log.Info(strings.ToUpper(verb)+" command issued", zap.String("database", db))
	return nil
}

// cmdReconnect marks the server connections of db for closing once they
// are released: in session mode, when their client leaves (WAIT_CLOSE
// waits for that).
func (s *Server) cmdReconnect(con *console, db string) *pgproto3.ErrorResponse {
	if db == AdminDatabase {
		return adminError("55000", "cannot reconnect admin db: "+db, "")
	}
	for _, ss := range s.sessionsOf(db) {
		ss.info.closeNeeded.Store(true) // not parked either (mayKeepServer)
	}
	s.pools.CloseIdleOf(db) // server_reuse's parked ones (round 28, BK-M1)
	con.log.Info("RECONNECT command issued", zap.String("database", orAll(db)))
	return nil
}

func (s *Server) cmdWaitClose(con *console, db string) *pgproto3.ErrorResponse {
	if db == AdminDatabase {
		return adminError("55000", "cannot wait in admin db: "+db, "")
	}
	con.log.Info("WAIT_CLOSE command issued", zap.String("database", orAll(db)))
	return s.waitFor(con, func() bool {
		for _, ss := range s.sessionsOf(db) {
			if ss.info.closeNeeded.Load() {
				return false
			}
		}
		return true
	})
}

// cmdShutdown starts the server's shutdown once the answer is sent:
// immediate (SHUTDOWN: every session is closed now, transactions roll
// back) or graceful (SHUTDOWN WAIT_FOR_SERVERS, as SIGTERM: transactions
// finish, up to shutdown_timeout). Serve returns when it is done.
func (s *Server) cmdShutdown(con *console, mode string) (func(), *pgproto3.ErrorResponse) {
	switch mode {
	case "", "WAIT_FOR_SERVERS":
	case "WAIT_FOR_CLIENTS":
		return nil, adminError("0A000", "SHUTDOWN WAIT_FOR_CLIENTS is not supported by pgfence",
			"SHUTDOWN WAIT_FOR_SERVERS lets open transactions finish (as SIGTERM), SHUTDOWN closes every session now")
	default:
		return nil, adminError("42601", fmt.Sprintf("invalid command 'SHUTDOWN %s', use SHOW HELP;", mode), "")
	}
	s.ops.shutdownMu.Lock()
	defer s.ops.shutdownMu.Unlock()
	if s.ops.shutdownDone != nil || s.draining.Load() {
		return nil, adminError("55000", "pooler is shutting down", "")
	}
	done := make(chan struct{})
	s.ops.shutdownDone = done
	con.log.Info("SHUTDOWN command issued", zap.String("mode", mode))
	return func() {
		go func() {
			defer close(done)
			ctx := context.Background()
			if mode == "" {
				for _, ss := range s.sessionsOf("") {
					ss.info.killed.CompareAndSwap(nil, &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence SHUTDOWN on the admin console"})
				}
				c, cancel := context.WithCancel(ctx)
				cancel()
				ctx = c
			}
			if err := s.Shutdown(ctx); err != nil {
				s.log.Info("shutdown from the admin console", zap.Error(err))
			}
		}()
	}, nil
}

// waitConsoleShutdown blocks until a shutdown the console started has
// finished (Serve returns after it).
func (s *Server) waitConsoleShutdown() {
	s.ops.shutdownMu.Lock()
	done := s.ops.shutdownDone
	s.ops.shutdownMu.Unlock()
	if done != nil {
		<-done
	}
}
