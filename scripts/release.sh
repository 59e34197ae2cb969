#!/usr/bin/env bash
# `make release`: the versioned artefacts of this checkout in dist/release/ (docs/releasing.md):
#   idemgate-<version>.wasm                  the module (scripts/build-wasm.sh, as `make build`)
#   idemgate-<version>-<arch>-linux          the operator CLI (cargo build --release --bin idemgate)
#   idemgate-<version>.oci.tar               the module as an OCI image archive tagged <version>
#   idemgate-<version>.commit                the commit built, and whether the tree had changes
#   SHA256SUMS                               sha256sum -c SHA256SUMS checks them
# The version is Cargo.toml's. A version recorded in RELEASES must be built from its recorded commit
# with a clean tree; anything else (a -dev version) is built, named as it is, and said to be unreleased.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
commit=$(git rev-parse HEAD)
changes=$(git status --porcelain --untracked-files=no | head -1)
recorded=$(awk -v v="$version" '$1 == v {print $2}' RELEASES)
if [ -n "$recorded" ] && { [ "$recorded" != "$commit" ] || [ -n "$changes" ]; }; then
  echo "release: $version is recorded in RELEASES as $recorded; this is $commit${changes:+ with uncommitted changes}: check out $recorded to rebuild it" >&2
  exit 1
fi
scripts/build-wasm.sh
cargo build --locked --release --quiet --bin idemgate
out=dist/release
rm -rf "$out"
mkdir -p "$out"
cp dist/idemgate.wasm "$out/idemgate-$version.wasm"
cp target/release/idemgate "$out/idemgate-$version-$(uname -m)-linux"
python3 scripts/oci-image.py dist/idemgate.wasm "$version" "$commit" "$out/idemgate-$version.oci.tar"
{
  echo "version $version"
  echo "commit $commit${changes:+ (with uncommitted changes)}"
  if [ -n "$recorded" ]; then echo "release recorded in RELEASES"; else echo "not (yet) recorded in RELEASES"; fi
} > "$out/idemgate-$version.commit"
(cd "$out" && sha256sum idemgate-* > SHA256SUMS)
echo "release: $out (version $version, commit ${commit:0:12}${changes:+, uncommitted changes}$([ -n "$recorded" ] || echo ', not (yet) recorded in RELEASES'))"
cat "$out/SHA256SUMS"
