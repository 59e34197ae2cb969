# Sourced by the build and test scripts: chooses how to compile for wasm32 target $1.
#   - rustup's own target std when it is installed (a laptop with `rustup target add`);
#   - otherwise Debian's rustc-web 1.96 with its std source (rust-web-src), building std itself
#     (-Zbuild-std) and linking with wasm-ld-22, as verified in ../shared/TOOLCHAIN.md.
# Sets WASM_CARGO_FLAGS (extra cargo flags) and WASM_TARGET_DIR, and exports the variables
# the fallback needs. Host builds must not inherit these: call it in a subshell or script.
wasm_env() {
  local target=$1
  local libdir
  WASM_CARGO_FLAGS=""
  WASM_TARGET_DIR="target"
  WASM_TOOLCHAIN="rustup"
  # The filter's target (wasm32-wasip1: the shipped module, every test and benchmark build of it,
  # and benches/hot_path.rs under Node) is built with LLVM's inliner threshold at 200 instead of
  # its default 225 (issue 27's module budget, measured on 04ed7f3 after wasm-opt -Oz: 721,437 ->
  # 693,470 bytes; 175: 684,573; 150: 671,241; opt-level "s": 633,316). The core's per-request
  # steps under V8, the two builds alternated in 8 rounds pinned to one core: median of the
  # per-step ratios 0.989, every step's median within 0.93-1.11 of the default's, within this
  # VM's noise (single rounds 0.63-1.44); opt-level "s" was 1.71 times slower, 150 1.13.
  # wasm32-unknown-unknown (the core's tests under Node) keeps the default.
  WASM_WASIP1_RUSTFLAGS="-C llvm-args=-inline-threshold=200"
  if [ "$target" = wasm32-wasip1 ]; then
    export CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="$WASM_WASIP1_RUSTFLAGS"
  fi
  if [ -z "${IDEMGATE_FORCE_DEBIAN_WASM:-}" ]; then
    libdir=$(rustc --print target-libdir --target "$target" 2>/dev/null || true)
    if [ -n "$libdir" ] && ls "$libdir"/libcore-* >/dev/null 2>&1; then
      return 0
    fi
  fi
  WASM_TOOLCHAIN="debian"
  export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1
  export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=wasm-ld-22
  export CARGO_TARGET_WASM32_WASIP1_LINKER=wasm-ld-22
  export CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="-C link-self-contained=no -L /usr/lib/wasm32-wasi $WASM_WASIP1_RUSTFLAGS"
  WASM_CARGO_FLAGS="-Zbuild-std=std,panic_abort"
  # A separate target folder: artifacts of two compilers never mix, and host builds stay cached.
  WASM_TARGET_DIR="target/debian-wasm"
}
