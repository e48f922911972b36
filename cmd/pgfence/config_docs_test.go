package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
)

// docRow is one setting of docs/configuration.md's table.
type docRow struct {
	keys, flags, envs []string
}

var backticked = regexp.MustCompile("`([^`]+)`")

// configDocRows parses the settings table of docs/configuration.md.
func configDocRows(t *testing.T) []docRow {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	var rows []docRow
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "| setting (TOML key)") {
			in = true
			continue
		}
		if !in {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			break
		}
		cells := strings.Split(line, "|")
		if len(cells) < 5 || strings.HasPrefix(strings.TrimSpace(cells[1]), "---") {
			continue
		}
		var r docRow
		for _, m := range backticked.FindAllStringSubmatch(cells[1], -1) {
			r.keys = append(r.keys, m[1])
		}
		for _, m := range backticked.FindAllStringSubmatch(cells[2], -1) {
			if strings.HasPrefix(m[1], "--") {
				r.flags = append(r.flags, m[1])
			}
		}
		for _, m := range backticked.FindAllStringSubmatch(cells[3], -1) {
			if strings.HasPrefix(m[1], "PGFENCE_") {
				r.envs = append(r.envs, m[1])
			}
		}
		rows = append(rows, r)
	}
	if len(rows) < 15 {
		t.Fatalf("parsed %d rows from docs/configuration.md's table; the parser is broken", len(rows))
	}
	return rows
}

// configSamples are a valid value for each setting: as a TOML value, and
// as an environment variable or flag takes it (nil: file only).
var configSamples = map[string]struct {
	toml string
	str  *string
}{
	"listen":               {`"127.0.0.1:7000"`, ptr("127.0.0.1:7000")},
	"primary":              {`"postgres://docs@localhost/db"`, ptr("postgres://docs@localhost/db")},
	"replicas":             {`["postgres://replica@localhost/db"]`, ptr("postgres://replica@localhost/db")},
	"read_replicas":        {`false`, ptr("false")},
	"replica_poll":         {`"1d"`, ptr("20ms")},
	"replica_max_lag":      {`"5s"`, ptr("1d")},
	"tls_cert":             {`"/etc/pgfence/server.pem"`, ptr("/etc/pgfence/server.pem")},
	"tls_key":              {`"/etc/pgfence/server.key"`, ptr("/etc/pgfence/server.key")},
	"auth":                 {`"trust"`, ptr("trust")},
	"auth_file":            {`"/etc/pgfence/users.txt"`, ptr("/etc/pgfence/users.txt")},
	"auth_query":           {`"SELECT usename, passwd FROM pgfence_auth.lookup($1)"`, ptr("SELECT usename, passwd FROM pgfence_auth.lookup($1)")},
	"allow_remote_trust":   {`true`, ptr("true")},
	"memory_budget":        {`"256MiB"`, ptr("128MiB")},
	"cache_memory":         {`"16MiB"`, ptr("8MiB")},
	"upstream_passwords":   {`{ worker = "secret" }`, nil},
	"admin_users":          {`["dba"]`, ptr("dba,ops")},
	"stats_users":          {`["grafana"]`, ptr("grafana,ops")},
	"console_auth_file":    {`"/etc/pgfence/console-users.txt"`, ptr("/etc/pgfence/console-users.txt")},
	"max_clients":          {`5`, ptr("7")},
	"max_startup_clients":  {`6`, ptr("8")},
	"max_console_clients":  {`4`, ptr("3")},
	"default_pool_size":    {`20`, ptr("10")},
	"reserve_pool_size":    {`5`, ptr("2")},
	"reserve_pool_timeout": {`"3s"`, ptr("1s")},
	"max_db_connections":   {`50`, ptr("40")},
	"max_user_connections": {`30`, ptr("25")},
	"query_wait_timeout":   {`"60s"`, ptr("0")},
	"server_reuse":         {`true`, ptr("true")},
	"server_idle_timeout":  {`"30s"`, ptr("0")},
	"server_lifetime":      {`"1h"`, ptr("2h")},
	"client_memory":        {`"32MiB"`, ptr("16MiB")},
	"message_timeout":      {`"30s"`, ptr("1d")},
	"max_message_size":     {`"1MiB"`, ptr("2MiB")},
	"shutdown_timeout":     {`"3s"`, ptr("1d")},
	"gate_idle_timeout":    {`"2s"`, ptr("1d")},
	"no_gate":              {`true`, ptr("true")},
	"no_event_loop":        {`true`, ptr("true")},
	"poller":               {`"poll"`, ptr("poll")},
	"metrics_listen":       {`"127.0.0.1:9187"`, ptr("127.0.0.1:9188")},
	"log_level":            {`"debug"`, ptr("warn")},
	"log_format":           {`"json"`, ptr("text")},
}

