package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"strconv"
	"strings"
	"syscall"

	"github.com/BurntSushi/toml"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pgfence/pgfence/proxy"
)

// serveConfig is `pgfence serve`'s configuration. Each key can come from
// the TOML file (key as tagged), the environment (PGFENCE_ + upper-case
// key) or a flag (key with - for _); flags win over the environment, the
// environment over the file, the file over the defaults.
type serveConfig struct {
	Listen            string            `toml:"listen"`
	Primary           string            `toml:"primary"`
	Replicas          []string          `toml:"replicas"`
	TLSCert           string            `toml:"tls_cert"`
	TLSKey            string            `toml:"tls_key"`
	Auth              string            `toml:"auth"`
	AuthFile          string            `toml:"auth_file"`
	AuthQuery         string            `toml:"auth_query"`
	AllowRemoteTrust  bool              `toml:"allow_remote_trust"`
	MaxClients        int               `toml:"max_clients"`
	MaxMessageSize    string            `toml:"max_message_size"`
	MemoryBudget      string            `toml:"memory_budget"`
	ShutdownTimeout   string            `toml:"shutdown_timeout"`
	GateIdleTimeout   string            `toml:"gate_idle_timeout"`
	UpstreamPasswords map[string]string `toml:"upstream_passwords"`
	// NoGate turns the write gate off: a plain pass-through proxy (for
	// measuring the proxy alone). Protected tables then rely on their
	// backstop trigger only, without commit receipts.
	NoGate bool `toml:"no_gate"`
	// NoEventLoop relays every session with goroutines instead of the
	// event loop thread (docs/proxy.md, "The event loop").
	NoEventLoop bool `toml:"no_event_loop"`
	// AdminUsers may use the admin console (psql ... pgfence).
	AdminUsers []string `toml:"admin_users"`
	// StatsUsers may use its SHOW commands, without fencing tokens.
	StatsUsers []string `toml:"stats_users"`
	// ConsoleAuthFile holds the console users' SCRAM verifiers.
	ConsoleAuthFile string `toml:"console_auth_file"`
	// MetricsListen serves /metrics, /healthz and /readyz when set.
	MetricsListen string `toml:"metrics_listen"`
	// LogLevel as the root --log-level (PGFENCE_LOG_LEVEL); reloadable.
	LogLevel string `toml:"log_level"`
	// LogFormat as the root --log-format (PGFENCE_LOG_FORMAT): text, json
	// or auto (text on a terminal).
	LogFormat string `toml:"log_format"`

	// Set by the serve command for SIGHUP / RELOAD (reload.go).
	reload func() (serveConfig, error)
	level  *zap.AtomicLevel
	// sources says where each key's value came from: "flag", "env",
	// "file" or "default" (SHOW CONFIG).
	sources map[string]string
	// Read routing (serve_replicas.go, docs/reads.md).
	ReadReplicas  *bool  `toml:"read_replicas"`
	ReplicaPoll   string `toml:"replica_poll"`
	ReplicaMaxLag string `toml:"replica_max_lag"`
}

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
			log, level, err := serveLogger(cfg.LogLevel, cfg.LogFormat, jsonFlag(cmd), cmd.ErrOrStderr())
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
	addReplicaFlags(f) // serve_replicas.go
	f.String("tls-cert", "", "PEM certificate offered to clients that ask for TLS (PGFENCE_TLS_CERT)")
	f.String("tls-key", "", "PEM private key for --tls-cert (PGFENCE_TLS_KEY)")
	f.String("auth", "", "client authentication: postgres (the role's password stored in PostgreSQL), scram (a users file) or trust (PGFENCE_AUTH; default postgres)")
	f.String("auth-file", "", `users file of "user" "SCRAM-SHA-256$..." lines, see pgfence passwd (PGFENCE_AUTH_FILE)`)
	f.String("auth-query", "", "query returning (user, password verifier) for $1, for auth postgres; see docs/proxy.md (PGFENCE_AUTH_QUERY; default reads pg_shadow)")
	f.Bool("allow-remote-trust", false, "let auth trust serve a non-loopback listen address: anyone who reaches it connects as any user (PGFENCE_ALLOW_REMOTE_TRUST)")
	f.Int("max-clients", 0, fmt.Sprintf("maximum concurrent clients (PGFENCE_MAX_CLIENTS; default %d)", proxy.DefaultMaxClients))
	f.String("max-message-size", "", "largest client message, e.g. 64MiB (PGFENCE_MAX_MESSAGE_SIZE; default 64MiB)")
	f.String("memory-budget", "", "memory all sessions may spend on client messages held whole, e.g. 256MiB (PGFENCE_MEMORY_BUDGET; default 256MiB)")
	f.Bool("no-gate", false, "turn the write gate off: a plain pass-through proxy, protected tables guarded by their backstop trigger only (PGFENCE_NO_GATE)")
	f.Bool("no-event-loop", false, "relay every session with goroutines instead of the event loop thread; see docs/proxy.md (PGFENCE_NO_EVENT_LOOP)")
	f.String("shutdown-timeout", "", "how long open transactions may run after SIGTERM (PGFENCE_SHUTDOWN_TIMEOUT; default 30s)")
	f.String("gate-idle-timeout", "", "end a session silent this long while its transaction holds a fence row (PGFENCE_GATE_IDLE_TIMEOUT; default 10s; keep it under the lease TTL; 0 means no bound)")
	f.StringSlice("admin-users", nil, "users allowed into the admin console, the virtual database pgfence (PGFENCE_ADMIN_USERS, comma-separated)")
	f.StringSlice("stats-users", nil, "users allowed the admin console's SHOW commands, without tokens (PGFENCE_STATS_USERS, comma-separated)")
	f.String("console-auth-file", "", `users file of the admin console's users, "user" "SCRAM-SHA-256$..." lines (pgfence passwd); without it the console refuses everyone (PGFENCE_CONSOLE_AUTH_FILE)`)
	f.String("metrics-listen", "", "address serving Prometheus /metrics, /healthz and /readyz, e.g. 127.0.0.1:9187 (PGFENCE_METRICS_LISTEN; default off)")
	return cmd
}

