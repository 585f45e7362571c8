"""The managedkv Python module's contract (docs/python.md): library tensors and torch tensors share
memory both ways without copies (DLPack), library errors arrive as managedkv.Error with the
library's message, call and detail, the seed facade runs a request, and AttentionViews gives the
same views as the C++ tests check, as CUDA tensors for a GPU table (skipped without a device). Run
by ctest (mkv_python.bindings) with PYTHONPATH at the build's python/ folder."""

import gc
import unittest

import numpy
import torch

import managedkv as mkv

PAGE = 16


def make_runtime(num_pages=32, max_batch=4, reuse=True, device=mkv.DeviceType.kCPU,
                 joiner_pages=mkv.JoinerPageAllocation.kWholePrompt):
    config = mkv.KVCacheRuntimeConfig()
    config.contextCache.joinerPages = joiner_pages
    config.model.numFullAttentionLayers = 2
    config.model.numKVHeads = 2
    config.model.headDim = 8
    config.model.kvDataType = mkv.DataType.kFloat32
    config.maxBatchSize = max_batch
    config.maxSequenceLength = 256
    config.tokensPerPage = PAGE
    config.numPages = num_pages
    config.contextReuse = reuse
    config.deviceType = device
    return mkv.KVCacheRuntime.create(config)


def begin(runtime, prompts):
    context = mkv.DecodingInferenceContext()
    for prompt in prompts:
        context.appendRow(prompt, runtime.residentSlots().acquire())
    request = mkv.LLMGenerationRequest(len(prompts))
    managed = mkv.ManagedKVCacheRequest.begin(runtime.contextCache(), runtime.swaPageManager(), request, context)
    return managed, context


