#!/usr/bin/env python3
"""A KV-aware router's view of mkv-replay's KV events, decoded independently of the encoder.

Runs mkv-replay with --kv-events on an ephemeral loopback port, subscribes with pyzmq, decodes
every batch with the msgpack package and rebuilds the cache's block set from the events alone,
checking on the way what routers such as Dynamo's and llm-d's rely on (3 frames, big-endian
sequence numbers without a gap, [timestamp, [events], rank] payloads, unique unsigned 64-bit
block hashes, known parents, block_size tokens per block). The replay clears its prefix cache
once on the way (--reset-cache-every: one AllBlocksCleared). The set must equal the index that
mkv-replay reports at the end (--json), first from the live stream, then again after a resync
through the replay socket from a sequence number before the clear. Batches the subscriber missed
before its subscription reached the publisher (ZeroMQ's slow joiner) are fetched through the
replay socket, so the outcome does not depend on timing.

With MODE connect (default: bind) the subscriber binds its SUB socket on an ephemeral loopback
port first and mkv-replay's publisher connects to it (an endpoint without a wildcard), the way a
deployment whose router listens is wired. MODE sliding runs the composed backend (sliding layers
with context reuse, --window): every event carries vLLM's group fields, and the subscriber keeps
one block set per group, the full layers' (group 0) and the sliding pool's windows (group 1),
each of which must equal the index mkv-replay reports for that pool.

usage: kv_event_subscriber.py MKV_REPLAY TRACE ENCODING (map|array) [MODE (bind|connect|sliding)]
Prints 'N passed, 0 failed' and exits 0 on success; exits 1 naming the first failed check.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import msgpack
import zmq
import zmq.utils.monitor

PAGE_SIZE = 64
LIMIT = 60
RESET_EVERY = 40  # one prefix cache reset (AllBlocksCleared) after request 40 of 60
DEADLINE_S = 60.0  # everything below is bounded by this
END_SEQUENCE = -1
WINDOW = 512  # MODE sliding: the sliding layers' window in tokens (8 pages)

FIELDS = {  # positional layout of the older vLLM encoding, after the class name
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window"],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


class CheckFailed(Exception):
    pass


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left_ms(self):
        left = self.end - time.monotonic()
        check(left > 0, "the test ran out of time")
        return int(left * 1000)


def decode_event(raw, encoding):
    if encoding == "map":
        check(isinstance(raw, dict), f"event {raw!r} is not a tagged map")
        kind = raw.get("type")
        check(kind in FIELDS, f"unknown event type {kind!r}")
        fields = dict(raw)
        del fields["type"]
        check(set(fields) <= set(FIELDS[kind]), f"{kind} has unexpected keys {sorted(fields)}")
    else:
        check(isinstance(raw, list) and raw, f"event {raw!r} is not a positional array")
        kind = raw[0]
        check(kind in FIELDS, f"unknown event class {kind!r}")
        check(len(raw) - 1 <= len(FIELDS[kind]), f"{kind} has {len(raw) - 1} fields")
        fields = dict(zip(FIELDS[kind], raw[1:]))
    return kind, fields


def is_u64(value):
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def group_of(kind, f, sequence, grouped):
    """The event's KV cache group (0 without group fields), checking its spec fields."""
    if not grouped:
        check("group_idx" not in f, f"batch {sequence}: a group on a single-pool deployment")
        return 0
    group = f.get("group_idx")
    check(group in (0, 1), f"batch {sequence}: group_idx {group!r}")
    if kind == "BlockStored":
        spec = ("full_attention", None) if group == 0 else ("sliding_window", WINDOW)
        got = (f.get("kv_cache_spec_kind"), f.get("kv_cache_spec_sliding_window"))
        check(got == spec, f"batch {sequence}: group {group} has the spec {got}")
    return group


