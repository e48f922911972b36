package proxy

import (
	"context"
	"reflect"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ownsql"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// pgfence's own SQL (docs/security.md, "pgfence's own SQL"). Every query
// text the proxy sends on its own behalf is registered here with own, on
// one of two kinds of connection:
//
//   - onControl: the proxy's control connections (the catalog watcher, the
//     replica pollers, SHOW FENCES, the auth lookup) connect as the
//     primary's (or a replica's) DSN user, often a superuser, into
//     databases clients name. They are opened by dialControl, which pins
//     their settings (ownsql.PinReadOnly), and read schema fence only
//     after ownsql.Check has found it a superuser's.
//   - onSession: the steps the gate and the read router add to a client's
//     own session run as the client, under the search_path and with the
//     objects the client controls; they cannot raise its rights, but an
//     object found by an unqualified name could make them lie to the proxy.
//
// Either way every function, operator, type and relation in the text is
// named by its schema: TestOwnSQLQualified parses every registered text
// and fails on a name without one, and TestBypass/control/every_text runs
// each of them in a database booby-trapped by a worker and finds it in
// the server's statement log.

// ownWhere is where an own text runs.
type ownWhere int

const (
	onControl ownWhere = iota
	onSession
)

// ownText is one registered text. For a text built per use (a literal
// spliced in), sql is one instance of it and match the part every
// instance shares, by which a statement log shows it.
type ownText struct {
	name  string
	where ownWhere
	sql   string
	match string
	// drivenBy: the test that runs it, when every_text cannot.
	drivenBy string
}

var ownTexts []ownText

// own registers sql, a text sent as it is, and returns it.
func own(name string, where ownWhere, sql string) string {
	ownTexts = append(ownTexts, ownText{name: name, where: where, sql: sql, match: sql})
	return sql
}

// ownTemplate registers a text built per use: sample is one instance,
// match what every instance contains.
func ownTemplate(name string, where ownWhere, sample, match string) {
	ownTexts = append(ownTexts, ownText{name: name, where: where, sql: sample, match: match})
}

// The texts of the gate's steps on the client's session, built in
// rewrite/plan and proxy/fence_text.go.
func init() {
	for _, s := range plan.Statements {
		own("gate statement "+s.Name, onSession, s.SQL)
	}
	g := sampleGeneration
	ownTemplate("gate step (simple protocol)", onSession, plan.GateSQL(g), "SELECT fence.gate(E'")
	ownTemplate("receipt step (simple protocol)", onSession, plan.CommitSQL(true, g, []byte{1}, "v"), "SELECT fence.commit(E'")
	ownTemplate("receipt step if written (simple protocol)", onSession, plan.CommitSQL(false, g, []byte{1}, "v"), "SELECT fence.commit_if_written(E'")
	own("receipt savepoint's end (simple protocol)", onSession, plan.RestoreSQL)
	ownTemplate("refusal", onSession, plan.RaiseSQL(&fence.Error{Code: "FN013", Message: "m"}), "DO $pgfence$BEGIN RAISE EXCEPTION USING ERRCODE = E'")
	own("settings read-back", onSession, settingsSQL)
	own("commit_lsn", onSession, insertLSNQuery)
	ownTemplate("replica fence-row check (replica_reached)", onSession, fenceCheckQuery(requirement{job: "job", token: 2, epoch: 1}, true),
		"SELECT (CASE WHEN fence.replica_reached(E'")
	ownTemplate("replica fence-row check (fence.fences)", onSession, fenceCheckQuery(requirement{job: "job", token: 2}, false),
		"SELECT coalesce((SELECT f.max_issued_token FROM fence.fences AS f WHERE f.job_key OPERATOR(pg_catalog.=) E'")
	own("end of a transaction a gate step failed", onSession, "ROLLBACK")
	own("commit of a wrapped COPY", onSession, "COMMIT")
	ownTemplate("no fence schema probe (FN014)", onSession, noSchemaProbe(&fence.Error{Code: "FN014", Message: "m", Hint: "h"}),
		"DO $pgfence$BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r")
	ownDrivenBy("replica lexing: standard_conforming_strings", onSession, "SET standard_conforming_strings = off", "TestBypass/replstate")
	ownDrivenBy("replica lexing: client_encoding", onSession, "SET client_encoding = 'LATIN1'", "TestBypass/replstate")
	ownDrivenBy("read-only replica transaction's isolation and cursors", onSession, showIsolation, "TestBypass/rotx (it needs a lagging replica)")
	ownDrivenBy("replica session's held cursors", onSession, heldCursorsQuery, "TestBypass/cursor_code (it needs a held cursor and a takeover)")
}

// ownDrivenBy registers a text the trapped database of every_text does
// not drive (it needs a lagging replica, or a read-only transaction on
// the replica whose lexing settings the client changed, or it runs in the
// primary DSN's database) and names the test that does. Such a text on a
// client's session must name nothing PostgreSQL looks up
// (TestOwnDrivenByNamesNothing); every text is qualified
// (TestOwnSQLQualified), which is what holds on a control connection,
// whose search_path is pinned too.
func ownDrivenBy(name string, where ownWhere, sql, test string) string {
	ownTexts = append(ownTexts, ownText{name: name, where: where, sql: sql, match: sql, drivenBy: test})
	return sql
}

// sampleGeneration instantiates the templates (every_text drives job
// "job").
var sampleGeneration = fence.Generation{JobKey: "job", Epoch: 1, Token: 2}

// dialControl opens a control connection: cfg (a copy of the primary's or
// a replica's DSN settings) into db, named app in pg_stat_activity, its
// settings pinned (ownsql.PinReadOnly) so that nothing the database's
// owner, a role's settings or the DSN's options set can change what its
// SQL means. It warns once per process when the DSN's user is a superuser.
// setup, when not nil, adds to the configuration (a notification handler).
func dialControl(ctx context.Context, base *pgconn.Config, db, app string, log *zap.Logger, setup func(*pgconn.Config)) (*pgconn.PgConn, error) {
	cfg := controlConfig(base, db, app)
	if setup != nil {
		setup(cfg)
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	warnSuperuser(conn, cfg.User, log)
	return conn, nil
}

// controlConfig is dialControl's configuration.
func controlConfig(base *pgconn.Config, db, app string) *pgconn.Config {
	cfg := base.Copy()
	if db != "" {
		cfg.Database = db
	}
	if app != "" {
		cfg.RuntimeParams["application_name"] = app
	}
	ownsql.PinReadOnly(cfg.RuntimeParams)
	// target_session_attrs read-write and read-only ask SHOW
	// transaction_read_only, which the pinned default_transaction_read_only
	// makes on everywhere: a primary DSN listing a cluster's nodes with
	// read-write (how the proxy follows a promotion) found no server, and
	// read-only took the primary. What they mean here is the server's
	// role: not in recovery, in recovery.
	switch funcID(cfg.ValidateConnect) {
	case funcID(pgconn.ValidateConnectTargetSessionAttrsReadWrite):
		cfg.ValidateConnect = pgconn.ValidateConnectTargetSessionAttrsPrimary
	case funcID(pgconn.ValidateConnectTargetSessionAttrsReadOnly):
		cfg.ValidateConnect = pgconn.ValidateConnectTargetSessionAttrsStandby
	}
	return cfg
}

// funcID identifies a top-level function (0 for nil).
func funcID(f pgconn.ValidateConnectFunc) uintptr {
	if f == nil {
		return 0
	}
	return reflect.ValueOf(f).Pointer()
}

// superuserWarned: the control users already warned about.
var superuserWarned sync.Map

// warnSuperuser logs, once per process and user, that conn runs as a
// superuser (PostgreSQL reports is_superuser at the start of every
// session).
func warnSuperuser(conn *pgconn.PgConn, user string, log *zap.Logger) {
	if conn.ParameterStatus("is_superuser") != "on" || log == nil {
		return
	}
	if _, dup := superuserWarned.LoadOrStore(user, true); dup {
		return
	}
	log.Warn("the proxy's control connections run as a superuser; give the primary DSN a login role that is a member of pgfence_control instead (docs/security.md, \"pgfence's own SQL\"); auth postgres then needs a lookup function (docs/proxy.md, \"Who may connect\")",
		zap.String("user", user))
}

// CheckControlRole connects once as the primary DSN's user, in the DSN's
// database, and warns (once) when that user is a superuser: pgfence serve
// calls it when it starts.
func (s *Server) CheckControlRole(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout+5*time.Second)
	defer cancel()
	conn, err := dialControl(ctx, s.primary, "", "pgfence control check", s.log, nil)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}