// loadServeConfig merges defaults, file, environment and flags, and
// records where each key's value came from in cfg.sources.
func loadServeConfig(cmd *cobra.Command) (serveConfig, error) {
	cfg := serveConfig{Listen: "127.0.0.1:6432", sources: map[string]string{}}
	path, _ := cmd.Flags().GetString("config")
	if path == "" {
		path = os.Getenv("PGFENCE_CONFIG")
	}
	if path != "" {
		md, err := toml.DecodeFile(path, &cfg)
		if err != nil {
			return cfg, fmt.Errorf("config %s: %s", path, oneLine(err))
		}
		if und := md.Undecoded(); len(und) > 0 {
			return cfg, fmt.Errorf("config %s: unknown key %q", path, und[0].String())
		}
		for _, k := range md.Keys() {
			if len(k) == 1 {
				cfg.sources[k[0]] = "file"
			}
		}
	}
	str := func(key string, dst *string) {
		if v, ok := os.LookupEnv("PGFENCE_" + strings.ToUpper(strings.ReplaceAll(key, "-", "_"))); ok {
			*dst = v
			cfg.from(key, "env")
		}
		if cmd.Flags().Changed(key) {
			*dst, _ = cmd.Flags().GetString(key)
			cfg.from(key, "flag")
		}
	}
	str("listen", &cfg.Listen)
	str("primary", &cfg.Primary)
	if cmd.Flags().Changed("database") {
		if cmd.Flags().Changed("primary") {
			return cfg, errors.New("serve: --database and --primary name the same setting: give one")
		}
		cfg.Primary, _ = cmd.Flags().GetString("database")
		cfg.from("primary", "flag")
	}
	str("tls-cert", &cfg.TLSCert)
	str("tls-key", &cfg.TLSKey)
	str("auth", &cfg.Auth)
	str("auth-file", &cfg.AuthFile)
	str("auth-query", &cfg.AuthQuery)
	str("max-message-size", &cfg.MaxMessageSize)
	str("memory-budget", &cfg.MemoryBudget)
	str("shutdown-timeout", &cfg.ShutdownTimeout)
	str("gate-idle-timeout", &cfg.GateIdleTimeout)
	if v, ok := os.LookupEnv("PGFENCE_REPLICA"); ok {
		cfg.Replicas = splitList(v)
		cfg.from("replicas", "env")
	}
	if cmd.Flags().Changed("replica") {
		cfg.Replicas, _ = cmd.Flags().GetStringArray("replica")
		cfg.from("replicas", "flag")
	}
	if v, ok := os.LookupEnv("PGFENCE_MAX_CLIENTS"); ok {
		n, err := strconv.Atoi(v)
		if err != nil {
			return cfg, fmt.Errorf("PGFENCE_MAX_CLIENTS: %w", err)
		}
		cfg.MaxClients = n
		cfg.from("max_clients", "env")
	}
	if cmd.Flags().Changed("max-clients") {
		cfg.MaxClients, _ = cmd.Flags().GetInt("max-clients")
		cfg.from("max_clients", "flag")
	}
	for key, dst := range map[string]*bool{"no-gate": &cfg.NoGate, "no-event-loop": &cfg.NoEventLoop, "allow-remote-trust": &cfg.AllowRemoteTrust} {
		env := "PGFENCE_" + strings.ToUpper(strings.ReplaceAll(key, "-", "_"))
		if v, ok := os.LookupEnv(env); ok {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return cfg, fmt.Errorf("%s: %w", env, err)
			}
			*dst = b
			cfg.from(key, "env")
		}
		if cmd.Flags().Changed(key) {
			*dst, _ = cmd.Flags().GetBool(key)
			cfg.from(key, "flag")
		}
	}
	if err := loadOpsConfig(cmd, &cfg); err != nil { // reload.go
		return cfg, err
	}
	if err := loadReplicaConfig(cmd, &cfg); err != nil { // serve_replicas.go
		return cfg, err
	}
	if cfg.Primary == "" {
		// The chain every command uses for its database.
		if v := databaseFromEnv(); v != "" {
			cfg.Primary = v
			cfg.from("primary", "env")
		} else if dsn := libpqEnvDSN(); dsn != "" {
			cfg.Primary = dsn
			cfg.from("primary", "env")
		} else {
			return cfg, errors.New("serve: no primary: give --database (or --primary), PGFENCE_PRIMARY, primary in the config file, DATABASE_URL, or libpq's PGHOST/PGPORT")
		}
	}
	for _, k := range serveKeys() {
		if cfg.sources[k] == "" {
			cfg.sources[k] = "default"
		}
	}
	return cfg, nil
}