def apply_batch(blocks, stats, sequence, payload, encoding, grouped):
    """Applies one batch to `blocks` ((group, block hash) -> its token ids) as a router would;
    counts in `stats` the removals per group and appends to stats["clears"] the batch's sequence
    number for each AllBlocksCleared."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    check(isinstance(batch, list) and len(batch) == 3,
          f"batch {sequence} is not [timestamp, events, rank]")
    timestamp, events, rank = batch
    # The value and the payload's first bytes say whether the clock or the bytes were wrong.
    check(isinstance(timestamp, float) and timestamp > 1e9,
          f"batch {sequence}: bad timestamp {timestamp!r} (payload of {len(payload)} bytes starts "
          f"{payload[:12].hex()})")
    check(rank == 0, f"batch {sequence}: data parallel rank {rank!r}")
    check(isinstance(events, list) and events, f"batch {sequence} has no events")
    for raw in events:
        kind, f = decode_event(raw, encoding)
        if kind == "BlockStored":
            group = group_of(kind, f, sequence, grouped)
            hashes, parent, tokens = f["block_hashes"], f["parent_block_hash"], f["token_ids"]
            check(hashes and all(is_u64(h) for h in hashes), f"batch {sequence}: block hashes")
            check(f["block_size"] == PAGE_SIZE, f"batch {sequence}: block_size {f['block_size']}")
            check(len(tokens) == PAGE_SIZE * len(hashes),
                  f"batch {sequence}: {len(tokens)} token ids for {len(hashes)} blocks")
            check(all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens),
                  f"batch {sequence}: token ids are not unsigned 32-bit integers")
            check(f.get("medium") == "GPU", f"batch {sequence}: medium {f.get('medium')!r}")
            # Routers drop a stored event that repeats a hash or whose parent they do not know.
            check(len(set(hashes)) == len(hashes) and parent not in hashes,
                  f"batch {sequence}: repeated block hash")
            # The full layers' index holds whole paths; the sliding pool holds windows, whose
            # first block's parent may have been dropped (docs/context_cache.md).
            check(parent is None or group == 1 or (is_u64(parent) and (0, parent) in blocks),
                  f"batch {sequence}: parent {parent} is not a stored block")
            for i, h in enumerate(hashes):
                check((group, h) not in blocks, f"batch {sequence}: block {h} stored twice")
                blocks[(group, h)] = tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
        elif kind == "BlockRemoved":
            group = group_of(kind, f, sequence, grouped)
            check(f.get("medium") == "GPU", f"batch {sequence}: medium {f.get('medium')!r}")
            for h in f["block_hashes"]:
                check((group, h) in blocks, f"batch {sequence}: removed block {h} was not stored")
                del blocks[(group, h)]
                stats[group] = stats.get(group, 0) + 1
        else:
            check(not f, f"batch {sequence}: AllBlocksCleared has fields {sorted(f)}")
            blocks.clear()
            stats.setdefault("clears", []).append(sequence)


def rebuild(payloads, count, encoding, grouped, stats=None):
    blocks = {}
    stats = {} if stats is None else stats
    for sequence in range(count):
        apply_batch(blocks, stats, sequence, payloads[sequence], encoding, grouped)
    return blocks


def hashes_of(blocks, group):
    return {h for g, h in blocks if g == group}


def replay_from(context, endpoint, start, deadline):
    """Every batch the replay socket returns from `start` on, in order, up to the end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        check(dealer.poll(deadline.left_ms()) != 0, f"no answer to a replay from {start}")
        frames = dealer.recv_multipart()
        check(len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8,
              f"replay answer of {len(frames)} frames")
        sequence = int.from_bytes(frames[1], "big", signed=True)
        if sequence == END_SEQUENCE:
            check(frames[2] == b"", "the end marker has a payload")
            dealer.close()
            return batches
        batches.append((sequence, frames[2]))


def read_line(stream, pattern, deadline):
    while True:
        deadline.left_ms()
        line = stream.readline()
        check(line, f"mkv-replay closed its standard error before '{pattern}'")
        match = re.search(pattern, line)
        if match:
            return match


