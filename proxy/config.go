package proxy

import (
	"crypto/tls"
	"fmt"
	"slices"
	"time"
)

// AuthMethod is how the proxy authenticates its clients.
type AuthMethod string

const (
	// AuthPostgres authenticates each client against the password
	// PostgreSQL stores for the role it names (looked up with
	// Config.AuthQuery), with SCRAM-SHA-256 (md5 for an md5 verifier),
	// and connects upstream as that role with what the client proved.
	// A role without a password cannot log in. The default.
	AuthPostgres AuthMethod = "postgres"
	// AuthTrust accepts every client without a password. For local
	// development only: anyone who can reach the listener can connect as
	// any user the upstream lets the proxy connect as. Refused on a
	// non-loopback listener unless Config.AllowRemoteTrust.
	AuthTrust AuthMethod = "trust"
	// AuthSCRAM requires SCRAM-SHA-256 against the verifiers in
	// Config.Users (a users file).
	AuthSCRAM AuthMethod = "scram-sha-256"
)

// Defaults applied to zero-valued Config fields.
const (
	DefaultMaxClients = 1000
	// DefaultQueryWaitTimeout and DefaultReservePoolTimeout are
	// PgBouncer's defaults.
	DefaultQueryWaitTimeout   = 120 * time.Second
	DefaultReservePoolTimeout = 5 * time.Second
	DefaultMaxStartupClients  = 100
	DefaultMaxConsoleClients  = 10
	DefaultMaxMessageSize     = 64 << 20
	DefaultMemoryBudget       = 512 << 20
	DefaultShutdownTimeout    = 30 * time.Second
	DefaultStartupTimeout     = 15 * time.Second
	DefaultMessageTimeout     = 60 * time.Second
	DefaultConnectTimeout     = 10 * time.Second
	DefaultBufferSize         = 32 << 10
)

// DefaultServerIdleTimeout and DefaultServerLifetime are PgBouncer's
// server_idle_timeout and server_lifetime.
const (
	DefaultServerIdleTimeout = 600 * time.Second
	DefaultServerLifetime    = 3600 * time.Second
)

