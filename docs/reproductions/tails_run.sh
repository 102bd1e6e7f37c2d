#!/usr/bin/env bash
# Runs the Attack-of-the-Tails CPU-scale reproduction (docs/attack-of-the-tails.md).
# Usage: FEDSIM_DATA_DIR=../shared/data bash docs/reproductions/tails_run.sh [OUT]
set -euo pipefail
out="${1:-results/tails}"
run() { fedsim run "$@" --output "$out"; }
for mode in blackbox pgd pgd_replacement; do
  run "scenarios/paper/mnist_ardis_${mode}.yaml"
  run "scenarios/paper/mnist_ardis_${mode}_clip.yaml"
done
# (b) normal-case: 5% of the clients also hold the other ARDIS 7s, correctly labelled
run scenarios/paper/mnist_ardis_blackbox.yaml --set name=mnist_ardis_blackbox_normalcase --set attack.honest_copies=normal
# (d) PGD + replacement with eps fitted to the clipping bound (eps = delta / Gamma)
run scenarios/paper/mnist_ardis_pgd_replacement_clip.yaml --set name=mnist_ardis_pgd_replacement_fitclip --set attack.fit_clip_bound=1.0
# (e) Krum (f = 1) against black-box and against PGD with a small eps
run scenarios/paper/mnist_ardis_blackbox.yaml --set name=mnist_ardis_blackbox_krum --set aggregator=krum
run scenarios/paper/mnist_ardis_pgd.yaml --set name=mnist_ardis_pgd_krum --set aggregator=krum --set attack.eps=0.5