def run(mkv_replay, trace, encoding, mode, passed):
    deadline = Deadline(DEADLINE_S)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    publish_to = "tcp://127.0.0.1:*"
    if mode == "connect":
        publish_to = f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}"
    grouped = mode == "sliding"
    # The composed backend: one full layer beside the sliding ones (--layers' default).
    sliding_flags = ["--window", str(WINDOW), "--full-layers", "1"] if grouped else []
    with tempfile.TemporaryDirectory() as scratch:
        json_path = os.path.join(scratch, "replay.json")
        process = subprocess.Popen(
            # A pool small enough to evict (BlockRemoved), large enough that no request fails;
            # in-flight joins; the oracle off (what is checked here is the event stream).
            [mkv_replay, "--quiet", "--trace", trace, "--limit", str(LIMIT), "--page-size",
             str(PAGE_SIZE), "--pool-pages", "1000", "--max-batch", "2", "--max-output", "4",
             "--verify", "none", "--json", json_path, "--reset-cache-every", str(RESET_EVERY),
             "--kv-events", publish_to, "--kv-events-replay", "tcp://127.0.0.1:*",
             "--kv-events-encoding", encoding, "--kv-events-hold"] + sliding_flags,
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            endpoints = read_line(process.stderr, r"kv events on (\S+), replay on (\S+)", deadline)
            if mode == "connect":
                check(endpoints.group(1) == publish_to,
                      f"the publisher reports {endpoints.group(1)}, not the SUB's {publish_to}")
            else:
                sub.connect(endpoints.group(1))
            # The subscription leaves right after the handshake: starting the replay only then
            # makes a live stream from the first batch the rule (the replay socket still covers
            # a subscription that arrives late).
            check(monitor.poll(deadline.left_ms()) != 0, "no handshake with the publisher")
            event = zmq.utils.monitor.recv_monitor_message(monitor)
            check(event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED, f"monitor event {event}")
            sub.disable_monitor()
            monitor.close()
            if mode == "connect":
                # A bound SUB socket attaches a peer it accepted, and sends it the subscription,
                # only when its own thread next uses the socket: poll it for a moment now rather
                # than after the replay (when every batch would have been dropped unsubscribed).
                sub.poll(200)
            read_line(process.stderr, r"starts after a line", deadline)
            process.stdin.write("go\n")
            process.stdin.flush()
            count = int(read_line(process.stderr, r"kv events: (\d+) batches published, 0 dropped",
                                  deadline).group(1))
            read_line(process.stderr, r"open until standard input closes", deadline)
            check(count > 10, f"only {count} batches: the workload is too small to test")

            live = {}
            while count - 1 not in live:
                check(sub.poll(deadline.left_ms()) != 0,
                      f"the live stream stopped early ({len(live)} of {count} batches, "
                      f"the last {max(live, default=None)})")
                frames = sub.recv_multipart()
                check(len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8,
                      f"a message of {len(frames)} frames")
                live[int.from_bytes(frames[1], "big")] = frames[2]
            first = min(live)
            check(sorted(live) == list(range(first, count)),
                  f"the live stream has a sequence gap after {first}")
            passed.append(f"live stream of {count - first} batches without a gap ({mode})")

            payloads = dict(live)
            if first > 0:  # the slow joiner's missed prefix, from the replay buffer
                for sequence, payload in replay_from(context, endpoints.group(2), 0, deadline):
                    payloads.setdefault(sequence, payload)
            check(sorted(payloads) == list(range(count)), "batches missing after the replay")

            with open(json_path, encoding="utf-8") as file:
                report = json.load(file)
            index = set(report["kv_events"]["indexed_block_hashes"])
            check(report["kv_events"]["batches_published"] == count, "batch count differs")
            check(report["dropped_events"] == 0, "the in-process event queue dropped events")
            check(report["evicted_records"] > 0, "no eviction: BlockRemoved is not exercised")
            check(report["failed_requests"] == 0 and report["joins"] > 0,
                  "the workload should run every request, some joining in flight")
            check(index, "the index is empty at the end")
            stats = {}
            blocks = rebuild(payloads, count, encoding, grouped, stats)
            clears = stats.get("clears", [])
            check(report["cache_resets"] == 1 and len(clears) == 1,
                  f"{report['cache_resets']} resets, {len(clears)} AllBlocksCleared events")
            check(hashes_of(blocks, 0) == index,
                  f"rebuilt {len(hashes_of(blocks, 0))} blocks, the index holds {len(index)} "
                  f"({len(hashes_of(blocks, 0) ^ index)} differ)")
            passed.append(f"block set rebuilt from events equals the index ({len(index)} blocks)")
            windows = set()
            if grouped:
                check(report["backend"] == "sliding-window-reuse", f"backend {report['backend']}")
                windows = set(report["kv_events"]["indexed_window_block_hashes"])
                check(windows and stats.get(1, 0) > 0,
                      "the sliding pool cached nothing or dropped nothing: group 1 is not exercised")
                check(hashes_of(blocks, 1) == windows,
                      f"rebuilt {len(hashes_of(blocks, 1))} window blocks, the sliding pool "
                      f"holds {len(windows)} ({len(hashes_of(blocks, 1) ^ windows)} differ)")
                passed.append(f"window block set rebuilt from group 1 equals the sliding pool's "
                              f"({len(windows)} blocks, {stats[1]} removals)")
            else:
                check(set(g for g, _ in blocks) <= {0}, "a single-pool run has groups")

            middle = clears[0] - 1  # the resync replays the clear too
            resent = replay_from(context, endpoints.group(2), middle, deadline)
            check([s for s, _ in resent] == list(range(middle, count)),
                  f"replay from {middle} returned sequences {[s for s, _ in resent][:5]}...")
            check(all(payloads[s] == p for s, p in resent), "a replayed batch differs from the live one")
            resynced = {s: payloads[s] for s in range(middle)}
            resynced.update(dict(resent))
            again = rebuild(resynced, count, encoding, grouped)
            check(hashes_of(again, 0) == index and hashes_of(again, 1) == windows,
                  "the block sets after a resync differ from the indexes")
            passed.append(f"resync from sequence {middle} through the replay socket")

            process.stdin.close()
            check(process.wait(timeout=max(1, deadline.left_ms() / 1000)) == 0,
                  f"mkv-replay exited with {process.returncode}")
            passed.append("mkv-replay exited 0")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            context.destroy(linger=0)


def main():
    if (len(sys.argv) not in (4, 5) or sys.argv[3] not in ("map", "array")
            or sys.argv[4:] not in ([], ["bind"], ["connect"], ["sliding"])):
        print(__doc__)
        return 2
    passed = []
    try:
        run(sys.argv[1], sys.argv[2], sys.argv[3], (sys.argv[4:] or ["bind"])[0], passed)
    except (CheckFailed, subprocess.TimeoutExpired) as failure:
        for line in passed:
            print(f"ok: {line}")
        print(f"FAILED: {failure}")
        print(f"{len(passed)} passed, 1 failed")
        return 1
    for line in passed:
        print(f"ok: {line}")
    print(f"{len(passed)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
