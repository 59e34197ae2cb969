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
  export CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="-C link-self-contained=no -L /usr/lib/wasm32-wasi"
  WASM_CARGO_FLAGS="-Zbuild-std=std,panic_abort"
  # A separate target folder: artifacts of two compilers never mix, and host builds stay cached.
  WASM_TARGET_DIR="target/debian-wasm"
}
