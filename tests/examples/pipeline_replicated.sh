#!/usr/bin/env bash
# The pipeline example on 2 replicas x 2 stages (5 processes) and on one 2-stage pipeline (3 processes), the same
# slice, batches and seeds: each epoch's loss and test accuracy printed by both must agree (the replicas sum to the
# batch's gradient; float32 sums in another order may move the fourth decimal of the loss by one).
set -euo pipefail
run="$1" train="$2"
flags=(--epochs 1 --limit 1280 --timeline "")
replicated="$("$run" --nproc-per-node 5 "$train" "${flags[@]}" --replicas 2)"
single="$("$run" --nproc-per-node 3 "$train" "${flags[@]}")"
echo "$replicated"
echo "$single"
line() { sed -n 's/.*epoch 1\/1 .*loss \([0-9.]*\)  test accuracy \([0-9.]*\).*/\1 \2/p' <<<"$1"; }
read -r loss_r acc_r <<<"$(line "$replicated")"
read -r loss_s acc_s <<<"$(line "$single")"
[ -n "$loss_r" ] && [ -n "$loss_s" ] || { echo "no epoch line" >&2; exit 1; }
grep -q "2 replicas" <<<"$replicated" || { echo "the replicated run did not say it had 2 replicas" >&2; exit 1; }
awk -v a="$loss_r" -v b="$loss_s" -v c="$acc_r" -v d="$acc_s" 'BEGIN {
  dl = a - b; if (dl < 0) dl = -dl; da = c - d; if (da < 0) da = -da;
  if (dl > 0.0015 || da > 0.002) { printf "replicated loss %s accuracy %s, single loss %s accuracy %s\n", a, c, b, d;
                                   exit 1 } }'
