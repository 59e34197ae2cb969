# idemgate: the two commands a newcomer needs are `make demo` and `make test`.
# Every target installs what it needs (scripts/install-deps.sh) and is safe to run again.

.PHONY: all build test test-native test-wasm test-demo lint demo up down bench fuzz deps clean

all: build

## build: dist/idemgate.wasm (wasm32-wasip1), with rustup's target or the Debian fallback
build:
	scripts/build-wasm.sh

deps:
	scripts/install-deps.sh envoy
	scripts/install-deps.sh store
	scripts/install-deps.sh agent-client

## test: lint, native unit + property tests, Envoy integration tests, core tests on wasm32 under Node.js,
## and the demo
test: lint build deps test-native test-wasm test-demo
	@echo "make test: all suites passed"

## test-demo: the demo must pass too (every operation executed exactly once)
test-demo:
	scripts/demo.sh run

test-native:
	cargo test --locked --all-targets

test-wasm:
	scripts/test-wasm.sh

lint:
	cargo fmt --check
	cargo clippy --locked --all-targets -- -D warnings

## demo: the whole stack on 127.0.0.1 (Redis, webdis, the demo payments API, Envoy with idemgate),
## an agent simulator under injected faults, with and without idemgate; stops everything it started
demo:
	scripts/demo.sh run

## up / down: the same stack left running for curl
up:
	scripts/demo.sh up

down:
	scripts/demo.sh down

## bench: what idemgate costs, side by side, on 127.0.0.1 (BENCH_QUICK=1 for under 3 minutes);
## writes target/bench/results.json, docs/BENCHMARKS.md and docs/bench.svg
bench: build deps
	scripts/install-deps.sh bench
	scripts/build-wasm.sh --empty
	cargo build --locked --release --quiet --bin demo-payments
	python3 scripts/bench.py

## fuzz: bounded cargo-fuzz runs of every parser of outside input (FUZZ_SECONDS per target, default 60)
fuzz:
	scripts/fuzz.sh $${FUZZ_SECONDS:-60}

clean:
	cargo clean
	rm -rf dist
