"""Tensor parallelism across processes (docs/architecture.md, "Tensor parallelism"): two processes,
one rank each, create their runtimes with KVCacheRuntimeConfig.tensorParallel and agree through
torch.distributed (gloo on loopback, a file store), as a serving engine's one process per GPU
would. Ranks driven alike decide alike, hold half the heads, and agree at the completion points;
a rank fed a longer prompt is caught at the next completion point on both. Run by ctest
(mkv_python.tensor_parallel) with PYTHONPATH at the build's python/ folder."""

import multiprocessing
import os
import tempfile
import unittest

import torch
import torch.distributed as dist

PAGE = 16


def lifecycle(mkv, runtime, extra):
    """The bindings' facade test, shortened: a prompt, a decode step, a joiner that reuses the
    published prefix, row 0 compacted away (a completion point), finish. `extra` tokens lengthen
    the first prompt (a rank fed other calls)."""
    prefix = list(range(1, 33))
    pool = runtime.fullPool()
    context = mkv.DecodingInferenceContext()
    first = prefix + [40, 41, 42] + extra
    context.appendRow(first, runtime.residentSlots().acquire())
    managed = mkv.ManagedKVCacheRequest.begin(runtime.contextCache(), runtime.swaPageManager(),
                                              mkv.LLMGenerationRequest(1), context)
    ok = [managed.preparePrefill()]
    pool.writeLengths(0, [len(first)])
    context.appendToken(0, 7)
    ok.append(managed.completePrefill(context))
    resident = runtime.residentSlots().acquire()
    status, start = managed.admitSequence(prefix + [50, 51], "", mkv.DecodingKvHeadroom(1, 0), resident)
    pool.setActiveBatchSize(2)
    pool.writeLengths(1, [34])
    context.appendRow(prefix + [50, 51], resident, 2)
    context.appendToken(1, 9)
    ok.append(managed.finalizeSequenceAdmission(1, 9, 34))
    ok.append(managed.prepareDecodeStep(context))
    pool.writeLengths(0, [len(first) + 1, 35])
    context.appendToken(0, 10)
    context.appendToken(1, 11)
    context.setFinishReason(0, mkv.FinishReason.kLength)
    ok.append(managed.completeDecodeStep(context))
    mapping = torch.full((4,), -5, dtype=torch.int32)
    ok.append(managed.beginBatchCompaction([-1, 0], 1, mapping))
    ok.append(managed.completeBatchCompaction([-1, 0]))
    ok.append(managed.finish())
    table = runtime.fullPageTable()
    rows = [table.hostRow(slot) for slot in range(table.maxBatch)]
    return {"ok": ok, "joined": [str(status), start], "rows": rows}


def rank_main(rank, size, store_path, extra_on_rank1, results):
    import managedkv as mkv
    from managedkv import tensor_parallel

    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        config = mkv.KVCacheRuntimeConfig()
        config.model.numFullAttentionLayers = 2
        config.model.numKVHeads = 2
        config.model.headDim = 8
        config.model.kvDataType = mkv.DataType.kFloat32
        config.maxBatchSize = 4
        config.maxSequenceLength = 256
        config.tokensPerPage = PAGE
        config.numPages = 32
        config.contextReuse = True
        config.deviceType = mkv.DeviceType.kCPU
        tensor_parallel.rank_config(config, rank, size)
        runtime = mkv.KVCacheRuntime.create(config)
        extra = list(range(60, 60 + PAGE)) if (extra_on_rank1 and rank == 1) else []
        outcome = lifecycle(mkv, runtime, extra)
        stats = runtime.tensorParallelStats()
        outcome.update(heads=runtime.config().model.numKVHeads, agreements=stats.agreements,
                       divergences=stats.divergences, failed_elsewhere=stats.failedElsewhere,
                       kv_bytes=runtime.kvBytes(), shutdown=runtime.shutdown())
        results.put((rank, outcome))
    except Exception as error:  # reported to the parent, which fails the test
        results.put((rank, {"error": repr(error)}))
    finally:
        dist.destroy_process_group()


def run_ranks(extra_on_rank1=False, size=2):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        processes = [context.Process(target=rank_main, args=(rank, size, store, extra_on_rank1, results))
                     for rank in range(size)]
        for process in processes:
            process.start()
        outcomes = dict(results.get(timeout=120) for _ in processes)
        for process in processes:
            process.join(timeout=60)
    return [outcomes[rank] for rank in range(size)]


class TensorParallelTest(unittest.TestCase):
    def test_two_processes_driven_alike_decide_alike(self):
        ranks = run_ranks()
        for rank, outcome in enumerate(ranks):
            self.assertNotIn("error", outcome, outcome)
            self.assertEqual(outcome["heads"], 1, rank)  # two heads split over two ranks
            self.assertTrue(all(outcome["ok"]), outcome)
            self.assertEqual(outcome["joined"][1], 32, rank)  # the published prefix was reused
            self.assertGreater(outcome["agreements"], 0, rank)
            self.assertEqual(outcome["divergences"] + outcome["failed_elsewhere"], 0, rank)
            self.assertTrue(outcome["shutdown"], rank)
        self.assertEqual(ranks[0], ranks[1])

    def test_a_rank_fed_other_calls_fails_the_step_on_both(self):
        ranks = run_ranks(extra_on_rank1=True)
        for rank, outcome in enumerate(ranks):
            self.assertNotIn("error", outcome, outcome)
            self.assertGreaterEqual(outcome["divergences"], 1, rank)
            self.assertIn(False, outcome["ok"], rank)  # the completion point failed on both
        self.assertEqual(ranks[0]["ok"], ranks[1]["ok"])

    def test_the_agreement_reduces_over_the_group(self):
        import managedkv as mkv
        from managedkv import tensor_parallel

        if not dist.is_initialized():
            with tempfile.TemporaryDirectory() as directory:
                dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "s"), 1),
                                        rank=0, world_size=1)
                try:
                    agree = tensor_parallel.torch_agreement()
                    outcome = mkv.RankOutcome()
                    outcome.succeeded = False
                    outcome.decisionDigest = (1 << 64) - 1
                    agreed = agree(outcome)
                    self.assertFalse(agreed.allSucceeded)
                    self.assertTrue(agreed.digestsAgree)
                finally:
                    dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main()
