"""Counts, per policy and repeat of a cache-pressure run, the document reads that found their
document cached.

Usage: python3 doc_hits.py RUN_DIR
RUN_DIR holds `requests/*.jsonl` as `cargo xtask bench e2e` writes them, or gzipped
(`*.jsonl.gz`) as committed here.
A document read is a prompt of more than 2500 tokens (3000-token document and a 100-token
question, in the chat template); a one-off has 2000. A read found its document when its
engine reported at least 2000 cached tokens. Of each document's 6 reads the first is cold,
so 150 of the 180 reads can hit.
"""
import glob
import gzip
import json
import re
import sys


def main(run_dir):
    for path in sorted(glob.glob(f"{run_dir}/requests/*.jsonl*")):
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            reads = [o for o in map(json.loads, f) if o["prompt_tokens"] > 2500]
        hits = sum(o["cached_tokens"] >= 2000 for o in reads)
        name = re.sub(r"^cache-pressure-|\.jsonl(\.gz)?$", "", path.rsplit("/", 1)[-1])
        print(f"{name}: {hits} of {len(reads) - 30} warm reads found their document")


if __name__ == "__main__":
    main(*sys.argv[1:])
