package main

// How serve reads its configuration: every key from the TOML file, the
// environment and its flag, in one loop over serveConfig's fields
// (loadServeConfig), recording where each value came from for SHOW CONFIG.
// docs/configuration.md lists the keys; TestConfigurationDocs holds the
// two together.

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pgfence/pgfence/proxy"
)

// serveConfig is `pgfence serve`'s configuration. Each field tagged toml
// is a key: in the TOML file as tagged, in the environment as PGFENCE_ and
// its flag upper-cased with _ for -, and as a flag named as the key with -
// for _ unless tagged flag ("-": the file only). Flags win over the
// environment, the environment over the file, the file over the defaults.
type serveConfig struct {
	Listen            string   `toml:"listen"`
	Primary           string   `toml:"primary"`
	Replicas          []string `toml:"replicas" flag:"replica"`
	TLSCert           string   `toml:"tls_cert"`
	TLSKey            string   `toml:"tls_key"`
	Auth              string   `toml:"auth"`
	AuthFile          string   `toml:"auth_file"`
	AuthQuery         string   `toml:"auth_query"`
	AllowRemoteTrust  bool     `toml:"allow_remote_trust"`
	MaxClients        int      `toml:"max_clients"`
	MaxStartupClients int      `toml:"max_startup_clients"`
	MaxConsoleClients int      `toml:"max_console_clients"`
	// Server connection limits (PgBouncer's names; docs/proxy.md).
	DefaultPoolSize    int               `toml:"default_pool_size"`
	ReservePoolSize    int               `toml:"reserve_pool_size"`
	ReservePoolTimeout string            `toml:"reserve_pool_timeout"`
	MaxDBConnections   int               `toml:"max_db_connections"`
	MaxUserConnections int               `toml:"max_user_connections"`
	QueryWaitTimeout   string            `toml:"query_wait_timeout"`
	ServerReuse        bool              `toml:"server_reuse"`
	ServerIdleTimeout  string            `toml:"server_idle_timeout"`
	ServerLifetime     string            `toml:"server_lifetime"`
	ClientMemory       string            `toml:"client_memory"`
	MessageTimeout     string            `toml:"message_timeout"`
	MaxMessageSize     string            `toml:"max_message_size"`
	MemoryBudget       string            `toml:"memory_budget"`
	CacheMemory        string            `toml:"cache_memory"`
	ShutdownTimeout    string            `toml:"shutdown_timeout"`
	GateIdleTimeout    string            `toml:"gate_idle_timeout"`
	UpstreamPasswords  map[string]string `toml:"upstream_passwords" flag:"-"`
	// NoGate turns the write gate off: a plain pass-through proxy (for
	// measuring the proxy alone). Protected tables then rely on their
	// backstop trigger only, without commit receipts.
	NoGate bool `toml:"no_gate"`
	// NoEventLoop is deprecated: there is one relay engine, the event
	// loop; true selects poller = "poll" (docs/proxy.md, "The event
	// loop"), with a warning at startup.
	NoEventLoop bool `toml:"no_event_loop"`
	// Poller is what the event loop waits in: epoll (Linux) or poll
	// (every Unix); empty: epoll on Linux, poll elsewhere.
	Poller string `toml:"poller"`
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
	// Read routing (docs/reads.md).
	ReadReplicas  *bool  `toml:"read_replicas"`
	ReplicaPoll   string `toml:"replica_poll"`
	ReplicaMaxLag string `toml:"replica_max_lag"`

	// Set by the serve command for SIGHUP / RELOAD (reload.go).
	reload func() (serveConfig, error)
	level  *zap.AtomicLevel
	// sources says where each key's value came from: "flag", "env",
	// "file" or "default" (SHOW CONFIG).
	sources map[string]string
}

// configKey is one key of serveConfig: where a value for it is read.
type configKey struct {
	key  string // in the file and in SHOW CONFIG
	flag string // "" for a key of the file only
	env  string
	dst  any // the field: *string, *[]string, *int, *bool or **bool
}

// keys are c's configuration keys, in the order of its fields.
func (c *serveConfig) keys() []configKey {
	v := reflect.ValueOf(c).Elem()
	var keys []configKey
	for i := range v.NumField() {
		f := v.Type().Field(i)
		key := f.Tag.Get("toml")
		if key == "" {
			continue
		}
		flag, ok := f.Tag.Lookup("flag")
		switch {
		case flag == "-":
			flag = ""
		case !ok:
			flag = strings.ReplaceAll(key, "_", "-")
		}
		env := ""
		if flag != "" {
			env = "PGFENCE_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
		}
		keys = append(keys, configKey{key: key, flag: flag, env: env, dst: v.Field(i).Addr().Interface()})
	}
	return keys
}