// from records that key (a flag name or a file key) got its value from
// source.
func (c *serveConfig) from(key, source string) {
	if c.sources == nil {
		c.sources = map[string]string{}
	}
	c.sources[strings.ReplaceAll(key, "-", "_")] = source
}

// serveKeys are the configuration keys: the TOML keys of serveConfig.
func serveKeys() []string {
	t := reflect.TypeOf(serveConfig{})
	var keys []string
	for i := range t.NumField() {
		if k := t.Field(i).Tag.Get("toml"); k != "" {
			keys = append(keys, k)
		}
	}
	return keys
}

// oneLine is err's message on one line (TOML parse errors can span
// several).
func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// proxyConfig turns the merged settings into a proxy.Config.
func (c serveConfig) proxyConfig() (proxy.Config, error) {
	pc := proxy.Config{
		Primary:           c.Primary,
		Replicas:          c.Replicas,
		MaxClients:        c.MaxClients,
		UpstreamPasswords: c.UpstreamPasswords,
		AdminUsers:        c.AdminUsers,
		StatsUsers:        c.StatsUsers,
		DisableEventLoop:  c.NoEventLoop,
		AuthQuery:         c.AuthQuery,
		AllowRemoteTrust:  c.AllowRemoteTrust,
	}
	if c.ConsoleAuthFile != "" {
		users, err := proxy.LoadUsers(c.ConsoleAuthFile)
		if err != nil {
			return pc, fmt.Errorf("console auth file: %w", err)
		}
		pc.ConsoleUsers = users
	}
	if err := c.applyReplicaConfig(&pc); err != nil { // serve_replicas.go
		return pc, err
	}
	switch strings.ToLower(c.Auth) {
	case "", "postgres":
		pc.Auth = proxy.AuthPostgres
	case "trust":
		pc.Auth = proxy.AuthTrust
	case "scram", "scram-sha-256":
		pc.Auth = proxy.AuthSCRAM
		if c.AuthFile == "" {
			return pc, errors.New("auth scram needs --auth-file")
		}
		users, err := proxy.LoadUsers(c.AuthFile)
		if err != nil {
			return pc, err
		}
		pc.Users = users
	default:
		return pc, fmt.Errorf("unknown --auth %q: want postgres, scram or trust", c.Auth)
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return pc, errors.New("--tls-cert and --tls-key go together")
	}
	if c.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(c.TLSCert, c.TLSKey)
		if err != nil {
			return pc, fmt.Errorf("tls: %w", err)
		}
		pc.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	if c.MaxMessageSize != "" {
		n, err := parseSize(c.MaxMessageSize)
		if err != nil {
			return pc, fmt.Errorf("max message size: %w", err)
		}
		pc.MaxMessageSize = n
	}
	if c.MemoryBudget != "" {
		n, err := parseSizeUpTo(c.MemoryBudget, 1<<40)
		if err != nil {
			return pc, fmt.Errorf("memory budget: %w", err)
		}
		pc.MemoryBudget = n
	}
	if c.ShutdownTimeout != "" {
		d, err := parseDuration(c.ShutdownTimeout)
		if err != nil {
			return pc, fmt.Errorf("shutdown timeout: %w", err)
		}
		pc.ShutdownTimeout = d
	}
	return pc, nil
}