func ptr(s string) *string { return &s }

// serveCommand is pgfence serve under the real root (its persistent
// flags included), with flags parsed from args.
func serveCommand(t *testing.T, args ...string) *cobra.Command {
	t.Helper()
	root := newRootCmd()
	serve, _, err := root.Find([]string{"serve"})
	if err != nil {
		t.Fatal(err)
	}
	if err := serve.ParseFlags(args); err != nil {
		t.Fatalf("serve %q: %v", args, err)
	}
	return serve
}

// clearServeEnv unsets every PGFENCE_ variable and the database chain for
// the test.
func clearServeEnv(t *testing.T) {
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "PGFENCE_") || k == "DATABASE_URL" || strings.HasPrefix(k, "PG") {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
}

// TestConfigurationDocs: every key, flag and environment variable
// docs/configuration.md lists is one serve accepts (each is set in turn
// and must show up with its source), and every key serve accepts is
// listed.
func TestConfigurationDocs(t *testing.T) {
	clearServeEnv(t)
	rows := configDocRows(t)
	documented := map[string]bool{}
	for _, r := range rows {
		for _, k := range r.keys {
			documented[k] = true
		}
	}
	var missing []string
	for _, k := range serveKeys() {
		if !documented[k] {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		t.Errorf("keys serve accepts but docs/configuration.md does not list: %v", missing)
	}

	// The file: every documented key at once.
	var file strings.Builder
	var tables []string
	for _, r := range rows {
		for _, k := range r.keys {
			s, ok := configSamples[k]
			if !ok {
				t.Fatalf("docs/configuration.md lists %q, which this test has no sample value for: add one (and check serve accepts it)", k)
			}
			if strings.HasPrefix(s.toml, "{") {
				tables = append(tables, k+" = "+s.toml)
				continue
			}
			file.WriteString(k + " = " + s.toml + "\n")
		}
	}
	for _, tb := range tables {
		file.WriteString(tb + "\n")
	}
	path := filepath.Join(t.TempDir(), "pgfence.toml")
	if err := os.WriteFile(path, []byte(file.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadServeConfig(serveCommand(t, "--config", path))
	if err != nil {
		t.Fatalf("a file with every documented key:\n%s\nloadServeConfig: %v", file.String(), err)
	}
	for k := range documented {
		if got := cfg.sources[k]; got != "file" {
			t.Errorf("key %q from the file: source %q, want file", k, got)
		}
	}
	if _, err := cfg.proxyConfigNoFiles(); err != nil {
		t.Errorf("the documented sample values do not make a proxy configuration: %v", err)
	}

	// Each documented environment variable and flag, one at a time.
	for _, r := range rows {
		for i, k := range r.keys {
			s := configSamples[k]
			if s.str == nil {
				if len(r.envs) > 0 || len(r.flags) > 0 {
					t.Errorf("%q: the test has no string sample, but the docs list %v %v", k, r.envs, r.flags)
				}
				continue
			}
			pick := func(list []string) []string {
				if len(list) == len(r.keys) {
					return list[i : i+1]
				}
				return list
			}
			for _, env := range pick(r.envs) {
				t.Run(env, func(t *testing.T) {
					t.Setenv("PGFENCE_PRIMARY", "postgres://x@localhost/db")
					t.Setenv(env, *s.str)
					cfg, err := loadServeConfig(serveCommand(t))
					if err != nil {
						t.Fatalf("%s=%s: %v", env, *s.str, err)
					}
					if got := cfg.sources[k]; got != "env" {
						t.Errorf("%s=%s: source of %q is %q, want env", env, *s.str, k, got)
					}
				})
			}
			for _, flag := range pick(r.flags) {
				t.Run(flag, func(t *testing.T) {
					args := []string{flag + "=" + *s.str}
					if k != "primary" {
						args = append(args, "--primary", "postgres://x@localhost/db")
					}
					cfg, err := loadServeConfig(serveCommand(t, args...))
					if err != nil {
						t.Fatalf("serve %v: %v", args, err)
					}
					if got := cfg.sources[k]; got != "flag" {
						t.Errorf("serve %v: source of %q is %q, want flag", args, k, got)
					}
				})
			}
		}
	}
}

// proxyConfigNoFiles is proxyConfig without reading the TLS and users
// files the samples name.
func (c serveConfig) proxyConfigNoFiles() (any, error) {
	c.TLSCert, c.TLSKey, c.AuthFile, c.ConsoleAuthFile = "", "", "", ""
	pc, err := c.proxyConfig()
	return pc, err
}

// The settings table in docs/proxy.md names the same keys.
func TestProxyDocsKeys(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "proxy.md"))
	if err != nil {
		t.Fatal(err)
	}
	keys := serveKeys()
	in := false
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "| setting | default | meaning |") {
			in = true
			continue
		}
		if !in || strings.HasPrefix(line, "|---") {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			break
		}
		for _, k := range strings.Split(strings.Split(line, "|")[1], "/") {
			k = strings.TrimSpace(k)
			n++
			if !slices.Contains(keys, k) {
				sort.Strings(keys)
				t.Errorf("docs/proxy.md lists setting %q; serve's keys are %v", k, keys)
			}
		}
	}
	if n < 5 {
		t.Fatalf("parsed %d settings from docs/proxy.md; the parser is broken", n)
	}
}

