#!/usr/bin/env bash
# Plots training logs (OUT/log.csv written by train) with Debian's gnuplot.
# Usage: tools/plot_loss.sh out.png TITLE log.csv [log.csv ...]
#   one log:   its train loss per logged step and its validation loss
#   several:   every run's train loss (thin) and validation loss (points), each run named by its folder
#              (runs/ep/log.csv is "ep"), in one plot: the runs' curves side by side; below it, each run's
#              train loss minus the first run's at the steps both logged (where curves that agree differ)
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: tools/plot_loss.sh out.png TITLE log.csv [log.csv ...]" >&2; exit 1; }
png=$1; title=$2; shift 2
command -v gnuplot > /dev/null || { echo "gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
for csv in "$@"; do [ -s "$csv" ] || { echo "plot_loss: $csv is missing or empty" >&2; exit 1; }; done
colors=("#7570b3" "#d95f02" "#1b9e77" "#e7298a" "#66a61e" "#e6ab02" "#a6761d" "#666666")
gaps_dir=$(mktemp -d)
trap 'rm -rf "$gaps_dir"' EXIT
plots=()
gaps=()
i=0
for csv in "$@"; do
  c=${colors[$((i % ${#colors[@]}))]}
  if [ $# -eq 1 ]; then train="train (per step)"; val="validation"
  else name=$(basename "$(dirname "$csv")"); train="$name train"; val="$name validation"; fi
  plots+=("\"$csv\" using 1:(\$2 == \$2 ? \$2 : 1/0) every ::1 with lines lw 1 lc rgb \"$c\" title \"$train\"")
  plots+=("\"$csv\" using 1:(\$3 == \$3 ? \$3 : 1/0) every ::1 with linespoints pt $((5 + i % 4)) ps 0.9 lw 2 lc rgb \"$c\" title \"$val\"")
  if [ "$i" -gt 0 ]; then
    awk -F, 'FNR == 1 { file++; next } $2 == "nan" { next } file == 1 { base[$1] = $2; next }
             $1 in base { print $1, $2 - base[$1] }' "$1" "$csv" > "$gaps_dir/$i"
    gaps+=("\"$gaps_dir/$i\" using 1:2 with lines lw 1.5 lc rgb \"$c\" title \"$name\"")
  fi
  i=$((i + 1))
done
joined=$(printf '%s, ' "${plots[@]}")
if [ $# -eq 1 ]; then
  layout="set size 1,1"; below=""
else
  first=$(basename "$(dirname "$1")")
  layout="set multiplot; set size 1,0.68; set origin 0,0.32"
  gap_plots=$(printf '%s, ' "${gaps[@]}")
  below="set size 1,0.32; set origin 0,0; unset title; set ylabel \"train loss - $first's\"; set key top right maxrows 2
plot ${gap_plots%, }
unset multiplot"
fi
gnuplot <<GP
set terminal pngcairo size 1000,$([ $# -eq 1 ] && echo 560 || echo 820) noenhanced font ",11"
set output "$png"
set datafile separator ","
set datafile missing "nan"
$layout
set title "flatmoe training: $title"
set xlabel "step"
set ylabel "loss (nats/token)"
set grid
set key top right
plot ${joined%, }
set datafile separator whitespace
$below
GP
echo "wrote $png"