class ConfigTest(unittest.TestCase):
    def test_the_config_reaches_the_runtime(self):
        runtime = make_runtime(num_pages=24)
        config = runtime.config()
        self.assertEqual(config.model.numFullAttentionLayers, 2)
        self.assertEqual(config.model.headDim, 8)
        self.assertEqual(config.numPages, 24)
        self.assertEqual(config.tokensPerPage, PAGE)
        self.assertEqual(runtime.backend, mkv.KVCacheBackend.kContextReuse)
        self.assertEqual(runtime.maxPagesPerSequence(), 256 // PAGE)
        self.assertEqual(runtime.fullPool().numPages, 24)
        self.assertEqual(runtime.capacity().base.totalPages, 24)
        self.assertEqual(runtime.kvBytes(), 2 * 2 * 24 * PAGE * 2 * 8 * 4)
        config.contextReuse = False
        self.assertEqual(mkv.KVCacheRuntime.create(config).backend, mkv.KVCacheBackend.kFullStorage)


class ZeroCopyTest(unittest.TestCase):
    def test_a_pool_layer_is_the_librarys_memory_both_ways(self):
        runtime = make_runtime()
        pool = runtime.fullPool()
        layer = pool.layer(1)
        self.assertEqual(layer.shape, (2, 32, PAGE, 2, 8))
        self.assertEqual(layer.dtype, mkv.DataType.kFloat32)
        self.assertEqual(layer.__dlpack_device__(), (1, 0))
        kv = torch.from_dlpack(layer)
        self.assertEqual(tuple(kv.shape), (2, 32, PAGE, 2, 8))
        self.assertEqual(kv.data_ptr(), layer.data_ptr)
        # torch writes, the library's pointer reads (Tensor.tolist reads through mkv::Tensor).
        kv[1, 3, 5, 1, 7] = 2.5
        flat = layer.tolist()
        index = ((((1 * 32 + 3) * PAGE + 5) * 2 + 1) * 8) + 7
        self.assertEqual(flat[index], 2.5)
        self.assertEqual(sum(1 for x in flat if x != 0.0), 1)
        # The library writes (a host-tier-free copy: its KV lengths), torch's earlier view sees it.
        lengths_before = torch.from_dlpack(pool.kvLengths())
        self.assertEqual(lengths_before.numel(), 0)

    def test_library_writes_show_in_torch_views_made_before_them(self):
        runtime = make_runtime()
        table = runtime.fullPageTable()
        device_table = torch.from_dlpack(table.deviceTable())  # [maxBatch, 2, maxPages]
        self.assertTrue(bool((device_table == -1).all()))
        managed, context = begin(runtime, [list(range(1, 40)), list(range(50, 70))])
        self.assertTrue(managed.preparePrefill())
        slot = context.residentRefs[0].slot
        row = table.hostRow(slot)
        self.assertEqual(device_table[slot].reshape(-1).tolist(), row)
        self.assertEqual(table.liveEntryCount(slot), 3)  # 39 tokens + 1 headroom
        k_ids = device_table[slot, 0, :3].tolist()
        self.assertEqual(device_table[slot, 1, :3].tolist(), [k + 32 for k in k_ids])  # V = K + numPages
        pool = runtime.fullPool()
        lengths = pool.kvLengths()
        pool.writeLengths(0, [39, 20])
        self.assertEqual(torch.from_dlpack(lengths).tolist(), [39, 20])
        self.assertTrue(managed.finish())

    def test_torch_and_numpy_tensors_go_in_without_copies(self):
        runtime = make_runtime()
        managed, context = begin(runtime, [list(range(1, 40)), list(range(50, 70))])
        self.assertTrue(managed.preparePrefill())
        table = runtime.fullPageTable()
        slots = torch.tensor([r.slot for r in reversed(context.residentRefs)], dtype=torch.int32)
        dst = torch.full((4, 2, table.maxPagesPerSeq), 7, dtype=torch.int32)
        table.gatherRows(dst, slots)  # the library writes into torch's memory
        self.assertEqual(dst[0].reshape(-1).tolist(), table.hostRow(int(slots[0])))
        self.assertEqual(dst[1].reshape(-1).tolist(), table.hostRow(int(slots[1])))
        self.assertEqual(dst[2].unique().tolist(), [7])  # rows past n untouched
        array = numpy.arange(12, dtype=numpy.int32).reshape(3, 4)
        view = mkv.Tensor.from_dlpack(array)
        self.assertEqual(view.shape, (3, 4))
        self.assertEqual(view.data_ptr, array.ctypes.data)
        array[2, 3] = 99
        self.assertEqual(view.tolist()[-1], 99)
        self.assertTrue(managed.finish())

    def test_a_capsule_is_consumed_once_and_keeps_its_memory_alive(self):
        def layer_tensor():
            runtime = make_runtime()
            capsule = runtime.fullPool().layer(0).to_dlpack()
            return torch.utils.dlpack.from_dlpack(capsule), capsule

        layer = make_runtime().fullPool().layer(0)
        self.assertEqual(torch.from_dlpack(layer.__dlpack__(dl_device=(1, 0))).data_ptr(), layer.data_ptr)
        with self.assertRaises(mkv.Error):
            layer.__dlpack__(dl_device=(2, 0))
        with self.assertRaises(mkv.Error):
            layer.__dlpack__(copy=True)

        kv, capsule = layer_tensor()
        gc.collect()  # the runtime is referenced only through the exported tensor now
        kv.fill_(1.0)
        self.assertEqual(float(kv.sum()), kv.numel())
        with self.assertRaises(Exception):
            torch.utils.dlpack.from_dlpack(capsule)  # already consumed

    def test_tensors_the_library_cannot_view_are_refused(self):
        runtime = make_runtime()
        dst = torch.zeros(4, 2, 32, dtype=torch.int32)
        with self.assertRaises(mkv.Error) as caught:
            runtime.fullPageTable().gatherRows(dst.transpose(0, 2), torch.zeros(1, dtype=torch.int32))
        self.assertIn("not dense row-major", caught.exception.detail)
        with self.assertRaises(mkv.Error):
            mkv.Tensor.from_dlpack(torch.zeros(3, dtype=torch.complex64))
        with self.assertRaises(mkv.Error):
            mkv.Tensor.from_dlpack([1, 2, 3])


class RecurrentStateTest(unittest.TestCase):
    def test_a_hybrid_runtimes_recurrent_rows_are_the_librarys_memory(self):
        self.assertIsNone(make_runtime().recurrentState())  # attention-only: no rows
        config = make_runtime().config()
        config.model.numRecurrentLayers = 2
        config.model.recurrentStateBytes = 64
        config.model.recurrentConvBytes = 16
        config.contextCache.recurrentSnapshotPoolBytes = 4 * 2 * (64 + 16)
        config.contextCache.partialKvSnapshotPoolBytes = 4 * 2 * 2 * PAGE * 2 * 8 * 4
        runtime = mkv.KVCacheRuntime.create(config)
        rows = runtime.recurrentState()
        self.assertEqual((rows.numLayers, rows.numSlots, rows.bytesPerSlot()), (2, 4, 2 * (64 + 16)))
        state, conv = rows.state(1), rows.conv(1)
        self.assertEqual((state.shape, conv.shape), ((4, 64), (4, 16)))
        self.assertEqual(state.dtype, mkv.DataType.kUInt8)
        view = torch.from_dlpack(state).view(torch.float32)  # the engine's layout over the bytes
        self.assertEqual(view.data_ptr(), state.data_ptr)
        view[2, 3] = 1.5
        self.assertEqual(torch.from_dlpack(rows.state(1)).view(torch.float32)[2, 3].item(), 1.5)
        with self.assertRaises(mkv.Error) as caught:
            rows.conv(2)
        self.assertIn("RecurrentStatePool::conv", str(caught.exception))


class ErrorTest(unittest.TestCase):
    def test_library_errors_carry_message_call_and_detail(self):
        runtime = make_runtime()
        with self.assertRaises(mkv.Error) as caught:
            runtime.fullPool().writeLengths(3, [1])
        error = caught.exception
        self.assertIsInstance(error, RuntimeError)
        self.assertTrue(error.call)
        self.assertTrue(error.detail)
        self.assertEqual(str(error), f"{error.call}: {error.detail}")
        config = mkv.KVCacheRuntimeConfig()
        config.model.numFullAttentionLayers = 1
        config.maxSequenceLength = 64
        config.tokensPerPage = 15
        config.deviceType = mkv.DeviceType.kCPU
        with self.assertRaises(mkv.Error) as caught:
            mkv.KVCacheRuntime.create(config)
        self.assertIn("tokensPerPage", str(caught.exception))

    def test_facade_contract_errors_name_the_facade_call(self):
        runtime = make_runtime()
        managed, context = begin(runtime, [list(range(1, 40))])
        with self.assertRaises(mkv.Error) as caught:
            managed.completePrefill(context)  # before preparePrefill
        self.assertIn("completePrefill", caught.exception.call)
        self.assertTrue(managed.finish())


class FacadeTest(unittest.TestCase):
    def test_a_request_reuses_what_the_previous_one_published_and_joins_in_flight(self):
        runtime = make_runtime()
        prefix = list(range(1, 33))
        pool = runtime.fullPool()
        managed, context = begin(runtime, [prefix + [40, 41, 42]])
        self.assertEqual(managed.prefillStarts(), [0])
        self.assertTrue(managed.preparePrefill())
        pool.writeLengths(0, [35])
        context.appendToken(0, 7)
        self.assertTrue(managed.completePrefill(context))
        self.assertTrue(managed.prepareDecodeStep(context))
        pool.writeLengths(0, [36])
        context.appendToken(0, 8)
        self.assertTrue(managed.completeDecodeStep(context))
        self.assertEqual(context.tokens(0), prefix + [40, 41, 42, 7, 8])
        # A joiner sharing the two published pages.
        resident = runtime.residentSlots().acquire()
        status, start = managed.admitSequence(prefix + [50, 51], "", mkv.DecodingKvHeadroom(1, 0), resident)
        self.assertEqual(status, mkv.AdmitSequenceStatus.kAdmitted)
        self.assertEqual(start, 32)
        pool.setActiveBatchSize(2)
        pool.writeLengths(1, [34])
        context.appendRow(prefix + [50, 51], resident, 2)
        context.appendToken(1, 9)
        self.assertTrue(managed.finalizeSequenceAdmission(1, 9, 34))
        self.assertFalse(managed.retractSequenceAdmission())
        # Row 0 finishes and is compacted away; the mapping goes in as a torch tensor. What the
        # step allocates was answered before it, with nothing changed.
        demand = managed.decodeStepDemand(mkv.DecodingKvHeadroom(1, 0))
        self.assertEqual(demand.tableFull.reason, mkv.RowFailureReason.kNone)
        leased = runtime.capacity().base.leasedPages
        self.assertTrue(managed.prepareDecodeStep(context))
        self.assertEqual(runtime.capacity().base.leasedPages - leased, demand.basePages)
        pool.writeLengths(0, [37, 35])
        context.appendToken(0, 10)
        context.appendToken(1, 11)
        context.setFinishReason(0, mkv.FinishReason.kLength)
        self.assertTrue(managed.completeDecodeStep(context))
        mapping = torch.full((4,), -5, dtype=torch.int32)
        self.assertTrue(managed.beginBatchCompaction([-1, 0], 1, mapping))
        self.assertEqual(mapping[:2].tolist(), [-1, 0])
        self.assertTrue(managed.completeBatchCompaction([-1, 0]))
        self.assertEqual(torch.from_dlpack(pool.kvLengths()).tolist(), [35])
        runtime.residentSlots().release(context.residentRefs[0])
        context.compact([-1, 0])
        self.assertEqual(context.activeBatchSize, 1)
        self.assertEqual(context.tokens(0), prefix + [50, 51, 9, 11])
        self.assertEqual(managed.lastFailure().reason, mkv.RowFailureReason.kNone)
        self.assertTrue(managed.finish())
        metrics = runtime.contextCache().metrics()
        self.assertEqual(metrics.reusedTokens, 32)
        self.assertEqual(runtime.contextCache().counters().liveAdmissions, 1)
        self.assertIn("evicted", metrics.misses)
        estimate = runtime.estimateAdmission(prefix + [60])
        self.assertEqual(estimate.reusableTokens, 32)


class JoinerIdentityTest(unittest.TestCase):
    def test_a_joiner_of_another_salt_reuses_nothing_the_founder_published(self):
        runtime = make_runtime()
        prefix = list(range(1, 33))
        managed, context = begin(runtime, [prefix + [40, 41, 42]])
        self.assertTrue(managed.preparePrefill())
        runtime.fullPool().writeLengths(0, [35])
        context.appendToken(0, 7)
        self.assertTrue(managed.completePrefill(context))
        starts = {}
        for salt in ("tenant-b", ""):
            joiner = mkv.LLMGenerationRequest(1)
            joiner.cacheSalt = salt
            resident = runtime.residentSlots().acquire()
            status, starts[salt] = managed.admitSequence(
                joiner, prefix + [50, 51], mkv.DecodingKvHeadroom(1, 0), resident)
            self.assertEqual(status, mkv.AdmitSequenceStatus.kAdmitted)
            self.assertTrue(managed.retractSequenceAdmission())
            runtime.residentSlots().release(resident)
        self.assertEqual(starts, {"tenant-b": 0, "": 32})
        with self.assertRaises(mkv.Error):  # swap needs a host tier
            managed.preemptSequence(0, mkv.PreemptionKind.kSwap)
        self.assertTrue(managed.finish())


class PerChunkJoinerTest(unittest.TestCase):
    def test_a_joiner_takes_each_chunks_pages_when_it_is_prepared(self):
        runtime = make_runtime(joiner_pages=mkv.JoinerPageAllocation.kPerChunk)
        self.assertEqual(runtime.config().contextCache.joinerPages, mkv.JoinerPageAllocation.kPerChunk)
        prefix = list(range(1, 33))
        pool = runtime.fullPool()
        managed, context = begin(runtime, [prefix + [40, 41, 42]])
        self.assertTrue(managed.preparePrefill())
        pool.writeLengths(0, [35])
        context.appendToken(0, 7)
        self.assertTrue(managed.completePrefill(context))
        leased = runtime.capacity().base.leasedPages
        resident = runtime.residentSlots().acquire()
        prompt = prefix + list(range(100, 140))  # 72 tokens, 32 reused
        status, start = managed.admitSequence(prompt, "", mkv.DecodingKvHeadroom(1, 0), resident)
        self.assertEqual((status, start), (mkv.AdmitSequenceStatus.kAdmitted, 32))
        self.assertEqual(runtime.capacity().base.leasedPages, leased)  # the shared prefix only
        pool.setActiveBatchSize(2)
        pool.writeLengths(1, [32])
        context.appendRow(prompt, resident, 32)
        for end in (50, 72):
            demand = managed.prefillChunkDemand(1, end)
            before = runtime.capacity().base.leasedPages
            self.assertTrue(managed.preparePrefillChunk(1, end))
            self.assertEqual(runtime.capacity().base.leasedPages - before, demand.basePages)
            self.assertGreater(demand.basePages, 0)
            pool.writeLengths(1, [end])
            if end < 72:
                self.assertTrue(managed.completePrefillChunk(1, end))
        context.appendToken(1, 9)
        self.assertTrue(managed.finalizeSequenceAdmission(1, 9, 72))
        with self.assertRaises(mkv.Error):  # a chunk end outside (done, prompt]
            managed.prefillChunkDemand(1, 80)
        self.assertEqual(runtime.contextCache().counters().chunkPageGrowths, 2)
        self.assertTrue(managed.finish())


def gpu_runtime():
    """A runtime on the GPU, or None without a CUDA device or in a build without CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        return make_runtime(device=mkv.DeviceType.kGPU)
    except mkv.Error:
        return None


class ViewsTest(unittest.TestCase):
    def test_views_of_a_prepared_request(self):
        self.check_views(make_runtime())

    def test_views_of_a_gpu_table_are_cuda_tensors_built_on_the_device(self):
        runtime = gpu_runtime()
        if runtime is None:
            self.skipTest("no CUDA device, or a build without CUDA")
        self.check_views(runtime)

    def check_views(self, runtime):
        managed, context = begin(runtime, [list(range(1, 31)), list(range(40, 73))])
        self.assertTrue(managed.preparePrefill())
        table = runtime.fullPageTable()
        views = mkv.AttentionViews(table, PAGE, 4, 128, stream=runtime.config().stream)
        self.assertEqual(views.deviceType, table.deviceType)
        slots = [r.slot for r in context.residentRefs]
        views.build(slots, [0, 0], [30, 33], nullPage=31)
        self.assertEqual(views.rows, 2)
        self.assertEqual(views.newTokenCount, 63)
        self.assertEqual(views.launches, 1)
        block_table = torch.from_dlpack(views.blockTable())
        self.assertEqual(block_table.is_cuda, table.deviceType == mkv.DeviceType.kGPU)
        self.assertEqual(block_table.data_ptr(), views.blockTable().data_ptr)
        self.assertEqual(tuple(block_table.shape), (2, 16))
        k0 = [table.entry(slots[0], j) for j in range(2)]
        k1 = [table.entry(slots[1], j) for j in range(3)]
        self.assertEqual(block_table[0].tolist(), k0 + [31] * 14)
        self.assertEqual(block_table[1].tolist(), k1 + [31] * 13)
        self.assertEqual(torch.from_dlpack(views.seqLensAfter()).tolist(), [30, 33])
        self.assertEqual(torch.from_dlpack(views.queryStartLoc()).tolist(), [0, 30, 63])
        self.assertEqual(torch.from_dlpack(views.kvIndptr()).tolist(), [0, 2, 5])
        self.assertEqual(torch.from_dlpack(views.kvIndices()).tolist(), k0 + k1)
        self.assertEqual(torch.from_dlpack(views.kvLastPageLen()).tolist(), [14, 1])
        slot_mapping = torch.from_dlpack(views.slotMapping())
        self.assertEqual(slot_mapping.dtype, torch.int64)
        self.assertEqual(slot_mapping[31].item(), k1[0] * PAGE + 1)
        with self.assertRaises(mkv.Error) as caught:
            views.build(slots, [0, 40], [30, 1])  # row 1 holds 3 pages, 41 tokens need 3: fine
            views.build(slots, [0, 60], [30, 1])  # 61 tokens need 4 pages
        self.assertEqual(caught.exception.call, "AttentionViews::build")
        self.assertIn("logical page 3 is empty", caught.exception.detail)
        self.assertFalse(views.hasPhysicalPageMap)
        with self.assertRaises(mkv.Error):
            views.physicalToLogical()
        # FlexAttention's physical-to-logical map: the inverse of each row's live block-table entries.
        flex = mkv.AttentionViews(table, PAGE, 4, 128, stream=runtime.config().stream, physicalToLogical=True)
        flex.build(slots, [0, 0], [30, 33], nullPage=31)
        page_map = torch.from_dlpack(flex.physicalToLogical())
        self.assertEqual(page_map.is_cuda, table.deviceType == mkv.DeviceType.kGPU)
        self.assertEqual(tuple(page_map.shape), (2, table.numPages))
        for row, pages in enumerate((k0, k1)):
            expected = [-1] * table.numPages
            for logical, physical in enumerate(pages):
                expected[physical] = logical
            self.assertEqual(page_map[row].tolist(), expected)
        self.assertTrue(managed.finish())


if __name__ == "__main__":
    unittest.main()