// Where each value came from reaches SHOW CONFIG: the proxy's Sources and
// the extra settings' Source.
func TestServeSources(t *testing.T) {
	clearServeEnv(t)
	path := filepath.Join(t.TempDir(), "pgfence.toml")
	if err := os.WriteFile(path, []byte("listen = \"127.0.0.1:7000\"\nmax_clients = 5\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PGFENCE_MAX_CLIENTS", "7")
	t.Setenv("DATABASE_URL", "postgres://from-env@localhost/db")
	cmd := serveCommand(t, "--config", path, "--metrics-listen", "127.0.0.1:9999")
	cfg, err := loadServeConfig(cmd)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"listen": "file", "max_clients": "env", "metrics_listen": "flag", "primary": "env", "auth": "default", "log_level": "default"}
	for k, w := range want {
		if got := cfg.sources[k]; got != w {
			t.Errorf("source of %s: %q, want %q", k, got, w)
		}
	}
	if cfg.Primary != "postgres://from-env@localhost/db" || cfg.MaxClients != 7 {
		t.Errorf("primary %q, max_clients %d: want DATABASE_URL's and the environment's 7", cfg.Primary, cfg.MaxClients)
	}
	for _, s := range cfg.extraSettings() {
		if s.Source == "" {
			t.Errorf("extra setting %s has no source", s.Key)
		}
		if s.Key == "metrics_listen" && s.Source != "flag" {
			t.Errorf("metrics_listen's source: %q, want flag", s.Source)
		}
	}
	// The reload keeps reporting sources.
	cfg.reload = func() (serveConfig, error) { return loadServeConfig(cmd) }
	pc, _, err := cfg.reloader(zap.NewNop())()
	if err != nil {
		t.Fatal(err)
	}
	if pc.Sources["max_clients"] != "env" || pc.Sources["listen"] != "file" {
		t.Errorf("sources after reload: %v", pc.Sources)
	}
}

// The primary follows the database chain of every command, and serve
// refuses to start without one.
func TestServePrimaryChain(t *testing.T) {
	for _, tt := range []struct {
		name    string
		env     map[string]string
		args    []string
		primary string
	}{
		{"flag --database", map[string]string{"DATABASE_URL": "postgres://env/db"}, []string{"--database", "postgres://flag/db"}, "postgres://flag/db"},
		{"PGFENCE_PRIMARY over DATABASE_URL", map[string]string{"PGFENCE_PRIMARY": "postgres://pgfence/db", "DATABASE_URL": "postgres://env/db"}, nil, "postgres://pgfence/db"},
		{"PGFENCE_DATABASE_URL over DATABASE_URL", map[string]string{"PGFENCE_DATABASE_URL": "postgres://pgfence-db/db", "DATABASE_URL": "postgres://env/db"}, nil, "postgres://pgfence-db/db"},
		{"DATABASE_URL", map[string]string{"DATABASE_URL": "postgres://env/db"}, nil, "postgres://env/db"},
		{"PGHOST", map[string]string{"PGHOST": "db.internal", "PGPORT": "5433"}, nil, "host='db.internal' port='5433'"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clearServeEnv(t)
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			cfg, err := loadServeConfig(serveCommand(t, tt.args...))
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Primary != tt.primary {
				t.Errorf("primary %q, want %q", cfg.Primary, tt.primary)
			}
		})
	}
	clearServeEnv(t)
	code, _, stderr := pgfenceExit(t, nil, "serve")
	if code != exitConfig || !strings.Contains(stderr, "no primary") {
		t.Errorf("serve without a primary: exit %d, %q; want %d and what to give", code, stderr, exitConfig)
	}
	code, _, _ = pgfenceExit(t, nil, "serve", "--primary", "postgres://a/db", "--database", "postgres://b/db")
	if code != exitConfig {
		t.Errorf("serve --primary and --database: exit %d, want %d", code, exitConfig)
	}
}