// parseSize reads 1048576, 64kB, 64KiB, 64MB, 64MiB, 1GB (binary units, as
// PostgreSQL's memory settings).
func parseSize(s string) (int, error) { return parseSizeUpTo(s, 1<<30) }

// parseSizeUpTo is parseSize with another upper bound (the memory budget
// may exceed 1GiB).
func parseSizeUpTo(s string, limit int) (int, error) {
	s = strings.TrimSpace(s)
	mult := 1
	for _, u := range []struct {
		suffix string
		mult   int
	}{{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"kb", 1 << 10}, {"mb", 1 << 20}, {"gb", 1 << 30}, {"b", 1}} {
		if strings.HasSuffix(strings.ToLower(s), u.suffix) {
			s, mult = strings.TrimSpace(s[:len(s)-len(u.suffix)]), u.mult
			break
		}
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 || n > limit/mult {
		return 0, fmt.Errorf("invalid size %q (want e.g. 64MiB, at most %dMiB)", s, limit>>20)
	}
	return n * mult, nil
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

// serveLogger builds the logger at lvl (the root --log-level, or
// log_level in the config file; the level can change on reload) in format
// (text, json or auto: text on a terminal, JSON otherwise or with --json).
func serveLogger(lvl, format string, asJSON bool, w io.Writer) (*zap.Logger, zap.AtomicLevel, error) {
	level, err := zapcore.ParseLevel(lvl)
	if err != nil {
		return nil, zap.AtomicLevel{}, fmt.Errorf("--log-level: %w", err)
	}
	f, err := logFormat(format, asJSON, w)
	if err != nil {
		return nil, zap.AtomicLevel{}, err
	}
	al := zap.NewAtomicLevelAt(level)
	return newLogger(al, f, w), al, nil
}

// listenError says which address is busy and how to pick another.
func listenError(addr, flag string, err error) error {
	ee := exitWith(fmt.Errorf("listen on %s: %w", addr, err))
	ee.code = exitUnavailable
	if errors.Is(err, syscall.EADDRINUSE) {
		ee.msg = fmt.Sprintf("listen on %s: the address is in use by another process", addr)
		ee.hint = fmt.Sprintf("stop that process (ss -ltnp shows it), or pick another address: %s %s (port 0 picks a free one)", flag, nextPort(addr))
	}
	return ee
}

// nextPort is addr with its port plus one.
func nextPort(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	n, err := strconv.Atoi(port)
	if err != nil || n == 0 || n >= 65535 {
		return addr
	}
	return net.JoinHostPort(host, strconv.Itoa(n+1))
}
