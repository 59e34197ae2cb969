# idemgate: the two commands a newcomer needs are `make demo` and `make test`.
# Every target installs what it needs (scripts/install-deps.sh) and is safe to run again.

.PHONY: all build test test-native test-wasm lint demo deps clean

all: build

## build: dist/idemgate.wasm (wasm32-wasip1), with rustup's target or the Debian fallback
build:
	scripts/build-wasm.sh

deps:
	scripts/install-deps.sh envoy
	scripts/install-deps.sh store
	scripts/install-deps.sh agent-client

## test: lint, native unit + property tests, Envoy integration tests, core tests on wasm32 under Node.js
test: lint build deps test-native test-wasm
	@echo "make test: all suites passed"

test-native:
	cargo test --locked --all-targets

test-wasm:
	scripts/test-wasm.sh

lint:
	cargo fmt --check
	cargo clippy --locked --all-targets -- -D warnings

## demo: not ready yet (arrives with the "Demo" issue)
demo:
	@echo "make demo: not ready yet; the demo stack arrives with the Demo issue. Try 'make test'." >&2
	@exit 1

clean:
	cargo clean
	rm -rf dist
