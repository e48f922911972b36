# pgfence — run `make help` for the targets.
GO       ?= go
PKGS     ?= ./...
TESTFLAGS ?=
DURATION ?= 5m
SEED     ?=

.PHONY: help dev test test-race bench lint build deps chaos

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

deps: ## install PostgreSQL if missing and download Go modules
	@./scripts/ensure-postgres.sh
	@$(GO) mod download

build: ## build bin/pgfence
	$(GO) build -o bin/pgfence ./cmd/pgfence

dev: deps build ## throwaway primary + replica + proxy, with psql lines to try
	./bin/pgfence dev

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
	$(GO) test -count=1 -race -timeout 15m $(TESTFLAGS) $(RACEPKGS)
endif

test-race: deps ## run the tests with the race detector
	$(GO) test -count=1 -race -timeout 20m $(TESTFLAGS) $(PKGS)

bench: deps build ## benchmarks: pgfence vs direct connections, printed as ratios
	$(GO) test -run '^$$' -bench . -benchtime 2000x -count 1 -timeout 20m ./fence/...
	$(GO) test -run '^$$' -bench 'Classify|Canonical' -benchmem ./rewrite/
	$(GO) test -run '^$$' -bench PassThrough -benchmem ./proxy/
	$(GO) test -run '^$$' -bench GatedWrite -benchtime 2000x ./proxy/
	$(GO) run ./internal/benchproxy -pgfence bin/pgfence
	$(GO) run ./internal/benchreplica

chaos: deps build ## chaos run with a nemesis, then the checker (DURATION=5m, SEED=N)
	$(GO) build -o bin/chaos ./internal/chaos/cmd
	./bin/chaos --pgfence bin/pgfence --duration $(DURATION) $(if $(SEED),--seed $(SEED))

lint: ## go vet and gofmt
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
