# pgfence — run `make help` for the targets.
GO       ?= go
PKGS     ?= ./...
TESTFLAGS ?=
DURATION ?= 5m
SEED     ?=
FAILOVER ?=
PORT     ?= 6432
PREFIX   ?= $(HOME)/.local
# The version and commit pgfence version prints (main.version, main.commit).
VERSION  ?= $(shell git describe --tags --dirty 2>/dev/null || echo devel)
COMMIT   ?= $(shell git rev-parse HEAD 2>/dev/null)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
GO_LDFLAGS ?= -X main.version=$(VERSION) -X main.commit=$(COMMIT)
export GO GO_LDFLAGS

.PHONY: help dev test test-race test-ha test-drivers test-pgx-suite test-node-pg-suite bench bench-gate lint build install deps chaos

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

deps: ## install PostgreSQL if missing and download Go modules
	@./scripts/ensure-postgres.sh
	@$(GO) mod download

build: ## build bin/pgfence, with this checkout's version and commit
	@./scripts/build.sh bin/pgfence

install: build ## install bin/pgfence as $(PREFIX)/bin/pgfence (PREFIX=~/.local by default)
	@install -d "$(DESTDIR)$(PREFIX)/bin"
	@install -m 0755 bin/pgfence "$(DESTDIR)$(PREFIX)/bin/pgfence"
	@echo "installed $(DESTDIR)$(PREFIX)/bin/pgfence"
	@case ":$$PATH:" in *":$(PREFIX)/bin:"*) ;; *) echo "note: $(PREFIX)/bin is not on your PATH: export PATH=\"$(PREFIX)/bin:\$$PATH\"";; esac

dev: deps ## throwaway primary + replica + proxy, with psql lines to try (PORT=6432)
	@./scripts/dev.sh $(PORT)

# The proxy package (the wire loop, its goroutines and the gate) runs
# with the race detector in make test too: it costs it little (its tests
# wait on PostgreSQL more than they compute) and caught a data race the
# plain run could not.
# (Only when every package is tested: make test PKGS=./rewrite/ tests just
# that one.)
RACEPKGS ?= $(if $(filter ./...,$(PKGS)),./proxy/)

test: deps ## run every test against real PostgreSQL (the proxy package with -race)
ifeq ($(strip $(RACEPKGS)),)
	$(GO) test -count=1 -timeout 15m $(TESTFLAGS) $(PKGS)
else
	$(GO) test -count=1 -timeout 15m $(TESTFLAGS) $$($(GO) list $(PKGS) | grep -v -x -F "$$($(GO) list $(RACEPKGS))")
	$(GO) test -count=1 -race -timeout 30m $(TESTFLAGS) $(RACEPKGS)
endif

# The failover scenario on a real Patroni 3 cluster (internal/hatest): one
# etcd, two PostgreSQL nodes under Patroni, two pgfence serve whose primary
# lists both nodes; the nemesis kills the leader and Patroni promotes the
# replica, with asynchronous and then synchronous replication. The script
# installs Debian's patroni and etcd packages when they are missing. Ports
# 61000-61099; about 2.5 minutes.
test-ha: deps ## failover on a real Patroni cluster (async, then sync), through two proxies
	./scripts/test-ha.sh

# The driver matrix (internal/drivers): psycopg2, psycopg 3, node-postgres,
# pgjdbc in several modes and pgx in each query exec mode, each straight to
# PostgreSQL and through pgfence serve. install.sh installs the drivers
# that are missing (Debian packages, npm ci). WRITE_DOC=1 also rewrites the
# table in docs/compatibility.md.
test-drivers: deps ## driver matrix: real drivers direct vs through pgfence serve
	./internal/drivers/install.sh
	$(GO) test -tags drivers -count=1 -timeout 10m -run 'TestDrivers$$' ./internal/drivers/ -v $(if $(WRITE_DOC),-args -write-doc)

# pgx v5's own test suite (the go.mod version) against PostgreSQL and
# through pgfence serve: every test that passes direct must pass through
# the proxy (internal/drivers/pgxsuite_test.go). To repeat a part of it,
# e.g. a flaky test: PGX_SUITE_RUN=regexp (go test -run), PGX_SUITE_COUNT=n
# (-count) and PGX_SUITE_PKGS="./pgconn" (the packages; ./... by default):
#   make test-pgx-suite PGX_SUITE_RUN=TestCancelRequestContextWatcherHandler PGX_SUITE_COUNT=20 PGX_SUITE_PKGS=./pgconn
test-pgx-suite: deps ## pgx's own test suite, direct vs through pgfence serve
	$(GO) test -tags drivers -count=1 -timeout 30m -run 'TestPgxSuite$$' ./internal/drivers/ -v $(if $(WRITE_DOC),-args -write-doc)

# node-postgres's own integration tests, direct vs through pgfence serve.
# The npm package ships no tests: NODE_PG_SRC is a checkout of
# github.com/brianc/node-postgres.
test-node-pg-suite: deps ## node-postgres's own tests (NODE_PG_SRC=checkout), direct vs through pgfence serve
	NODE_PG_SRC=$(NODE_PG_SRC) $(GO) test -tags drivers -count=1 -timeout 30m -run 'TestNodePgSuite$$' ./internal/drivers/ -v

test-race: deps ## run the tests with the race detector
	$(GO) test -count=1 -race -timeout 20m $(TESTFLAGS) $(PKGS)

bench: deps build ## benchmarks: pgfence vs direct connections, printed as ratios
	$(GO) test -run '^$$' -bench . -benchtime 2000x -count 1 -timeout 20m ./fence/...
	$(GO) test -run '^$$' -bench 'Classify|Canonical' -benchmem ./rewrite/
	$(GO) test -run '^$$' -bench PassThrough -benchmem ./proxy/
	$(GO) test -run '^$$' -bench GatedWrite -benchtime 2000x ./proxy/
	$(GO) run ./internal/benchproxy -pgfence bin/pgfence
	$(GO) run ./internal/benchreplica

# The gated-write table of issue 33 alone (benchproxy's cells "gate
# <workload> c=N"), as markdown for docs/performance.md: unfenced direct
# and through pgfence, the seed's SQL direct and through PgBouncer, gated,
# the backstop alone. Short by default; the figures in the docs are
# GATE_ROUNDS=3 GATE_T=5s. GATE_ONLY narrows it (a regexp), GATE_ARGS adds
# flags (-statements: pg_stat_statements per fenced path).
GATE_ONLY   ?= ^gate\b
GATE_T      ?= 2s
GATE_ROUNDS ?= 1
GATE_ARGS   ?=
bench-gate: deps build ## the gated-write table only (GATE_ROUNDS=1 GATE_T=2s GATE_ONLY=regexp)
	$(GO) run ./internal/benchproxy -pgfence bin/pgfence -only '$(GATE_ONLY)' -t $(GATE_T) -rounds $(GATE_ROUNDS) $(GATE_ARGS)

chaos: deps build ## chaos run with a nemesis, then the checker (DURATION=5m, SEED=N, FAILOVER=async|sync)
	$(GO) build -o bin/chaos ./internal/chaos/cmd
	./bin/chaos --pgfence bin/pgfence --duration $(DURATION) $(if $(SEED),--seed $(SEED)) $(if $(FAILOVER),--failover $(FAILOVER))

lint: ## go vet and gofmt
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
