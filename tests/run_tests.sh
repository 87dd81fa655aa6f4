#!/usr/bin/env bash
# Runs each GoogleTest binary given as an argument, keeps its log under build/test-logs/, and ends
# with one line over all of them: "N passed, N failed, N skipped". Exit status 1 if anything failed
# (a binary that crashes counts as one failure).
set -u
mkdir -p build/test-logs
passed=0; failed=0; skipped=0
for bin in "$@"; do
  name=$(echo "$bin" | tr '/' '_')
  log="build/test-logs/$name.log"
  echo "=== $bin"
  "$bin" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
  p=${p:-0}; f=${f:-0}; s=${s:-0}
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "!!! $bin exited with status $rc without a gtest failure summary: counted as 1 failure"
    f=1
  fi
  echo "--- $bin: $p passed, $f failed, $s skipped"
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
done
if [ "$skipped" -gt 0 ]; then
  echo "($skipped tests skipped: GPU tests need a CUDA device; see the logs for which)"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
