"""How many warm document reads could any placement serve from cache on `cache-pressure`?

Usage: python3 placement_model.py

A model, not the simulator: 4 engines of 2437 blocks each evict least recently used blocks
first, as vLLM's prefix cache does; the workload is the benchmark's mix (30 documents of 188
blocks, each read 6 times with a 7-block question, among 180 one-offs of 125 blocks),
shuffled; requests run one at a time (nothing is pinned by a running request), and an
engine's load is the prefill it was given, decaying by 15 % per request. Placements:

- `least-load`: the engine with the least load plus new prefill (what `kv_aware` does,
  without its other terms);
- `evict-aware`: for a one-off, among engines within `slack` blocks of the cheapest, the one
  whose blocks it would evict hold the fewest document blocks (an oracle: it knows which
  blocks are documents);
- `one-off-engine`: one-offs go to engine 0 whenever it is within `slack` of the cheapest.

Prints warm document reads that hit (of 150) for five shuffles.
"""
import collections
import random

ENGINES, CAPACITY = 4, 2437
DOCUMENTS, READS, DOCUMENT_BLOCKS, QUESTION_BLOCKS = 30, 6, 188, 7
ONE_OFFS, ONE_OFF_BLOCKS = 180, 125
DECAY = 0.85


def run(seed, placement, slack):
    rng = random.Random(seed)
    items = [("doc", d, r) for d in range(DOCUMENTS) for r in range(READS)]
    items += [("one-off", i, 0) for i in range(ONE_OFFS)]
    rng.shuffle(items)
    caches = [collections.OrderedDict() for _ in range(ENGINES)]
    load = [0.0] * ENGINES
    hits = 0
    for kind, x, r in items:
        load = [l * DECAY for l in load]
        if kind == "doc":
            blocks = [("doc", x, b) for b in range(DOCUMENT_BLOCKS)] + [("q", x, r, b) for b in range(QUESTION_BLOCKS)]
        else:
            blocks = [("one-off", x, b) for b in range(ONE_OFF_BLOCKS)]
        overlap = []
        for cache in caches:
            n = 0
            while n < len(blocks) and blocks[n] in cache:
                n += 1
            overlap.append(n)
        new = [len(blocks) - o for o in overlap]
        cost = [l + n for l, n in zip(load, new)]
        near = [e for e in range(ENGINES) if cost[e] <= min(cost) + slack]

        def documents_evicted(e):
            cache = caches[e]
            evicted = max(0, new[e] - (CAPACITY - len(cache)))
            return sum(b[0] == "doc" for b in list(cache)[:evicted])

        if kind == "one-off" and placement == "evict-aware":
            e = min(near, key=lambda e: (documents_evicted(e), cost[e]))
        elif kind == "one-off" and placement == "one-off-engine":
            e = min(near, key=lambda e: (e != 0, cost[e]))
        else:
            e = min(range(ENGINES), key=lambda e: cost[e])
        hits += kind == "doc" and r > 0 and overlap[e] >= DOCUMENT_BLOCKS
        cache = caches[e]
        for b in blocks:
            cache[b] = True
            cache.move_to_end(b)
        while len(cache) > CAPACITY:
            cache.popitem(last=False)
        load[e] += new[e]
    return hits


def main():
    print("least-load:", [run(s, "least-load", 0) for s in range(5)])
    for slack in [125, 250, 500]:
        for placement in ["evict-aware", "one-off-engine"]:
            print(f"{placement}, slack {slack}:", [run(s, placement, slack) for s in range(5)])


if __name__ == "__main__":
    main()
