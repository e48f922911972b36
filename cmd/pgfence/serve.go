package main

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/proxy"
)

func newServeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the PostgreSQL wire-protocol proxy",
		Long: `Run the pgfence proxy: clients connect to --listen as they would to
PostgreSQL; each session gets its own upstream connection to the primary as
the client's user and database.

The primary is --database (or --primary), else PGFENCE_PRIMARY, else primary
in the config file, else $PGFENCE_DATABASE_URL or $DATABASE_URL, else libpq's
PG* variables (PGHOST, PGPORT, ...): the same chain as every other command.

Every flag has a PGFENCE_* environment variable and a key in the TOML
--config file (same name, _ for -); flags beat the environment, which beats
the file. The file may also hold an [upstream_passwords] table mapping a
user to the password presented upstream for it. See docs/configuration.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, err := loadServeConfig(cmd)
			if err != nil {
				return configError(err)
			}
			log, level, err := buildLogger(cfg.LogLevel, cfg.LogFormat, jsonFlag(cmd), cmd.ErrOrStderr())
			if err != nil {
				return configError(err)
			}
			defer log.Sync()
			cfg.level = &level
			cfg.reload = func() (serveConfig, error) { return loadServeConfig(cmd) }
			return runServe(cmd.Context(), cfg, log)
		},
	}
	f := cmd.Flags()
	f.String("config", "", "TOML config file (PGFENCE_CONFIG)")
	f.String("listen", "", "address to listen on (PGFENCE_LISTEN; default 127.0.0.1:6432)")
	f.String("primary", "", "upstream primary DSN; the client's user and database replace its own (PGFENCE_PRIMARY; default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)")
	f.String("database", "", "the same as --primary, as every other command names the database")
	f.StringArray("replica", nil, "upstream replica DSN, repeatable; replica-eligible reads go there, see docs/reads.md (PGFENCE_REPLICA, comma-separated)")
	f.Bool("read-replicas", true, "route replica-eligible reads to the --replica servers (PGFENCE_READ_REPLICAS; default true when replicas are configured)")
	f.String("replica-poll", "", "how often replicas' replay positions are polled (PGFENCE_REPLICA_POLL; default 50ms)")
	f.String("replica-max-lag", "", "a replica whose replay lags more than this is out of rotation (PGFENCE_REPLICA_MAX_LAG; default 10s)")
	f.String("tls-cert", "", "PEM certificate offered to clients that ask for TLS (PGFENCE_TLS_CERT)")
	f.String("tls-key", "", "PEM private key for --tls-cert (PGFENCE_TLS_KEY)")
	f.String("auth", "", "client authentication: postgres (the role's password stored in PostgreSQL), scram (a users file) or trust (PGFENCE_AUTH; default postgres)")
	f.String("auth-file", "", `users file of "user" "SCRAM-SHA-256$..." lines, see pgfence passwd (PGFENCE_AUTH_FILE)`)
	f.String("auth-query", "", "query returning (user, password verifier) for $1, for auth postgres; see docs/proxy.md (PGFENCE_AUTH_QUERY; default reads pg_shadow)")
	f.Bool("allow-remote-trust", false, "let auth trust serve a non-loopback listen address: anyone who reaches it connects as any user (PGFENCE_ALLOW_REMOTE_TRUST)")
	f.Int("max-clients", 0, fmt.Sprintf("maximum concurrent clients (PGFENCE_MAX_CLIENTS; default %d)", proxy.DefaultMaxClients))
	f.Int("max-startup-clients", 0, fmt.Sprintf("maximum connections still in startup or authentication; beyond it the one waiting longest is closed (PGFENCE_MAX_STARTUP_CLIENTS; default %d)", proxy.DefaultMaxStartupClients))
	f.Int("max-console-clients", 0, fmt.Sprintf("maximum admin console sessions of each console user; negative for no limit (PGFENCE_MAX_CONSOLE_CLIENTS; default %d)", proxy.DefaultMaxConsoleClients))
	f.Int("default-pool-size", 0, "server connections of each database and user; a client over it waits (PGFENCE_DEFAULT_POOL_SIZE; default 0: no limit)")
	f.Int("reserve-pool-size", 0, "server connections more for a client that waited reserve_pool_timeout (PGFENCE_RESERVE_POOL_SIZE; default 0)")
	f.String("reserve-pool-timeout", "", "how long a client waits before the reserve is open to it (PGFENCE_RESERVE_POOL_TIMEOUT; default 5s)")
	f.Int("max-db-connections", 0, "server connections of each database, all users (PGFENCE_MAX_DB_CONNECTIONS; default 0: no limit)")
	f.Int("max-user-connections", 0, "server connections of each user, all databases (PGFENCE_MAX_USER_CONNECTIONS; default 0: no limit)")
	f.String("query-wait-timeout", "", "how long a client may wait for a server connection before 53300 (PGFENCE_QUERY_WAIT_TIMEOUT; default 120s; 0 means no bound)")
	f.Bool("server-reuse", false, "park a gated session's backend, reset with DISCARD ALL, when its client leaves it idle, for the next client with the same database, user and startup parameters (PGFENCE_SERVER_REUSE; default off)")
	f.String("server-idle-timeout", "", "close a parked backend after this long unused (PGFENCE_SERVER_IDLE_TIMEOUT; default 600s; 0 means no bound)")
	f.String("server-lifetime", "", "close a parked backend opened longer ago than this, less up to a tenth at random (PGFENCE_SERVER_LIFETIME; default 3600s; 0 means no bound)")
	f.String("client-memory", "", "one session's share of memory_budget for messages held whole, e.g. 128MiB (PGFENCE_CLIENT_MEMORY; default half of memory_budget)")
	f.String("message-timeout", "", "end a session whose client stops half-way through a message held whole for this long (PGFENCE_MESSAGE_TIMEOUT; default 60s)")
	f.String("max-message-size", "", "largest client message, e.g. 64MiB (PGFENCE_MAX_MESSAGE_SIZE; default 64MiB)")
	f.String("memory-budget", "", "memory all sessions may spend on client messages held whole, and the write gate's caches, e.g. 256MiB (PGFENCE_MEMORY_BUDGET; default 512MiB)")
	f.String("cache-memory", "", "of memory_budget, what the write gate's statement and plan caches may hold, e.g. 32MiB (PGFENCE_CACHE_MEMORY; default an eighth of memory_budget)")
	f.Bool("no-gate", false, "turn the write gate off: a plain pass-through proxy, protected tables guarded by their backstop trigger only (PGFENCE_NO_GATE)")
	f.Bool("no-event-loop", false, "deprecated: the same as --poller poll (every session is relayed by the event loop); see docs/proxy.md (PGFENCE_NO_EVENT_LOOP)")
	f.String("poller", "", "what the event loop waits in: epoll (Linux only) or poll (PGFENCE_POLLER; default epoll on Linux, poll elsewhere)")
	f.String("shutdown-timeout", "", "how long open transactions may run after SIGTERM (PGFENCE_SHUTDOWN_TIMEOUT; default 30s)")
	f.String("gate-idle-timeout", "", "end a session silent this long while its transaction holds a fence row (PGFENCE_GATE_IDLE_TIMEOUT; default 10s; keep it under the lease TTL; 0 means no bound)")
	f.StringSlice("admin-users", nil, "users allowed into the admin console, the virtual database pgfence (PGFENCE_ADMIN_USERS, comma-separated)")
	f.StringSlice("stats-users", nil, "users allowed the admin console's SHOW commands, without tokens (PGFENCE_STATS_USERS, comma-separated)")
	f.String("console-auth-file", "", `users file of the admin console's users, "user" "SCRAM-SHA-256$..." lines (pgfence passwd); without it the console refuses everyone (PGFENCE_CONSOLE_AUTH_FILE)`)
	f.String("metrics-listen", "", "address serving Prometheus /metrics, /healthz and /readyz, e.g. 127.0.0.1:9187 (PGFENCE_METRICS_LISTEN; default off)")
	return cmd
}

