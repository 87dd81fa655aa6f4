#!/usr/bin/env bash
# The pool's peak in a timeline CSV (train --timeline_step S, bench_ep_moe --timeline): the event that
# reached it, and each category's live bytes there beside that category's own largest over the window.
# What the per-rank prediction's terms (weights, grads, optimizer, boundaries = checkpoints, the layer's
# activations, dispatch = dispatch + expert_intermediates, runtime = workspace) are compared with.
# Usage: tools/timeline_peak.sh timeline.csv   (markdown to stdout)
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: tools/timeline_peak.sh timeline.csv" >&2; exit 1; }
csv=$1
[ -s "$csv" ] || { echo "timeline_peak: $csv is missing or empty" >&2; exit 1; }
head -1 "$csv" | grep -q '^t_us,action,bytes,category,tag,live_bytes,' ||
  { echo "timeline_peak: $csv is not a pool timeline (its header is not t_us,action,bytes,category,tag,live_bytes,...)" >&2; exit 1; }
awk -F, 'NR == 1 { for (i = 7; i <= NF; i++) name[i] = $i; last = NF; next }
  { for (i = 7; i <= last; i++) if ($i + 0 > most[i]) most[i] = $i + 0
    if ($6 + 0 > peak) { peak = $6 + 0; row = NR; what = $2 " " $4 " (" $5 ")"; for (i = 7; i <= last; i++) at[i] = $i + 0 } }
  END {
    if (row == 0) { print "timeline_peak: no events" > "/dev/stderr"; exit 1 }
    printf "pool peak %.2f MiB, reached by event %d: %s\n\n", peak / 1048576, row - 1, what
    print "| category | MiB at the peak | largest MiB in the window |"
    print "|---|---|---|"
    for (i = 7; i <= last; i++) printf "| %s | %.2f | %.2f |\n", name[i], at[i] / 1048576, most[i] / 1048576
  }' "$csv"
