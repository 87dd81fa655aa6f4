#!/usr/bin/env bash
# Runs each GoogleTest binary given as an argument, keeps its log under build/test-logs/, and ends
# with one line over all of them: "N passed, N failed, N skipped". Exit status 1 if anything failed.
# A binary that ends without its gtest summary (it crashed, or exited from inside a test) keeps the
# results of the tests that ran (their "[       OK ]", "[  FAILED  ]", "[  SKIPPED ]" lines), plus one
# failure for the crash, and the script names the test that was running (the last "[ RUN      ]"
# without a result).
set -u
mkdir -p build/test-logs
passed=0; failed=0; skipped=0
for bin in "$@"; do
  name=$(echo "$bin" | tr '/' '_')
  log="build/test-logs/$name.log"
  echo "=== $bin"
  "$bin" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if grep -q '^\[  PASSED  \] [0-9]* test' "$log"; then
    p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -1)
    f=${f:-0}; s=${s:-0}
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
      echo "!!! $bin exited with status $rc without a gtest failure: counted as 1 failure"
      f=1
    fi
  else
    # one result line per test that ended: "[       OK ] Suite.Name (12 ms)"
    p=$(grep -c '^\[       OK \] .* ([0-9]* ms)$' "$log")
    f=$(grep -c '^\[  FAILED  \] .* ([0-9]* ms)$' "$log")
    s=$(grep -c '^\[  SKIPPED \] .* ([0-9]* ms)$' "$log")
    running=$(awk '/^\[ RUN      \] /     { running = substr($0, 14) }
                   /^\[( +OK |  FAILED  |  SKIPPED )\] .* \([0-9]+ ms\)$/ { running = "" }
                   END { print running }' "$log")
    echo "!!! $bin ended with status $rc without a gtest summary, $(
      [ -n "$running" ] && echo "while running $running" || echo "after its last test had ended")"
    echo "!!! counted the $((p + f + s)) tests that ended, plus 1 failure for the crash"
    f=$((f + 1))
  fi
  echo "--- $bin: $p passed, $f failed, $s skipped"
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
done
if [ "$skipped" -gt 0 ]; then
  echo "($skipped tests skipped: GPU tests need a CUDA device; see the logs for which)"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
