package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pgfence/pgfence/proxy"
)

// extraSettings are the settings SHOW CONFIG shows besides the proxy's.
func (c serveConfig) extraSettings() []proxy.Setting {
	lvl := c.LogLevel
	if c.level != nil {
		lvl = c.level.Level().String()
	}
	set := []proxy.Setting{
		{Key: "listen", Value: c.Listen},
		{Key: "metrics_listen", Value: c.MetricsListen},
		{Key: "no_gate", Value: strconv.FormatBool(c.NoGate)},
		{Key: "no_event_loop", Value: strconv.FormatBool(c.NoEventLoop)},
		{Key: "poller", Value: c.Poller},
		{Key: "cache_memory", Value: c.CacheMemory, Default: "memory_budget / 8"},
		{Key: "log_level", Value: lvl, Reloadable: true},
		{Key: "log_format", Value: c.LogFormat},
	}
	for i := range set {
		set[i].Source = c.sources[set[i].Key]
	}
	return set
}

// reloader returns the proxy's Config.Reload: it re-reads the file and the
// environment (flags stay as given), applies the log level itself, and
// reports the serve settings that need a restart. Nil when c has no source
// to reload.
func (c serveConfig) reloader(log *zap.Logger) func() (proxy.Config, *proxy.ReloadReport, error) {
	if c.reload == nil {
		return nil
	}
	return func() (proxy.Config, *proxy.ReloadReport, error) {
		next, err := c.reload()
		if err != nil {
			return proxy.Config{}, nil, err
		}
		pc, err := next.proxyConfig()
		if err != nil {
			return proxy.Config{}, nil, err
		}
		rep := &proxy.ReloadReport{}
		for _, r := range []struct {
			name    string
			changed bool
		}{
			{"listen", next.Listen != c.Listen},
			{"metrics_listen", next.MetricsListen != c.MetricsListen},
			{"no_gate", next.NoGate != c.NoGate},
			{"no_event_loop", next.NoEventLoop != c.NoEventLoop},
			{"poller", next.Poller != c.Poller},
			{"cache_memory", next.CacheMemory != c.CacheMemory},
		} {
			if r.changed {
				rep.Restart = append(rep.Restart, r.name)
			}
		}
		// Check everything before applying anything: a reload applies
		// whole or not at all (the proxy validates its part first).
		lvl, err := zapcore.ParseLevel(next.LogLevel)
		if err != nil {
			return proxy.Config{}, nil, fmt.Errorf("log level: %w", err)
		}
		if c.level != nil && c.level.Level() != lvl {
			c.level.SetLevel(lvl)
			rep.Applied = append(rep.Applied, "log_level")
		}
		shown := c // what runs: only the log level changes without a restart
		shown.LogLevel = lvl.String()
		// Where the running values came from: the new sources, except for
		// the settings that keep their old value until a restart.
		shown.sources = maps.Clone(next.sources)
		if shown.sources == nil {
			shown.sources = map[string]string{}
		}
		for _, k := range rep.Restart {
			shown.sources[k] = c.sources[k]
		}
		for _, k := range []string{"log_format", "primary", "max_message_size", "shutdown_timeout"} {
			shown.sources[k] = c.sources[k]
		}
		pc.ExtraSettings = shown.extraSettings()
		pc.Sources = shown.sources
		return pc, rep, nil
	}
}

// startOps starts what runs beside the proxy: SIGHUP reloads and the
// metrics endpoint. The returned function stops them.
func (c serveConfig) startOps(srv *proxy.Server, log *zap.Logger) (func(), error) {
	var stops []func()
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	if c.reload != nil {
		hup := make(chan os.Signal, 1)
		signal.Notify(hup, syscall.SIGHUP)
		done := make(chan struct{})
		exited := make(chan struct{})
		go func() {
			defer close(exited)
			for {
				select {
				case <-hup:
					if _, err := srv.ReloadFromSource(); err != nil {
						log.Error("reload on SIGHUP failed; the running configuration is unchanged", zap.String("error", oneLine(err)))
					}
				case <-done:
					return
				}
			}
		}()
		stops = append(stops, func() {
			signal.Stop(hup)
			close(done)
			<-exited
		})
	}
	if c.MetricsListen != "" {
		ln, err := net.Listen("tcp", c.MetricsListen)
		if err != nil {
			stop()
			return nil, fmt.Errorf("metrics listen: %w", err)
		}
		// Bounded like the proxy's own listener: a client with no
		// credentials that opens connections and goes quiet must not take
		// the descriptors the sessions need (round 25, BC-M1).
		ln = limitListener(ln, metricsMaxConns)
		hs := &http.Server{Handler: srv.MetricsHandler(), ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: 30 * time.Second}
		served := make(chan struct{})
		go func() {
			defer close(served)
			if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics endpoint failed", zap.Error(err))
			}
		}()
		log.Info("metrics listening", zap.String("addr", ln.Addr().String()))
		stops = append(stops, func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			hs.Shutdown(ctx)
			<-served
		})
	}
	return stop, nil
}

// metricsMaxConns bounds the metrics endpoint's open connections: a
// scraper needs one or two; beyond the bound, connections wait in the
// listen backlog until one closes.
const metricsMaxConns = 32

// limitListener returns ln accepting at most n connections open at once.
func limitListener(ln net.Listener, n int) net.Listener {
	return &limitedListener{Listener: ln, sem: make(chan struct{}, n)}
}

type limitedListener struct {
	net.Listener
	sem chan struct{}
}

func (l *limitedListener) Accept() (net.Conn, error) {
	l.sem <- struct{}{}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	return &limitedConn{Conn: c, release: func() { <-l.sem }}, nil
}

type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
