#!/usr/bin/env bash
# The DDP example replicated, fully sharded and with ZeRO-2 on 2 ranks, the same slice, batches and seeds: the epoch's
# loss and test accuracy must agree, and so must the final parameters, to the bit (on 2 ranks the averages are the same
# float sums, halved exactly, and Adam is elementwise).
set -euo pipefail
run="$1" train="$2"
flags=(--epochs 1 --limit 1280)
replicated="$("$run" --nproc-per-node 2 "$train" "${flags[@]}")"
echo "$replicated"
line() { sed -n 's/.*epoch 1\/1 .*loss \([0-9.]*\)  test accuracy \([0-9.]*\).*/\1 \2/p' <<<"$1"; }
read -r loss_r acc_r <<<"$(line "$replicated")"
params_of() { sed -n 's/.*final parameters: \([0-9a-f]*\).*/\1/p' <<<"$1"; }
[ -n "$loss_r" ] || { echo "no epoch line from the replicated run" >&2; exit 1; }
for shard in full zero2; do
  sharded="$("$run" --nproc-per-node 2 "$train" "${flags[@]}" --shard "$shard")"
  echo "$sharded"
  read -r loss_s acc_s <<<"$(line "$sharded")"
  [ -n "$loss_s" ] || { echo "no epoch line from --shard $shard" >&2; exit 1; }
  [ -n "$(params_of "$sharded")" ] && [ "$(params_of "$sharded")" = "$(params_of "$replicated")" ] ||
    { echo "--shard $shard: final parameters $(params_of "$sharded"), replicated $(params_of "$replicated")" >&2; exit 1; }
  awk -v a="$loss_s" -v b="$loss_r" -v c="$acc_s" -v d="$acc_r" -v s="$shard" 'BEGIN {
    dl = a - b; if (dl < 0) dl = -dl; da = c - d; if (da < 0) da = -da;
    if (dl > 0.0015 || da > 0.002) { printf "--shard %s: loss %s accuracy %s; replicated: loss %s accuracy %s\n",
                                     s, a, c, b, d; exit 1 } }'
done
