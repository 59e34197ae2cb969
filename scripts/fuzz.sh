#!/usr/bin/env bash
# Bounded fuzzing of the parsers that take outside input: key header, stored records and
# buckets, store answers, plugin configuration, JSON canonicaliser, MCP bodies, event streams,
# replays and form bodies, urlencoded and multipart (fuzz/fuzz_targets/).
#   scripts/fuzz.sh [seconds per target, default 60; make test passes 30, make fuzz 300]
# Seed corpora live in fuzz/corpus/<target>; findings are written to fuzz/artifacts/ and fail
# the run. Every target runs with a small allocation limit (one allocation of 64 MB or more, or
# 1 GB resident, fails), and store_answers, etcd_answers and record_decoder also count the bytes they hold
# (fuzz/fuzz_targets/alloc_meter.rs): more than a few bytes per input byte fails.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
command -v cargo-fuzz >/dev/null || timeout 600 cargo install --quiet cargo-fuzz
rustup toolchain list | grep -q nightly || { echo "fuzz: needs the nightly toolchain (rustup toolchain install nightly)" >&2; exit 1; }
# The run count from libFuzzer's last line ("Done <runs> runs in <seconds> second(s)"), empty if none.
runs_of() { grep -oE "^Done [0-9]+ runs" "$1" | grep -oE "[0-9]+" | tail -1 || true; }
mkdir -p target/faults
report=$(pwd)/target/faults/fuzz.md
: > "$report"
cd fuzz
for t in key_parser record_decoder store_answers etcd_answers config_parser canonical_json mcp_messages form_bodies; do
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  # A private copy of the seeds: the committed corpus stays small and reviewed.
  work=$(mktemp -d)
  [ -d "corpus/$t" ] && cp -r "corpus/$t/." "$work/"
  log="$work.log"
  status=0
  cargo +nightly fuzz run "$t" "$work" -- -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 \
    -malloc_limit_mb=64 -rss_limit_mb=1024 >"$log" 2>&1 || status=$?
  grep -E "^#[0-9]+[[:space:]]+DONE|ERROR|panicked|SUMMARY" "$log" || true
  rm -rf "$work"
  if [ "$status" -ne 0 ]; then
    tail -30 "$log" >&2
    echo "fuzz: $t failed (exit $status)" >&2
    exit 1
  fi
  if ls "artifacts/$t"/crash-* "artifacts/$t"/oom-* "artifacts/$t"/timeout-* >/dev/null 2>&1; then
    echo "fuzz: $t found a failing input in fuzz/artifacts/$t" >&2
    exit 1
  fi
  # "No failure" only for a run that says how many inputs it tried: without the count (libFuzzer
  # never reached its end, or its output changed) or with none tried, nothing was shown.
  runs=$(runs_of "$log")
  if [ -z "$runs" ] || [ "$runs" -eq 0 ]; then
    tail -30 "$log" >&2
    echo "fuzz: $t: no run count above 0 in libFuzzer's output (a line \"Done N runs in S second(s)\"): cannot say it fuzzed anything" >&2
    exit 1
  fi
  echo "| $t | $runs | ${SECONDS_PER_TARGET} s | no failure |" >> "$report"
  rm -f "$log"
done
echo "fuzz: no failure found"
