"""Medians of bench/run.sh's JSON lines over rounds, per implementation, and Tandem's ratio to each peer.

  ROUNDS=5 bash bench/run.sh ddp | tee ddp.jsonl | python3 bench/summarize.py

A figure is keyed by its metric and, when present, bucket_cap_mb and gradient_as_bucket_view; the ratio is tandem / peer (for times lower is
better for Tandem, for rates and bandwidths higher)."""
import collections
import json
import statistics
import sys

values = collections.defaultdict(lambda: collections.defaultdict(list))
units = {}
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    key = d["metric"] + "".join(f" {k}={str(d[k]).lower()}" for k in ("bucket_cap_mb", "gradient_as_bucket_view") if k in d)
    values[key][d["impl"]].append(d["value"])
    units[key] = d["unit"]
for key, by_impl in values.items():
    med = {impl: statistics.median(v) for impl, v in by_impl.items()}
    parts = [f"{impl} {m:.4g} {units[key]} (n={len(by_impl[impl])})" for impl, m in med.items()]
    ratios = [f"tandem/{impl} {med['tandem'] / m:.2f}" for impl, m in med.items() if impl != "tandem" and "tandem" in med and m]
    print(f"{key}: " + ", ".join(parts) + ("; " + ", ".join(ratios) if ratios else ""))
