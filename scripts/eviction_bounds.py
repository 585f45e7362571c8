#!/usr/bin/env python3
"""What an eviction policy can reach on a trace: online baselines against offline bounds.

Replays a trace in mkv-replay's Mooncake format (`hash_ids` of 512-token blocks, `input_length`,
optional `output_length`) through a block cache of a given size and prints the share of prompt
tokens served from it (full blocks of a cached prefix, as mkv-replay counts reuse). The cache is a
prefix tree: a block is kept only under its parent, only leaves are evicted, and the blocks of the
request being admitted are never victims. Policies:

  lru          least recently used leaf first (what mkv-replay's `--eviction lru` orders by).
  belady       the leaf used again furthest in the future first: the offline optimum's order.
  dead-oracle  LRU, but leaves that are never used again go first: a perfect predictor of
               *whether* a block is reused (not when). A policy that learns reuse from features
               can at most approach this.
  class-oracle a ranking by class and age (EVA, Beckmann et al., NSDI'18) given the true reuse-gap
               distribution of each class over the whole trace: class = how often the block was
               used (0, 1, 2, 3+ times) x how far from its prompt's end it sits (0, 1, 2, 3+
               blocks); `--classes output` adds the request's output length (6 buckets). Every
               online policy over those features has less to go on.
  class-online the same ranking learned as it goes (not a bound: an online candidate): per class,
               histograms of the ages at which blocks were hit and evicted, decayed and turned into
               ranks every 50 requests.

Why it exists: docs/context_cache.md ("Eviction policies") explains from these figures why no
policy reaches 1.3x LRU on the Mooncake sample. Run it on any trace of the same format:

  scripts/eviction_bounds.py TRACE --pool-tokens 1500000 3000000 [--policies lru belady ...]
  scripts/eviction_bounds.py --self-test
"""
import argparse
import bisect
import collections
import heapq
import json
import sys

POLICIES = ("lru", "belady", "dead-oracle", "class-oracle", "class-online")
NEVER = 1 << 60


def load(path):
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if "hash_ids" not in r or "input_length" not in r:
                sys.exit(f"eviction_bounds.py: line {n} of {path} has no hash_ids/input_length "
                         "(a Mooncake-format trace is needed)")
            reqs.append(r)
    return reqs


class Trace:
    """The requests with what every policy reads: each block's parent and its uses in order."""

    def __init__(self, reqs, block_tokens):
        self.reqs = reqs
        self.block = block_tokens
        self.total = sum(r["input_length"] for r in reqs)
        self.parent = {}
        self.uses = collections.defaultdict(list)
        for i, r in enumerate(reqs):
            p = None
            for h in r["hash_ids"]:
                self.parent.setdefault(h, p)
                self.uses[h].append(i)
                p = h


def output_bucket(r):
    o = r.get("output_length", 0)
    return bisect.bisect_right((5, 20, 100, 300, 1000), o)


def block_class(count, from_end, r, with_output):
    base = (min(count, 3), min(from_end, 3))
    return base + (output_bucket(r),) if with_output else base


def class_ranks(trace, with_output, horizon, age_step, ages):
    """rank[class][a // age_step]: hits within `horizon` requests per request of cache time, for
    a block of that class unused for `a` requests (EVA's hit rate per unit of space-time)."""
    gaps = collections.defaultdict(list)
    for i, r in enumerate(trace.reqs):
        ids = r["hash_ids"]
        for j, h in enumerate(ids):
            u = trace.uses[h]
            k = bisect.bisect_left(u, i)
            nxt = u[k + 1] - i if k + 1 < len(u) else NEVER
            gaps[block_class(k, len(ids) - 1 - j, r, with_output)].append(nxt)
    ranks = {}
    for c, g in gaps.items():
        g.sort()
        prefix = [0]
        for x in g:
            prefix.append(prefix[-1] + (x if x < NEVER else 0))
        row = []
        for a in range(0, ages * age_step, age_step):
            lo = bisect.bisect_right(g, a)
            hi = bisect.bisect_right(g, a + horizon)
            survivors = len(g) - lo
            if survivors == 0:
                row.append(0.0)
                continue
            time = (prefix[hi] - prefix[lo]) - a * (hi - lo) + (len(g) - hi) * horizon
            row.append((hi - lo) / max(time, 1))
        ranks[c] = row
    return ranks