// runServe serves until ctx ends (SIGINT/SIGTERM), then shuts down
// gracefully.
func runServe(ctx context.Context, c serveConfig, log *zap.Logger) error {
	pc, err := c.proxyConfig()
	if err != nil {
		return configError(err)
	}
	if !c.NoGate {
		fc := proxy.FenceConfig{Primary: pc.Primary}
		if c.GateIdleTimeout != "" {
			d, err := parseDuration(c.GateIdleTimeout)
			if err != nil || d < 0 {
				return &exitError{code: exitConfig, msg: fmt.Sprintf("gate_idle_timeout: want a duration such as 10s, got %q", c.GateIdleTimeout)}
			}
			fc.GateIdleTimeout = d
			if d == 0 {
				fc.GateIdleTimeout = -1 // no bound
			}
		}
		if c.CacheMemory != "" {
			n, err := parseSizeUpTo(c.CacheMemory, 1<<40)
			budget := pc.MemoryBudget
			if budget == 0 {
				budget = proxy.DefaultMemoryBudget
			}
			if err != nil || n > budget {
				return &exitError{code: exitConfig, msg: fmt.Sprintf("cache_memory: want a size such as 64MiB, at most memory_budget (%d bytes), got %q", budget, c.CacheMemory)}
			}
			fc.CacheMemory = int64(n)
		}
		gate, err := proxy.NewFence(fc, log.Named("gate"))
		if err != nil {
			return configError(err)
		}
		defer gate.Close()
		pc.Interceptor = gate
	}
	pc.ExtraSettings = c.extraSettings()
	pc.Sources = c.sources
	pc.Reload = c.reloader(log) // reload.go
	srv, err := proxy.New(pc, log)
	if err != nil {
		return configError(err)
	}
	stopOps, err := c.startOps(srv, log) // reload.go: SIGHUP, metrics endpoint
	if err != nil {
		return err
	}
	defer stopOps()
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return listenError(c.Listen, "--listen", err)
	}
	log.Info("listening", zap.String("addr", ln.Addr().String()), zap.String("auth", string(pc.Auth)), zap.Bool("tls", pc.TLS != nil))
	// Warn now, not at the first session, when the control connections
	// would run as a superuser (docs/security.md, "pgfence's own SQL").
	go func() {
		if err := srv.CheckControlRole(ctx); err != nil {
			log.Debug("cannot check the primary DSN's role", zap.Error(err))
		}
	}()
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ctx, ln) }()
	select {
	case err := <-serveErr:
		if errors.Is(err, proxy.ErrServerClosed) {
			log.Info("shut down by the admin console")
			return nil
		}
		if ctx.Err() == nil {
			return err
		}
	case <-ctx.Done():
	}
	log.Info("shutting down: waiting for open transactions")
	if err := srv.Shutdown(context.Background()); err != nil {
		return err
	}
	log.Info("shut down")
	return nil
}