// Config configures a Server. The zero value of every field except Primary
// selects the documented default.
type Config struct {
	// Primary is the upstream primary as a libpq DSN or URL, parsed with
	// pgconn.ParseConfig. Its host, port, TLS settings, password and
	// connect_timeout are used; the database and user are replaced by
	// the ones each client asks for. Required.
	Primary string

	// Replicas are streaming replicas (DSNs as for Primary). With the
	// write gate as Interceptor, replica-eligible reads go to them (read
	// routing, DESIGN §6, docs/reads.md); without it they are unused.
	Replicas []string

	// NoReplicaReads keeps every read on the primary even with Replicas
	// configured (--read-replicas=false). False means reads may use them.
	NoReplicaReads bool

	// ReplicaPoll is how often each replica's replay position (and the
	// primary's WAL position) is polled. Zero means DefaultReplicaPoll
	// (50ms).
	ReplicaPoll time.Duration

	// ReplicaMaxLag takes a replica out of rotation while its replay is
	// more than this far behind the primary (in time: how long ago the
	// primary was at the first position it has not replayed). Zero means
	// DefaultReplicaMaxLag (10s).
	ReplicaMaxLag time.Duration

	// Auth is the client authentication method. Zero means
	// AuthPostgres: never trust.
	Auth AuthMethod

	// AuthQuery looks up a role's stored password for AuthPostgres: it
	// is run with the user name as $1 on a connection of the proxy's own,
	// as the Primary DSN's user in the DSN's database, and returns one
	// row (name, password) or none; a NULL password means the role cannot
	// log in. Zero means DefaultAuthQuery (pg_shadow: the DSN's user must
	// be a superuser; docs/proxy.md shows a SECURITY DEFINER function for
	// another user).
	AuthQuery string

	// AllowRemoteTrust lets AuthTrust serve a listener on a non-loopback
	// address. False means such a listener is refused by Serve, and a
	// client reaching the proxy on a non-loopback address is refused.
	AllowRemoteTrust bool

	// Users maps a user name to its SCRAM-SHA-256 verifier (the format
	// PostgreSQL stores in pg_authid.rolpassword, and that `pgfence
	// passwd` prints). Required when Auth is AuthSCRAM; a user missing
	// from it cannot log in. See LoadUsers.
	Users map[string]string

	// UpstreamPasswords maps a user name to the password the proxy
	// presents upstream for that user. Nil or a missing user means none,
	// except for the Primary DSN's own user, for whom the DSN's password
	// is presented (never for another name). With AuthPostgres the proxy
	// answers upstream with what the client proved and needs none.
	UpstreamPasswords map[string]string

	// TLS, when non-nil, is offered to clients that send SSLRequest.
	// Nil means SSLRequest is answered 'N' (no TLS to clients).
	TLS *tls.Config

	// MaxClients bounds concurrent authenticated client sessions;
	// excess clients get ErrorResponse 53300 too_many_connections once
	// they have authenticated. Connections still in startup or
	// authentication are bounded by MaxStartupClients instead, and admin
	// console sessions by MaxConsoleClients (the console stays reachable
	// with MaxClients sessions open). Zero means DefaultMaxClients;
	// negative means no limit.
	MaxClients int

	// Server connection limits, PgBouncer's (package pool). Each client
	// holds one server connection for its session (session mode); a
	// client over a limit waits, after authenticating, in the order the
	// clients of its pool (database and user) came, for at most
	// QueryWaitTimeout, then gets 53300. Zero means no limit (PgBouncer's
	// default_pool_size is 20). All reloadable: a waiting client is
	// judged by the limits in force.
	//
	// PoolSize bounds each pool's server connections
	// (default_pool_size); ReservePoolSize more are given to a client
	// that has waited ReservePoolTimeout (reserve_pool_size,
	// reserve_pool_timeout, default DefaultReservePoolTimeout).
	// MaxDBConnections and MaxUserConnections bound every pool of a
	// database, of a user (max_db_connections, max_user_connections).
	PoolSize           int
	ReservePoolSize    int
	ReservePoolTimeout time.Duration
	MaxDBConnections   int
	MaxUserConnections int
	// QueryWaitTimeout bounds a client's wait for a server connection
	// (query_wait_timeout): zero means DefaultQueryWaitTimeout, negative
	// no bound.
	QueryWaitTimeout time.Duration
	// ServerReuse parks a gated session's backend when its client leaves
	// it idle (Terminate with nothing in flight and no transaction
	// open), reset with DISCARD ALL, for the next client of the same
	// database and user whose startup parameters are exactly the same:
	// that client gets a warm backend instead of a fresh fork (session
	// pooling, pools.go). ServerIdleTimeout closes a backend parked
	// longer (server_idle_timeout; zero: DefaultServerIdleTimeout,
	// negative: no bound), ServerLifetime one opened longer ago, less
	// up to a tenth at random (server_lifetime; zero:
	// DefaultServerLifetime, negative: no bound). All reloadable.
	ServerReuse       bool
	ServerIdleTimeout time.Duration
	ServerLifetime    time.Duration

	// MaxConsoleClients bounds the authenticated admin console sessions
	// of each console user (admin and stats users alike): a further one
	// gets 53300 after authenticating, so one user's sessions cannot
	// take the proxy's file descriptors nor keep another console user
	// out. Zero means DefaultMaxConsoleClients (10); negative means no
	// limit.
	MaxConsoleClients int

	// MaxStartupClients bounds the connections still in startup or
	// authentication (from accept until authenticated, at most
	// StartupTimeout each). When a new connection would exceed it, the
	// one that has waited longest is closed with 53300 to make room
	// (startup_slots.go). Zero means DefaultMaxStartupClients (100);
	// negative means no limit.
	MaxStartupClients int

	// MaxMessageSize bounds the length of one client message (excluding
	// the type byte). A longer Query, Parse, Bind, FunctionCall or
	// CopyData is read and discarded (never held) and answered with an
	// ErrorResponse 54000 in its place, as PostgreSQL answers a failed
	// statement: a Query's session goes on, an extended-protocol message
	// fails its batch up to the Sync, a CopyData fails the COPY. Any other
	// message that long gets 08P01 and the session is closed. Messages
	// from the server are not bounded (the server is trusted, and
	// messages are streamed, not buffered). Zero means
	// DefaultMaxMessageSize (64 MiB); PostgreSQL itself refuses messages
	// over 1 GiB.
	MaxMessageSize int

	// MemoryBudget bounds the memory all sessions together spend on
	// client messages held whole: with an Interceptor (the write gate), a
	// Query, Parse, Bind or FunctionCall larger than BufferSize is read
	// whole before it is forwarded, and classifying it costs a few times
	// its size again, so each such message counts heldMessageCost (8)
	// times its length against the budget while it is held (the budget
	// bounds resident memory, garbage collection included). The budget is
	// taken before the message body is read; a message that does not fit
	// is read and dropped, its session gets ErrorResponse 53200 and is
	// closed, and no other session is affected. CopyData is streamed, in
	// pieces of at most BufferSize, and pass-through sessions stream
	// everything: neither counts. Zero means DefaultMemoryBudget
	// (512 MiB: one message of the default MaxMessageSize at a time).
	MemoryBudget int

	// ClientMemory is one session's share of MemoryBudget: the most its
	// held messages may take (at heldMessageCost times their length), so
	// that one client cannot take the budget from the others. A message
	// that would take more is read and dropped, its session gets
	// ErrorResponse 53200 naming client_memory and is closed. Zero means
	// half of MemoryBudget (with the defaults, held messages of up to
	// 32 MiB); more than MemoryBudget means MemoryBudget.
	ClientMemory int

	// MessageTimeout bounds how long a message held whole for the
	// Interceptor (one larger than BufferSize) may take to arrive once its
	// header has: a client that stops half-way has its session ended
	// (57P05) and the memory given back. Zero means
	// DefaultMessageTimeout (60s); negative means no bound.
	MessageTimeout time.Duration

	// ShutdownTimeout is how long Shutdown lets sessions in a transaction
	// (or with a request in flight) finish before closing them, when the
	// caller's context has no earlier deadline. Zero means
	// DefaultShutdownTimeout.
	ShutdownTimeout time.Duration

	// StartupTimeout bounds the client's startup and authentication
	// exchange. Zero means DefaultStartupTimeout.
	StartupTimeout time.Duration

	// ConnectTimeout bounds opening an upstream connection when the DSN
	// has no connect_timeout. Zero means DefaultConnectTimeout.
	ConnectTimeout time.Duration

	// BufferSize is the size of each of the four per-session read and
	// write buffers. Zero means DefaultBufferSize (32 KiB).
	BufferSize int

	// DisableEventLoop once relayed sessions with two goroutines each
	// instead of the event loop. There is one relay engine now, the
	// loop (evloop.go); for the diagnosis the switch was for (ruling
	// epoll out), it selects the poll poller.
	//
	// Deprecated: set Poller to "poll". With Poller "epoll" it is an
	// error.
	DisableEventLoop bool

	// Poller is what the event loop waits in (poller.go): "epoll" (Linux
	// only) or "poll" (poll(2), every Unix). Empty means epoll on Linux,
	// poll elsewhere. Another value, or "epoll" off Linux, is an error.
	Poller string

	// Interceptor, when non-nil, is given every session's messages; see
	// Interceptor. Nil means pure pass-through.
	Interceptor Interceptor

	// AdminUsers may use every command of the admin console (the virtual
	// database AdminDatabase), as PgBouncer's admin_users: PAUSE, KILL,
	// SET, RELOAD, SHUTDOWN, and the SHOW commands with fencing tokens.
	// They authenticate with SCRAM-SHA-256 against ConsoleUsers, whatever
	// Auth is. Nil means nobody.
	AdminUsers []string

	// StatsUsers may use the console's SHOW commands, which show them
	// everything but fencing tokens, as PgBouncer's stats_users. A user
	// in both lists is an admin. Nil means nobody.
	StatsUsers []string

	// ConsoleUsers maps a console user to its SCRAM-SHA-256 verifier
	// (the users file format of Users, see LoadUsers): the console's own
	// authentication, independent of Auth and Users. A console user must
	// also be listed in AdminUsers or StatsUsers. Nil means the console
	// refuses every connection (28000), whatever the lists say.
	ConsoleUsers map[string]string

	// HealthInterval is how often the primary is pinged for /readyz once
	// MetricsHandler is in use. Zero means DefaultHealthInterval.
	HealthInterval time.Duration

	// Reload, when non-nil, re-reads the configuration source (file,
	// environment) for ReloadFromSource: the admin console's RELOAD and
	// SIGHUP. It returns the new Config and what it applied or could not
	// apply itself (settings the proxy does not know, e.g. log level).
	// Nil means RELOAD answers that there is nothing to reload.
	Reload func() (Config, *ReloadReport, error)

	// ExtraSettings are shown by SHOW CONFIG after the proxy's own
	// (settings of the program around the proxy: metrics address, log
	// level). Not interpreted.
	ExtraSettings []Setting

	// Sources says where each setting's value came from, by its
	// configuration key (the file key: "listen", "max_clients", ...):
	// "flag", "env", "file" or "default". SHOW CONFIG shows it. Nil or a
	// missing key shows as "".
	Sources map[string]string
}