class OnlineRanks:
    """class-online's state: decayed histograms of the ages (in requests, `step` a bucket) at which
    the blocks of each class were hit or evicted, and the ranks they give."""

    def __init__(self, step, buckets):
        self.step, self.buckets = step, buckets
        self.hits = collections.defaultdict(lambda: [0.0] * buckets)
        self.evictions = collections.defaultdict(lambda: [0.0] * buckets)

    def bucket(self, age):
        return min(age // self.step, self.buckets - 1)

    def hit(self, c, age):
        self.hits[c][self.bucket(age)] += 1

    def evicted(self, c, age):
        self.evictions[c][self.bucket(age)] += 1

    def ranks(self):
        """Per class and age bucket: the chance of a hit from that age on over the expected time
        left in the cache; then the histograms decay (weight 0.8 per 50 requests)."""
        out = {}
        for c in set(self.hits) | set(self.evictions):
            h, e = self.hits[c], self.evictions[c]
            row = [0.0] * self.buckets
            hits = events = weighted = 0.0
            for a in range(self.buckets - 1, -1, -1):
                hits += h[a]
                events += h[a] + e[a]
                weighted += (h[a] + e[a]) * a
                if events > 0:
                    remaining = (weighted / events - a) * self.step
                    row[a] = (hits / events) / max(remaining, 1.0)
            out[c] = row
            self.hits[c] = [x * 0.8 for x in h]
            self.evictions[c] = [x * 0.8 for x in e]
        return out


def replay(trace, pool_tokens, policy, with_output=False):
    cap = pool_tokens // trace.block
    if cap < 1:
        sys.exit(f"eviction_bounds.py: --pool-tokens {pool_tokens} holds no {trace.block}-token block")
    cached = {}            # block -> (class, last use)
    children = collections.Counter()
    used = collections.Counter()
    heaps = collections.defaultdict(list)  # class (or 0) -> [(key, version, block)]
    version = {}
    classed = policy in ("class-oracle", "class-online")
    ranks, age_step = {}, 1
    # The horizon is the cache's reach: how many requests it takes to insert a cache's worth of
    # new blocks, on average.
    horizon = max(1, int(cap / (len(trace.uses) / max(1, len(trace.reqs)))))
    if policy == "class-oracle":
        age_step = max(1, horizon // 50)
        ranks = class_ranks(trace, with_output, horizon, age_step, 400)
    online = OnlineRanks(max(1, 4 * horizon // 200), 200) if policy == "class-online" else None
    if online is not None:
        age_step = online.step

    def key(h, i, c):
        if policy == "lru" or classed:
            return i
        u = trace.uses[h]
        k = bisect.bisect_right(u, i)
        if policy == "belady":
            return -(u[k] if k < len(u) else NEVER)
        return (k < len(u), i)  # dead-oracle

    def offer(h, i):
        c, _ = cached[h]
        version[h] = version.get(h, 0) + 1
        heapq.heappush(heaps[c if classed else 0], (key(h, i, c), version[h], h))

    def top(heap, busy):
        skipped = []
        found = None
        while heap:
            entry = heap[0]
            h = entry[2]
            if h not in cached or version.get(h) != entry[1] or children[h]:
                heapq.heappop(heap)
                continue
            if h in busy:
                skipped.append(heapq.heappop(heap))
                continue
            found = entry
            break
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def evict(i, busy):
        if not classed:
            victim = top(heaps[0], busy)
        else:
            victim, best = None, None
            for c, heap in heaps.items():
                e = top(heap, busy)
                if e is None:
                    continue
                row = ranks.get(c)
                rank = row[min((i - e[0]) // age_step, len(row) - 1)] if row else 0.0
                if best is None or rank < best:
                    victim, best = e, rank
        if victim is None:
            sys.exit(f"eviction_bounds.py: a {trace.block}-token block pool of {cap} blocks cannot "
                     "hold one request's blocks; give a larger --pool-tokens")
        h = victim[2]
        if online is not None:
            online.evicted(cached[h][0], i - cached[h][1])
        del cached[h]
        version[h] = version.get(h, 0) + 1
        p = trace.parent[h]
        if p is not None:
            children[p] -= 1
            if p in cached and children[p] == 0:
                offer(p, cached[p][1])

    reused = 0
    for i, r in enumerate(trace.reqs):
        if online is not None and i % 50 == 0:
            ranks = online.ranks()
        ids = r["hash_ids"]
        hit = 0
        for h in ids:
            if h not in cached:
                break
            hit += 1
        reused += min(hit, r["input_length"] // trace.block) * trace.block
        busy = set(ids)
        for j, h in enumerate(ids):
            c = block_class(used[h], len(ids) - 1 - j, r, with_output) if classed else 0
            used[h] += 1
            if h in cached and online is not None:
                online.hit(cached[h][0], i - cached[h][1])
            if h not in cached:
                while len(cached) >= cap:
                    evict(i, busy)
                p = trace.parent[h]
                if p is not None:
                    children[p] += 1
            cached[h] = (c, i)
        for h in ids:
            if not children[h]:
                offer(h, i)
    return reused / trace.total if trace.total else 0.0


def self_test():
    # Three blocks of room. A: [1,2] B: [3,4] then A again: LRU keeps A's prefix only if it was
    # not the least recent; Belady keeps exactly what comes back.
    reqs = [{"input_length": 1024, "hash_ids": [1, 2]},
            {"input_length": 1024, "hash_ids": [3, 4]},
            {"input_length": 1024, "hash_ids": [5, 6]},
            {"input_length": 1024, "hash_ids": [1, 2]},
            {"input_length": 1024, "hash_ids": [5, 6]}]
    t = Trace(reqs, 512)
    got = {p: replay(t, 4 * 512, p) for p in POLICIES}
    # LRU: [5,6] evicts [1,2] (oldest), [1,2] evicts [3,4]: only the last request hits.
    assert got["lru"] == 1024 / 5120, got
    # Belady keeps [1,2] and [5,6] (both return) and drops [3,4]: requests 4 and 5 hit.
    assert got["belady"] == 2048 / 5120, got
    # The dead-block oracle knows [3,4] never returns: the same as Belady here.
    assert got["dead-oracle"] == 2048 / 5120, got
    assert 0 <= got["class-oracle"] <= got["belady"], got
    assert 0 <= got["class-online"] <= got["belady"], got
    # Leaves only: a shared root stays while a child of it is cached.
    reqs = [{"input_length": 1536, "hash_ids": [1, 2, 3]},
            {"input_length": 1536, "hash_ids": [1, 7, 8]},
            {"input_length": 1024, "hash_ids": [1, 9]}]
    t = Trace(reqs, 512)
    for p in POLICIES:
        assert replay(t, 3 * 512, p) == 1024 / 4096, (p, replay(t, 3 * 512, p))
    # A partial last block is never counted as reused.
    t = Trace([{"input_length": 700, "hash_ids": [1, 2]}, {"input_length": 700, "hash_ids": [1, 2]}],
              512)
    assert replay(t, 10 * 512, "lru") == 512 / 1400
    print("eviction_bounds.py self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--pool-tokens", type=int, nargs="+", default=[1500000, 3000000])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--classes", choices=("position", "output"), default="position",
                    help="class-oracle's classes: use count x position (default), or with the "
                    "request's output length as well")
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return
    if not a.trace:
        ap.error("a trace is needed (or --self-test)")
    t = Trace(load(a.trace), a.block_tokens)
    print(f"{len(t.reqs)} requests, {t.total} prompt tokens, {len(t.uses)} distinct blocks")
    print("pool tokens".ljust(12) + "".join(p.rjust(14) for p in a.policies))
    for pool in a.pool_tokens:
        row = [replay(t, pool, p, a.classes == "output") for p in a.policies]
        print(str(pool).ljust(12) + "".join(f"{100 * x:13.2f}%" for x in row))


if __name__ == "__main__":
    main()
