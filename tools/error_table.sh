#!/usr/bin/env bash
# Summarises the [err] lines of the test logs (tests/gpu.sh writes them to errors-fp32.txt and
# errors-bf16.txt) into a markdown table: per operator, the number of checks and the largest
# normwise relative error in each build, plus the references' finite-difference checks.
# Usage: tools/error_table.sh errors-fp32.txt errors-bf16.txt
set -euo pipefail
summarise() {  # file -> "group checks max" lines
  awk '/^\[err\]/ {
    name = $2; rel = $0; sub(/.*rel=/, "", rel); sub(/ .*/, "", rel)
    if (name ~ /FiniteDiff|_fd$/) g = "fd:" name
    else if (name ~ /^model_/) { g = name; sub(/^model_/, "model:", g) }
    else if (name ~ /^dist_/) { g = name; sub(/_rank[0-9]+$/, "", g); sub(/^dist_/, "ranks:", g) }
    else if (name ~ /Gpu|^moe$|^router$|^ep$/) { g = tolower(name); sub(/\..*/, "", g); sub(/gpu/, "", g) }
    else next
    n[g]++; if (!(g in m) || rel + 0 > m[g] + 0) m[g] = rel
  } END { for (g in n) print g, n[g], m[g] }' "$1" | sort
}
join -a1 -a2 -e - -o 0,1.2,1.3,2.2,2.3 <(summarise "$1") <(summarise "$2") > /tmp/error_table.$$
echo "| operator | checks FP32 | max rel error FP32 (tol 1e-5; model 1e-4) | checks BF16 | max rel error BF16 (tol 2e-2) |"
echo "|---|---|---|---|---|"
grep -v '^fd:' /tmp/error_table.$$ | awk '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' | sed 's/model:\([a-z0-9_]*\)/whole model, \1/; s/ranks:\([A-Za-z0-9_]*\)/whole model on W ranks, \1/; s/^| ep |/| ep_moe (W = 2) |/; s/_/ /g'
echo
echo "References against central finite differences (double, tol 1e-6):"
echo
echo "| check | count | max rel error |"
echo "|---|---|---|"
grep '^fd:' /tmp/error_table.$$ | awk '{ sub(/^fd:/, "", $1); printf "| %s | %s | %s |\n", $1, $2, $3 }'
rm -f /tmp/error_table.$$