// Setting is a SHOW CONFIG line.
type Setting struct {
	Key, Value string
	Reloadable bool
	// Source is where the value came from: "flag", "env", "file",
	// "default", or "" when unknown.
	Source string
	// Default is the value used when the key is not set ("" when there
	// is none), SHOW CONFIG's default column.
	Default string
	// Set, when non-nil, applies a new value at once: the console's
	// SET key = value (until the next reload). Nil means SET refuses
	// the key.
	Set func(value string) error
}

// orDefault sets *v to def when it is zero or negative (unset).
func orDefault[T ~int | ~int64](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

func (c Config) withDefaults() (Config, error) {
	if c.Primary == "" {
		return c, fmt.Errorf("config: primary DSN is required")
	}
	if c.Auth == "" {
		c.Auth = AuthPostgres
	}
	if c.AuthQuery == "" {
		c.AuthQuery = DefaultAuthQuery
	}
	switch c.Auth {
	case AuthTrust, AuthPostgres:
	case AuthSCRAM, "scram":
		c.Auth = AuthSCRAM
		if len(c.Users) == 0 {
			return c, fmt.Errorf("config: auth %s needs a users file with at least one user", AuthSCRAM)
		}
		for u, v := range c.Users {
			if _, err := parseVerifier(v); err != nil {
				return c, fmt.Errorf("config: user %q: %w", u, err)
			}
		}
	default:
		return c, fmt.Errorf("config: unknown auth method %q (want postgres, scram-sha-256 or trust)", c.Auth)
	}
	if c.MaxClients == 0 {
		c.MaxClients = DefaultMaxClients
	}
	if c.MaxStartupClients == 0 {
		c.MaxStartupClients = DefaultMaxStartupClients
	}
	if c.MaxConsoleClients == 0 {
		c.MaxConsoleClients = DefaultMaxConsoleClients
	}
	orDefault(&c.MaxMessageSize, DefaultMaxMessageSize)
	orDefault(&c.MemoryBudget, DefaultMemoryBudget)
	if c.ClientMemory <= 0 {
		c.ClientMemory = c.MemoryBudget / 2
	}
	c.ClientMemory = min(c.ClientMemory, c.MemoryBudget)
	if c.MessageTimeout == 0 {
		c.MessageTimeout = DefaultMessageTimeout
	}
	if c.MaxMessageSize > 1<<30-4 {
		return c, fmt.Errorf("config: max message size %d is over PostgreSQL's own limit of 1GiB", c.MaxMessageSize)
	}
	for _, n := range []struct {
		name string
		v    int
	}{{"default_pool_size", c.PoolSize}, {"reserve_pool_size", c.ReservePoolSize}, {"max_db_connections", c.MaxDBConnections}, {"max_user_connections", c.MaxUserConnections}} {
		if n.v < 0 {
			return c, fmt.Errorf("config: %s %d: want 0 (no limit) or more", n.name, n.v)
		}
	}
	if c.QueryWaitTimeout == 0 {
		c.QueryWaitTimeout = DefaultQueryWaitTimeout // negative: no bound
	}
	orDefault(&c.ReservePoolTimeout, DefaultReservePoolTimeout)
	if c.ServerIdleTimeout == 0 {
		c.ServerIdleTimeout = DefaultServerIdleTimeout // negative: no bound
	}
	if c.ServerLifetime == 0 {
		c.ServerLifetime = DefaultServerLifetime // negative: no bound
	}
	orDefault(&c.ShutdownTimeout, DefaultShutdownTimeout)
	orDefault(&c.StartupTimeout, DefaultStartupTimeout)
	orDefault(&c.ConnectTimeout, DefaultConnectTimeout)
	orDefault(&c.BufferSize, DefaultBufferSize)
	if c.BufferSize < 1024 {
		c.BufferSize = 1024
	}
	orDefault(&c.ReplicaPoll, DefaultReplicaPoll)
	orDefault(&c.ReplicaMaxLag, DefaultReplicaMaxLag)
	orDefault(&c.HealthInterval, DefaultHealthInterval)
	for _, u := range append(slices.Clone(c.AdminUsers), c.StatsUsers...) {
		if u == "" {
			return c, fmt.Errorf("config: empty admin or stats user name")
		}
	}
	for u, v := range c.ConsoleUsers {
		if _, err := parseVerifier(v); err != nil {
			return c, fmt.Errorf("config: console user %q: %w", u, err)
		}
	}
	return c, nil
}
