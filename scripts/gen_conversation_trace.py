#!/usr/bin/env python3
"""Writes a multi-turn conversation trace in mkv-replay's Mooncake JSONL format (one hash id per
512-token block; equal ids are equal blocks), for comparing eviction policies
(docs/context_cache.md, "Eviction policies").

  interleaved: 300 conversations of 3-8 turns, 40 live at a time, each arrival picks a random live
               conversation (turn gaps vary), 30 % of arrivals are one-off prompts of 4-16
               blocks; 4 shared 2-block system prompts; a turn appends 1-4 blocks.
  roundrobin:  60 conversations on one 2-block system prompt, 6 turns, strictly turn by turn (a
               loop over every conversation); a turn appends 1-3 blocks.
  diverge:     explicit token prompts (mkv-replay's own JSONL): 600 requests over 120 documents of
               2k-12k tokens, each keeping a uniformly random prefix of its document (a quarter
               to all but one token) and adding 16-400 fresh tokens, so follow-ups diverge at any
               position, not at block boundaries (docs/context_cache.md, "Reuse points").

--salts N gives every conversation (diverge: every document) the cache salt tenant-<k>, k its
number modulo N (a one-off prompt: its first block id modulo N), so that tenants share nothing
and each reuses its own history (docs/lifecycle.md, "In-flight admission").
"""
import argparse
import json
import random


def interleaved(seed, convs=300, active=40, oneoff=0.3, variants=4):
    rnd = random.Random(seed)
    nid = [100000]

    def new(n):
        ids = list(range(nid[0], nid[0] + n))
        nid[0] += n
        return ids

    systems = [new(2) for _ in range(variants)]
    pending, live, state, out, ts = list(range(convs)), [], {}, [], 0
    while pending or live:
        while len(live) < active and pending:
            c = pending.pop(0)
            live.append(c)
            state[c] = [list(rnd.choice(systems)), rnd.randint(3, 8)]
        ts += rnd.randint(100, 2000)
        if rnd.random() < oneoff:
            ids = new(rnd.randint(4, 16))
            c = ids[0]
        else:
            c = rnd.choice(live)
            st = state[c]
            st[0] += new(rnd.randint(1, 4))
            st[1] -= 1
            ids = list(st[0])
            if st[1] == 0:
                live.remove(c)
        out.append({"timestamp": ts, "input_length": 512 * len(ids) - rnd.randint(0, 300),
                    "output_length": rnd.randint(50, 400), "hash_ids": ids, "_tenant": c})
    return out


def roundrobin(seed, convs=60, turns=6):
    rnd = random.Random(seed)
    nid = 100000
    history = [[0, 1] for _ in range(convs)]
    out = []
    for _ in range(turns):
        for c, ids in enumerate(history):
            n = rnd.randint(1, 3)
            ids += list(range(nid, nid + n))
            nid += n
            out.append({"input_length": 512 * len(ids) - 100, "output_length": 100,
                        "hash_ids": list(ids), "_tenant": c})
    return out


def diverge(seed, docs=120, requests=600):
    rnd = random.Random(seed)
    texts = [[rnd.randint(10, 30000) for _ in range(rnd.randint(2000, 12000))]
             for _ in range(docs)]
    out = []
    for _ in range(requests):
        doc = rnd.randrange(len(texts))
        text = texts[doc]
        cut = rnd.randint(len(text) // 4, len(text) - 1)
        tail = [rnd.randint(10, 30000) for _ in range(rnd.randint(16, 400))]
        out.append({"prompt": text[:cut] + tail, "max_new_tokens": rnd.randint(8, 64),
                    "_tenant": doc})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=["interleaved", "roundrobin", "diverge"])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=None,
                        help="7 (interleaved), 3 (roundrobin), 11 (diverge)")
    parser.add_argument("--salts", type=int, default=0,
                        help="number of tenants, each with its own cache salt (0: no salt)")
    args = parser.parse_args()
    if args.shape == "interleaved":
        rows = interleaved(7 if args.seed is None else args.seed)
    elif args.shape == "diverge":
        rows = diverge(11 if args.seed is None else args.seed)
    else:
        rows = roundrobin(3 if args.seed is None else args.seed)
    with open(args.out, "w") as f:
        for row in rows:
            tenant = row.pop("_tenant")
            if args.salts > 0:
                row["salt"] = f"tenant-{tenant % args.salts}"
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
