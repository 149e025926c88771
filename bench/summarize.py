"""Medians of bench/run.sh's JSON lines over rounds, per implementation, and Tandem's ratio to each peer.

  ROUNDS=5 bash bench/run.sh ddp | tee ddp.jsonl | python3 bench/summarize.py

A figure is keyed by its metric and the fields that say what was measured: every field whose value is a string, a
boolean or an integer (bucket_cap_mb, gradient_as_bucket_view, mode, config, size, m, schedule, replicas, observers,
...), except the line's own (impl, unit, value, bench), free text (what, note), the seed (rounds with different seeds
are one figure), results that are counts or flags (samples, uncounted_allocations, solved_all, buckets) and
measurements (names ending in a unit: _us, _ms, _mib, ...). Lines that differ in any of these are
separate figures. A Tandem figure is compared with each peer figure of the same metric whose fields agree with its
own on every field both have (a field only one side prints, such as Tandem's shared_buckets, does not keep them
apart); the ratio is tandem / peer (for times lower is better for Tandem, for rates and bandwidths higher)."""
import collections
import json
import statistics
import sys

# Not what was measured: the line's own fields, free text, the seed, and results that are counts or flags (they vary
# between rounds of one configuration).
OWN = {"impl", "unit", "value", "bench", "metric", "what", "note", "seed", "samples", "uncounted_allocations",
       "solved_all", "buckets"}
MEASURED = ("_us", "_ms", "_s", "_mib", "_kib", "_gib", "_bytes_per_s", "_gbps", "_per_s", "_ratio", "_busy",
            "_efficiency", "_run")


def descriptive(key, value):
    if key in OWN or key.lower().endswith(MEASURED):
        return False
    return isinstance(value, (str, bool, int))


values = collections.defaultdict(list)  # (metric, fields, impl) -> values
units = {}
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    fields = tuple(sorted((k, json.dumps(v)) for k, v in d.items() if descriptive(k, v)))
    values[(d["metric"], fields, d["impl"])].append(d["value"])
    units[d["metric"]] = d["unit"]


medians = {key: statistics.median(v) for key, v in values.items()}
figures = collections.defaultdict(dict)  # (metric, fields) -> impl -> (median, n)
for (metric, fields, impl), m in medians.items():
    figures[(metric, fields)][impl] = (m, len(values[(metric, fields, impl)]))
# A figure is labelled with the fields that tell it from the metric's other figures (those whose value, or presence,
# is not the same in all of them).
seen = collections.defaultdict(lambda: collections.defaultdict(set))  # metric -> field -> values (None: absent)
for metric, fields in figures:
    own = dict(fields)
    for k in {k for m2, f2 in figures if m2 == metric for k, _ in f2}:
        seen[metric][k].add(own.get(k))


def label(metric, fields):
    return metric + "".join(f" {k}={v.strip(chr(34)).lower()}" for k, v in fields if len(seen[metric][k]) > 1)

for (metric, fields), by_impl in figures.items():
    parts = [f"{impl} {m:.4g} {units[metric]} (n={n})" for impl, (m, n) in by_impl.items()]
    ratios = []
    if "tandem" in by_impl:
        mine, own = by_impl["tandem"][0], dict(fields)
        for (metric2, fields2), others in figures.items():
            if metric2 != metric or any(own.get(k, v) != v for k, v in fields2):
                continue
            for impl, (m, _) in others.items():
                if impl == "tandem" or not m:
                    continue
                where = "" if label(metric, fields2) == label(metric, fields) else " [" + label(metric, fields2)[len(metric):].strip() + "]"
                ratios.append(f"tandem/{impl}{where} {mine / m:.2f}")
    print(f"{label(metric, fields)}: " + ", ".join(parts) + ("; " + ", ".join(ratios) if ratios else ""))
