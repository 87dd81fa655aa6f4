#!/usr/bin/env bash
# Plots a training log (OUT/log.csv written by train) — train loss per step and validation loss —
# with Debian's gnuplot. Usage: tools/plot_loss.sh log.csv out.png [title]
set -euo pipefail
csv=$1; png=$2; title=${3:-$csv}
command -v gnuplot > /dev/null || { echo "gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
gnuplot <<GP
set terminal pngcairo size 1000,560 noenhanced font ",11"
set output "$png"
set datafile separator ","
set datafile missing "nan"
set title "flatmoe training: $title"
set xlabel "step"
set ylabel "loss (nats/token)"
set grid
set key top right
plot "$csv" using 1:(\$2 == \$2 ? \$2 : 1/0) every ::1 with lines lw 1 lc rgb "#7570b3" title "train (per step)", \
     "$csv" using 1:(\$3 == \$3 ? \$3 : 1/0) every ::1 with linespoints pt 7 ps 0.8 lw 2 lc rgb "#d95f02" title "validation"
GP
echo "wrote $png"