// serveKeys are the configuration keys: the TOML keys of serveConfig.
func serveKeys() []string {
	var keys []string
	for _, k := range new(serveConfig).keys() {
		keys = append(keys, k.key)
	}
	return keys
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
	for _, k := range cfg.keys() {
		if k.env == "" {
			continue
		}
		if v, ok := os.LookupEnv(k.env); ok {
			if err := setConfig(k.dst, v); err != nil {
				return cfg, fmt.Errorf("%s: %w", k.env, err)
			}
			cfg.sources[k.key] = "env"
		}
		// The root's --log-level and --log-format take their defaults
		// from the environment: only a flag given counts as "flag".
		if f := cmd.Flags().Lookup(k.flag); f != nil && f.Changed {
			if list, ok := f.Value.(pflag.SliceValue); ok {
				*k.dst.(*[]string) = list.GetSlice()
			} else if err := setConfig(k.dst, f.Value.String()); err != nil {
				return cfg, fmt.Errorf("--%s: %w", k.flag, err)
			}
			cfg.sources[k.key] = "flag"
		}
	}
	if cmd.Flags().Changed("database") {
		if cmd.Flags().Changed("primary") {
			return cfg, errors.New("serve: --database and --primary name the same setting: give one")
		}
		cfg.Primary, _ = cmd.Flags().GetString("database")
		cfg.sources["primary"] = "flag"
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "info"
	}
	if _, err := zapcore.ParseLevel(cfg.LogLevel); err != nil {
		return cfg, fmt.Errorf("log level: %w", err)
	}
	if cfg.LogFormat == "" {
		cfg.LogFormat = "auto"
	}
	if _, err := logFormat(cfg.LogFormat, false, nil); err != nil {
		return cfg, err
	}
	if cfg.Primary == "" {
		// The chain every command uses for its database (database.go).
		if cfg.Primary = databaseFromEnv(); cfg.Primary == "" {
			cfg.Primary = libpqEnvDSN()
		}
		if cfg.Primary == "" {
			return cfg, errors.New("serve: no primary: give --database (or --primary), PGFENCE_PRIMARY, primary in the config file, DATABASE_URL, or libpq's PGHOST/PGPORT")
		}
		cfg.sources["primary"] = "env"
	}
	for _, k := range serveKeys() {
		if cfg.sources[k] == "" {
			cfg.sources[k] = "default"
		}
	}
	return cfg, nil
}

// setConfig sets the field dst to v, a value as the environment (or a
// flag) gives it: a list is comma-separated.
func setConfig(dst any, v string) error {
	switch d := dst.(type) {
	case *string:
		*d = v
	case *[]string:
		*d = splitList(v)
	case *int:
		n, err := strconv.Atoi(v)
		if err != nil {
			return err
		}
		*d = n
	case *bool:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return err
		}
		*d = b
	case **bool:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return err
		}
		*d = &b
	default:
		panic(fmt.Sprintf("serveConfig: no way to set a %T", dst))
	}
	return nil
}

// splitList reads a comma-separated list, dropping empty items.
func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// oneLine is err's message on one line (TOML parse errors can span
// several).
func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// proxyConfig turns the merged settings into a proxy.Config.
func (c serveConfig) proxyConfig() (proxy.Config, error) {
	pc := proxy.Config{
		Primary:            c.Primary,
		Replicas:           c.Replicas,
		MaxClients:         c.MaxClients,
		MaxStartupClients:  c.MaxStartupClients,
		MaxConsoleClients:  c.MaxConsoleClients,
		PoolSize:           c.DefaultPoolSize,
		ReservePoolSize:    c.ReservePoolSize,
		MaxDBConnections:   c.MaxDBConnections,
		MaxUserConnections: c.MaxUserConnections,
		ServerReuse:        c.ServerReuse,
		UpstreamPasswords:  c.UpstreamPasswords,
		AdminUsers:         c.AdminUsers,
		StatsUsers:         c.StatsUsers,
		DisableEventLoop:   c.NoEventLoop,
		Poller:             c.Poller,
		AuthQuery:          c.AuthQuery,
		AllowRemoteTrust:   c.AllowRemoteTrust,
	}
	if c.ConsoleAuthFile != "" {
		users, err := proxy.LoadUsers(c.ConsoleAuthFile)
		if err != nil {
			return pc, fmt.Errorf("console auth file: %w", err)
		}
		pc.ConsoleUsers = users
	}
	if err := c.applyReplicaConfig(&pc); err != nil {
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
	if c.ClientMemory != "" {
		n, err := parseSizeUpTo(c.ClientMemory, 1<<40)
		if err != nil {
			return pc, fmt.Errorf("client memory: %w", err)
		}
		pc.ClientMemory = n
	}
	for _, d := range []struct {
		name string
		v    string
		dst  *time.Duration
		zero time.Duration // what 0 means: no bound
	}{{"reserve_pool_timeout", c.ReservePoolTimeout, &pc.ReservePoolTimeout, 0}, {"query_wait_timeout", c.QueryWaitTimeout, &pc.QueryWaitTimeout, -1},
		{"server_idle_timeout", c.ServerIdleTimeout, &pc.ServerIdleTimeout, -1}, {"server_lifetime", c.ServerLifetime, &pc.ServerLifetime, -1}} {
		if d.v == "" {
			continue
		}
		v, err := parseDuration(d.v)
		if err != nil {
			return pc, fmt.Errorf("%s: %w", d.name, err)
		}
		if v == 0 {
			v = d.zero
		}
		*d.dst = v
	}
	if c.MessageTimeout != "" {
		d, err := parseDuration(c.MessageTimeout)
		if err != nil {
			return pc, fmt.Errorf("message timeout: %w", err)
		}
		pc.MessageTimeout = d
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

// applyReplicaConfig sets the read-routing fields of pc.
func (c serveConfig) applyReplicaConfig(pc *proxy.Config) error {
	pc.NoReplicaReads = c.ReadReplicas != nil && !*c.ReadReplicas
	if c.ReplicaPoll != "" {
		d, err := parseDuration(c.ReplicaPoll)
		if err != nil || d <= 0 {
			return fmt.Errorf("replica poll %q: want a positive duration such as 50ms", c.ReplicaPoll)
		}
		pc.ReplicaPoll = d
	}
	if c.ReplicaMaxLag != "" {
		d, err := parseDuration(c.ReplicaMaxLag)
		if err != nil || d <= 0 {
			return fmt.Errorf("replica max lag %q: want a positive duration such as 10s", c.ReplicaMaxLag)
		}
		pc.ReplicaMaxLag = d
	}
	return nil
}
