#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) each, starting from the
# committed corpus. Needs cargo-fuzz; on a stable toolchain RUSTC_BOOTSTRAP
# lets it use the sanitizer flags.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
for t in segment node values tree_vs_btreemap footer frames; do
  echo "== fuzzing $t for ${secs}s"
  RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096
done
