#!/usr/bin/env bash
# Runs one fuzz target for a fixed time, one core, niced; prints libFuzzer's final statistics.
#
#   fuzz/run.sh TARGET [SECONDS]        e.g. fuzz/run.sh fingerprint 600
#
# Targets: idempotency_key, fingerprint, macro_values, stored_record, record_key (see README.md).
# -timeout is generous: on a shared, busy machine a niced run can be starved for seconds, and a
# starved input is no hang (every input here runs in microseconds).
# The committed seeds are in corpus/TARGET (seed-*); what libFuzzer adds goes to a scratch copy in
# target/corpus/TARGET, so a run never dirties the repository. A crash is saved under artifacts/TARGET.
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/run.sh TARGET [SECONDS]}
seconds=${2:-600}
case $target in
  idempotency_key) max_len=600 ;;   # > 2 x 255, to reach the length limit quoted and bare
  fingerprint) max_len=4096 ;;
  macro_values) max_len=256 ;;
  stored_record) max_len=2048 ;;
  record_key) max_len=2048 ;;       # four parts past the 255-byte bound
  *) echo "unknown target $target" >&2; exit 2 ;;
esac
mkdir -p "target/corpus/$target"
# cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
# No sanitizer: every crate of idem forbids unsafe code, and ASan would halve the executions.
RUSTC_BOOTSTRAP=1 nice -n 19 cargo fuzz run --sanitizer none "$target" \
  "target/corpus/$target" "corpus/$target" -- \
  -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=512 -max_len="$max_len" \
  -timeout=60 -print_final_stats=1
