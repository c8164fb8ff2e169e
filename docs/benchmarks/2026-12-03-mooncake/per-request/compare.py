"""Compares the same requests under two policies of one benchmark run.

Usage: python3 compare.py RUN_DIR POLICY_A POLICY_B
RUN_DIR holds `requests/*.jsonl` (written by `cargo xtask bench e2e`; gzipped, `*.jsonl.gz`,
in the runs committed here); each line is one
request's outcome, and `request` names it alike under every policy. Prints, for the requests
both served, the median per-request TTFT difference (A - B) and ratio, split by whether A's
engine found more, as much, or less of the prompt cached than B's.
"""
import glob
import gzip
import json
import statistics
import sys


def load(run_dir, policy):
    [path] = glob.glob(f"{run_dir}/requests/*-{policy}-1gw-*-r0.jsonl*")
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return {o["request"]: o for o in map(json.loads, f) if o["ttft"] is not None}


def main(run_dir, a_name, b_name):
    a, b = load(run_dir, a_name), load(run_dir, b_name)
    both = [k for k in a if k in b]
    groups = {"more cache": [], "same cache": [], "less cache": []}
    for k in both:
        more = a[k]["cached_tokens"] - b[k]["cached_tokens"]
        groups["more cache" if more > 0 else "less cache" if more < 0 else "same cache"].append(k)
    print(f"{a_name} vs {b_name}: {len(both)} requests served by both")
    for name, keys in [("all", both), *groups.items()]:
        if keys:
            delta = statistics.median(a[k]["ttft"] - b[k]["ttft"] for k in keys) * 1e3
            ratio = statistics.median(a[k]["ttft"] / b[k]["ttft"] for k in keys)
            print(f"  {name:>10}: {len(keys):4} requests, median TTFT difference {delta:+6.1f} ms, ratio {ratio:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
