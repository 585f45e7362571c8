"""An example serving engine on managedkv (docs/python.md, "The example engine"): a decoder model in
torch whose attention reads the library's pages and whose recurrent layers keep their state in the
library's rows, run with continuous batching.

    python3 -m managedkv.engine --model llama|gemma3|hybrid --device cpu|cuda [--verify]

What it does, and which library call does it:

* **continuous batching**: sequences are submitted with an arrival step; when no request executes,
  the arrived ones (up to ``max_batch``) begin one (``ManagedKVCacheRequest.begin``; their prefill
  runs between ``preparePrefill`` and ``completePrefill``; under a token budget a founder the
  prefill step's budget does not cover publishes its first chunk (``completePrefillChunk``), holds
  at ``completePrefill`` and goes on in chunks as a joiner); while it executes,
  later arrivals join it in flight (``admitSequence``) and leave it as they finish
  (``beginBatchCompaction`` / ``completeBatchCompaction``); when its last row finishes the request
  ends (``finish``) and the next one begins;
* **chunked prefill under a token budget** (vLLM's policy): each step's decodes first, one token
  per decoding row, then joiners' prompt chunks of at most ``chunk`` tokens while
  ``max_batched_tokens`` lasts (``preparePrefillChunk``, ``completePrefillChunk``,
  ``finalizeSequenceAdmission``); a joiner the budget leaves out holds for the step;
* **prefix reuse and eviction**: the library decides (``prefillStarts``, ``admitSequence``'s
  ``prefillStart``); the engine computes from there;
* **paged attention** through ``AttentionViews``: K and V written through ``slotMapping``, read
  back through ``blockTable`` + ``seqLensAfter`` (FlashAttention / vLLM) on even attention layers
  and the FlashInfer CSR triple on odd ones, by the model's matmul + softmax or torch's fused
  ``scaled_dot_product_attention`` (``attention="sdpa"``); or (``attention="flex"``, torch >= 2.5)
  by FlexAttention over the pool's physical layout, masked through the views' physical-to-logical
  page map, as torch's paged FlexAttention reads a cache;
* **sliding windows** (Gemma-3): the sliding layers in the sliding pool, whose rows keep only the
  window (the composed backend);
* **host tier**: ``host_pool_tokens`` > 0 (attention-only models): evicted blocks onboard back;
* **hybrid models** (Qwen3-Next): each row's linear-attention layers advance their state in its
  resident slot's rows of ``runtime.recurrentState()``; the library captures them at prompt,
  decode and chunk ends and restores them (with a checkpoint's partial page) for a sequence that
  resumes from a checkpoint.

``python3 -m managedkv.parity`` runs this engine against a dense reference; ``--verify`` here
checks every sequence's greedy tokens against the model run densely. Only torch APIs present in
torch 1.13 are used unless ``attention="sdpa"``.
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import managedkv as mkv
from managedkv import qwen3_next


try:  # torch >= 2.3: a lower-right causal mask the fused SDPA kernels take as is
    from torch.nn.attention.bias import causal_lower_right as _causal_lower_right
except ImportError:
    _causal_lower_right = None
try:  # torch >= 2.5: FlexAttention
    from torch.nn.attention.flex_attention import create_block_mask as _create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:
    _create_block_mask = _flex_attention = None


def flex_available():
    """Whether this torch has FlexAttention (attention="flex")."""
    return _flex_attention is not None


class LibraryClock:
    """Host seconds spent inside library calls (``wrap`` a library object: each of its methods is
    timed). On CUDA the device is drained before each call, so that a call's time is its own and
    not that of the queued kernels a synchronising call would wait for."""

    def __init__(self, device):
        self.seconds = 0.0
        self.calls = 0
        self.cuda = device.type == "cuda"

    def wrap(self, target):
        return _Timed(target, self)


class _Timed:
    def __init__(self, target, clock):
        self._target, self._clock = target, clock

    def __getattr__(self, name):
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute
        clock = self._clock

        def timed(*args, **kwargs):
            if clock.cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - began
                clock.calls += 1

        return timed


class Sequence:
    """One user sequence: its prompt, how many tokens to generate, the engine step it arrives at,
    and what the engine made of it."""

    def __init__(self, name, prompt, max_new_tokens, arrival=0, decode_written_from=None):
        self.name = name
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.arrival = arrival
        # A follow-up turn: its prompt from this position on is an earlier turn's generated tokens,
        # whose KV that turn's decode steps wrote.
        self.decode_written_from = decode_written_from
        self.generated = []
        self.logits = {}  # position -> logits, when the engine keeps them
        self.reused = 0
        self.prefill_chunks = 0  # steps its prompt was computed in
        self.token_steps = []  # the engine step each generated token came out of

    def note_reuse(self, start, engine):
        self.reused = start
        engine.mid_page_restores += int(start % engine.page != 0)
        if self.decode_written_from is not None:
            engine.decode_kv_reused += max(0, start - self.decode_written_from)


class Row:
    """The engine's state of one execution row."""

    def __init__(self, seq, resident, kv_length, prefilling=False):
        self.seq = seq
        self.resident = resident
        self.kv_length = kv_length
        self.prefilling = prefilling  # an unfinalised joiner (or a founder held after its first chunk)


class PagedEngine:
    """A serving engine on one managedkv runtime (see the module's docstring). A model with sliding
    layers (``model.layer_window(layer)``) runs on the composed backend, one with linear-attention
    layers (``model.layer_kind(layer)``) on the hybrid deployment, any other on context reuse."""

    def __init__(
        self,
        model,
        num_pages,
        host_pool_tokens=0,
        max_batch=4,
        max_sequence_length=512,
        chunk=16,
        max_batched_tokens=None,
        attention="matmul",
        sampler=None,
        keep_logits=True,
        reuse=True,
        time_library=False,
    ):
        """``num_pages`` full-attention pages of ``model.page`` tokens; ``chunk``: the most prompt
        tokens of one joiner per step; ``max_batched_tokens``: the step's token budget (None: no
        budget); ``sampler``: a torch.Generator to sample at temperature 1 (None: greedy);
        ``keep_logits``: keep every computed position's logits in its Sequence (the parity's);
        ``reuse``: False runs the full-storage backend (no prefix reuse, same lifecycle; models
        without sliding layers: without reuse those would run on bounded SWA, which this engine
        does not drive);
        ``time_library``: count the host seconds spent in library calls (``library``)."""
        if attention == "flex" and not flex_available():  # before anything is made
            raise ValueError('attention="flex" needs torch >= 2.5 (torch.nn.attention.flex_attention)')
        self.model = model
        self.device = model.device
        self.page = model.page
        self.max_batch = max_batch
        self.chunk = chunk
        self.max_batched_tokens = max_batched_tokens
        self.keep_logits = keep_logits
        kinds = [getattr(model, "layer_kind", lambda layer: qwen3_next.FULL)(layer) for layer in range(model.layers)]
        recurrent = [layer for layer, kind in enumerate(kinds) if kind == qwen3_next.LINEAR]
        windows = [model.layer_window(layer) for layer in range(model.layers) if layer not in recurrent]
        sliding = [w for w in windows if w is not None]
        if sliding and not reuse:
            raise ValueError(
                "reuse=False with sliding-window layers selects the bounded-SWA backend, which this example "
                "engine does not drive (it reads the full layers through context reuse's page table): use reuse=True"
            )
        config = mkv.KVCacheRuntimeConfig()
        config.model.numFullAttentionLayers = len(windows) - len(sliding)
        config.model.numSlidingWindowLayers = len(sliding)
        if recurrent:  # a hybrid model: the library's hybrid deployment (exact checkpoints)
            self.configure_recurrent(config, model, len(recurrent), len(windows))
        self.window = sliding[0] if sliding else 0
        config.model.slidingWindowTokens = self.window
        config.model.numKVHeads = model.kv_heads
        config.model.headDim = model.head_dim
        config.model.kvDataType = mkv.DataType.kBFloat16 if model.dtype == torch.bfloat16 else mkv.DataType.kFloat32
        config.maxBatchSize = self.max_batch
        config.maxSequenceLength = max_sequence_length
        config.tokensPerPage = self.page
        config.numPages = num_pages
        config.numSwaPages = 4 * num_pages if sliding else 0
        config.contextReuse = reuse
        config.contextCache.evictionPolicy = mkv.EvictionPolicyKind.kLru
        config.hostPoolTokens = host_pool_tokens
        config.deviceType = mkv.DeviceType.kGPU if self.device.type == "cuda" else mkv.DeviceType.kCPU
        self.runtime = mkv.KVCacheRuntime.create(config)
        self.pool = self.runtime.fullPool()
        self.swa_pool = self.runtime.swaPool() if sliding else None
        self.library = LibraryClock(self.device) if time_library else None
        timed = self.library.wrap if self.library else (lambda target: target)
        self.pools = [timed(self.pool)] + ([timed(self.swa_pool)] if sliding else [])
        self.swa_table = self.runtime.swaPageTable() if sliding else None
        # The views of each pool's table, for a step of up to every row's whole sequence (a request's
        # founders are prefilled in one step).
        step_tokens = self.max_batch * max_sequence_length
        self.flex = attention == "flex"  # FlexAttention reads the physical-to-logical page map
        table_views = lambda table: mkv.AttentionViews(  # noqa: E731
            table, self.page, self.max_batch, step_tokens, physicalToLogical=self.flex
        )
        self.views = timed(table_views(self.runtime.fullPageTable()))
        self.swa_views = timed(table_views(self.swa_table)) if sliding else None
        # Per model layer: an attention layer's pool layer as a torch tensor over the library's
        # memory ([2, numPages, P, KVH, D]) and which table's views it reads, or a recurrent layer's
        # rows (index None): per resident slot its fp32 memory and conv window, torch views over
        # the library's RecurrentStatePool rows.
        self.layers, counts, rows = [], [0, 0], 0
        state = self.runtime.recurrentState()
        # Attention layers alternate between the two table formats: FlashAttention / vLLM's
        # block_table, then FlashInfer's CSR.
        self.reads_block_table = [i % 2 == 0 for i in range(model.layers - len(recurrent))]
        for layer in range(model.layers):
            if layer in recurrent:
                memory_shape, conv_shape = model.memory_shape, model.conv_shape
                memory = torch.from_dlpack(state.state(rows)).view(torch.float32).view(-1, *memory_shape)
                conv = torch.from_dlpack(state.conv(rows)).view(torch.float32).view(-1, *conv_shape)
                self.layers.append(((memory, conv), None))
                rows += 1
                continue
            kind = 0 if model.layer_window(layer) is None else 1
            self.layers.append((torch.from_dlpack((self.pool, self.swa_pool)[kind].layer(counts[kind])), kind))
            counts[kind] += 1
        first = next(entry for entry in self.layers if entry[1] is not None)
        assert first[0].data_ptr() == (self.pool, self.swa_pool)[first[1]].layer(0).data_ptr, "DLPack copied the pool"
        if recurrent:
            assert self.layers[recurrent[0]][0][0].data_ptr() == state.state(0).data_ptr, "DLPack copied the rows"
        self.mapping = torch.zeros(self.max_batch, dtype=torch.int32, device=self.device)
        self.sdpa = attention == "sdpa"
        self.sampler = sampler
        self.waiting = []  # submitted, not yet admitted, in arrival order
        self.clock = 0  # engine steps: a request's prefill and each decode step count one
        self.steps = 0  # forward passes
        self.prefill_tokens = 0  # prompt tokens computed (the rest were reused)
        self.window_pages_dropped = 0  # sliding pages the library retired from rows the engine runs
        self.decode_kv_reused = 0  # reused prompt tokens whose KV an earlier turn's decode wrote
        self.mid_page_restores = 0  # rows resumed mid-page: a checkpoint's partial page restored

    @staticmethod
    def configure_recurrent(config, model, recurrent_layers, attention_layers, snapshot_slots=48):
        """A hybrid model's recurrent rows (its fp32 memory and conv window per layer and resident
        slot) and the checkpoint slots that hold them and the partial last page of a checkpoint."""
        element = 2 if model.dtype == torch.bfloat16 else 4
        config.model.numRecurrentLayers = recurrent_layers
        config.model.recurrentStateBytes = 4 * math.prod(model.memory_shape)
        config.model.recurrentConvBytes = 4 * math.prod(model.conv_shape)
        per_slot = recurrent_layers * (config.model.recurrentStateBytes + config.model.recurrentConvBytes)
        config.contextCache.recurrentSnapshotPoolBytes = snapshot_slots * per_slot
        partial_page = attention_layers * 2 * model.page * model.kv_heads * model.head_dim * element
        config.contextCache.partialKvSnapshotPoolBytes = snapshot_slots * partial_page

    def pick(self, logits):
        """The next token from one position's logits."""
        if self.sampler is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.sampler))

    # --- continuous batching ------------------------------------------------------------------
    def submit(self, seq):
        """Queues a sequence; it is admitted at or after its arrival step."""
        self.waiting.append(seq)

    def serve(self, founders, joiners=()):
        """Serves one batch: `founders` arrive now and begin a request together; each of `joiners`
        arrives ``join_step`` decode steps later and joins it in flight (its ``arrival`` is set)."""
        for seq in founders:
            seq.arrival = self.clock
            self.submit(seq)
        for seq in joiners:
            seq.arrival = self.clock + 1 + seq.arrival
            self.submit(seq)
        self.run()

    def run(self):
        """Serves every submitted sequence: requests begin with the arrived sequences, later
        arrivals join in flight, each request ends when its last row finishes."""
        while self.waiting:
            arrived = [seq for seq in self.waiting if seq.arrival <= self.clock]
            if not arrived:  # idle until the next arrival
                self.clock = min(seq.arrival for seq in self.waiting)
                continue
            founders = arrived[: self.max_batch]
            for seq in founders:
                self.waiting.remove(seq)
            self.serve_request(founders)

    def require(self, managed, ok, what):
        if not ok:
            raise RuntimeError(f"{what} failed: {managed.lastFailure().reason}")

    def serve_request(self, founders):
        """One ManagedKVCacheRequest: the founders' prefill, then decode steps with in-flight joins
        and chunked prefill, until its last row finishes."""
        slots = self.runtime.residentSlots()
        context = mkv.DecodingInferenceContext()
        rows = []
        for seq in founders:
            resident = slots.acquire()
            context.appendRow(seq.prompt, resident)
            rows.append(Row(seq, resident, 0))
        request = mkv.LLMGenerationRequest(len(founders))
        begin = self.library.wrap(mkv.ManagedKVCacheRequest).begin if self.library else mkv.ManagedKVCacheRequest.begin
        managed = begin(self.runtime.contextCache(), self.runtime.swaPageManager(), request, context)
        if managed is None:
            raise RuntimeError("the pool cannot hold the request")
        if self.library:
            managed = self.library.wrap(managed)
        require = lambda ok, what: self.require(managed, ok, what)  # noqa: E731

        for row, start in zip(rows, managed.prefillStarts()):
            row.kv_length = start
            row.seq.note_reuse(start, self)
        require(managed.preparePrefill(), "preparePrefill")
        require(managed.prepareSwaPrefill([len(r.seq.prompt) - r.kv_length for r in rows]), "prepareSwaPrefill")
        self.check_lengths(rows)
        self.prefill_first_chunks(managed, rows)
        for i, row in enumerate(rows):
            if row.prefilling:  # publishes its first chunk; it holds at completePrefill
                require(managed.completePrefillChunk(i, row.kv_length), "completePrefillChunk")
            else:
                context.appendToken(i, row.seq.generated[-1])
        self.write_lengths(rows)
        require(managed.enqueuePrefillCaptures(), "enqueuePrefillCaptures")
        require(managed.completePrefill(context), "completePrefill")

        while rows:
            new_tokens = self.plan_step(managed, rows)
            require(managed.prepareDecodeStep(context), "prepareDecodeStep")
            logits = self.forward(rows, new_tokens)
            finalize = []
            for i, row in enumerate(rows):
                self.keep(row, logits[i])
                row.kv_length += len(new_tokens[i])
                if row.prefilling:
                    self.prefill_tokens += len(new_tokens[i])
                    row.seq.prefill_chunks += int(len(new_tokens[i]) > 0)
                    if row.kv_length == len(row.seq.prompt):
                        finalize.append((i, self.pick(logits[i][-1])))
                    continue
                self.emit(row, self.pick(logits[i][-1]))
                context.appendToken(i, row.seq.generated[-1])
                if len(row.seq.generated) >= row.seq.max_new_tokens:
                    context.setFinishReason(i, mkv.FinishReason.kLength)
            self.write_lengths(rows)
            require(managed.completeDecodeStep(context), "completeDecodeStep")
            for i, row in enumerate(rows):
                if row.prefilling and 0 < len(new_tokens[i]) and row.kv_length < len(row.seq.prompt):
                    require(managed.completePrefillChunk(i, row.kv_length), "completePrefillChunk")
            for i, token in finalize:  # between steps: the joiner's lookahead, then it decodes
                rows[i].prefilling = False
                self.emit(rows[i], token)
                context.appendToken(i, token)
                require(managed.finalizeSequenceAdmission(i, token, len(rows[i].seq.prompt)), "finalize")
            self.clock += 1
            rows = self.compact(managed, context, rows, slots)
            if rows:
                self.admit_arrivals(managed, context, rows, slots)
        require(managed.finish(), "finish")

    def prefill_first_chunks(self, managed, rows):
        """The founders' prefill step, between preparePrefill and completePrefill: rows in order,
        each taking what the token budget leaves (all of its prompt without one); a founder left
        short of its prompt goes on in chunks as a joiner (``prefilling``), its first chunk
        possibly empty and, when not, prepared before the forward (bounded SWA maps its window)."""
        budget = math.inf if self.max_batched_tokens is None else self.max_batched_tokens
        new_tokens = []
        for i, row in enumerate(rows):
            left = len(row.seq.prompt) - row.kv_length
            take = int(min(left, budget))
            if 0 < take < left:
                self.require(managed, managed.preparePrefillChunk(i, row.kv_length + take), "preparePrefillChunk")
            new_tokens.append(row.seq.prompt[row.kv_length : row.kv_length + take])
            budget -= take
        logits = self.forward(rows, new_tokens)
        for i, row in enumerate(rows):
            self.keep(row, logits[i])
            self.prefill_tokens += len(new_tokens[i])
            row.seq.prefill_chunks += int(len(new_tokens[i]) > 0)
            row.kv_length += len(new_tokens[i])
            if row.kv_length == len(row.seq.prompt):
                self.emit(row, self.pick(logits[i][-1]))
            else:
                row.prefilling = True
        self.clock += 1

    def plan_step(self, managed, rows):
        """Each row's tokens of the coming step: a decoding row its last token; then, while the
        token budget lasts, each prefilling joiner's next chunk (its pages made ready first), or
        nothing (it holds)."""
        budget = math.inf if self.max_batched_tokens is None else self.max_batched_tokens
        budget -= sum(1 for row in rows if not row.prefilling)
        new_tokens = []
        for i, row in enumerate(rows):
            if not row.prefilling:
                new_tokens.append([row.seq.generated[-1]])
                continue
            take = int(min(self.chunk, len(row.seq.prompt) - row.kv_length, max(0, budget)))
            if take > 0:
                self.require(managed, managed.preparePrefillChunk(i, row.kv_length + take), "preparePrefillChunk")
                budget -= take
            new_tokens.append(row.seq.prompt[row.kv_length : row.kv_length + take])
        return new_tokens

    def compact(self, managed, context, rows, slots):
        """Drops finished rows (order-preserving; the mapping goes in as a torch tensor)."""
        done = [reason != mkv.FinishReason.kNotFinished for reason in context.finishReasons]
        if not any(done):
            return rows
        old_to_new, survivors = [], 0
        for finished in done:
            old_to_new.append(-1 if finished else survivors)
            survivors += 0 if finished else 1
        self.require(managed, managed.beginBatchCompaction(old_to_new, survivors, self.mapping), "beginBatchCompaction")
        self.require(managed, managed.completeBatchCompaction(old_to_new), "completeBatchCompaction")
        for row, finished in zip(rows, done):
            if finished:
                slots.release(row.resident)
        context.compact(old_to_new)
        rows = [row for row, finished in zip(rows, done) if not finished]
        self.check_lengths(rows)
        return rows

    def admit_arrivals(self, managed, context, rows, slots):
        """In-flight admission of arrived sequences while the batch has room; one the pools cannot
        take now stays first in the queue."""
        while self.waiting and len(rows) < self.max_batch:
            seq = next((s for s in self.waiting if s.arrival <= self.clock), None)
            if seq is None:
                return
            resident = slots.acquire()
            status, start = managed.admitSequence(seq.prompt, "", mkv.DecodingKvHeadroom(1, 0), resident)
            if status != mkv.AdmitSequenceStatus.kAdmitted:
                slots.release(resident)
                self.require(managed, status == mkv.AdmitSequenceStatus.kNoCapacity, "admitSequence")
                return
            self.waiting.remove(seq)
            self.join_row(len(rows), start)
            context.appendRow(seq.prompt, resident, len(seq.prompt) - start)
            rows.append(Row(seq, resident, start, prefilling=True))
            seq.note_reuse(start, self)
            self.check_lengths(rows)

    def keep(self, row, logits):
        if self.keep_logits:
            for t in range(logits.shape[0]):
                row.seq.logits[row.kv_length + t] = logits[t]

    def emit(self, row, token):
        row.seq.generated.append(token)
        row.seq.token_steps.append(self.clock)

    # --- what the library and the engine counted ------------------------------------------------
    def metrics(self):
        m = self.runtime.contextCache().metrics()
        c = self.runtime.contextCache().counters()
        return dict(
            reused_tokens=m.reusedTokens,
            evicted_records=m.evictedRecords,
            onboarded_pages=m.onboardedPages,
            offloaded_pages=m.offloadedPages,
            restored_checkpoints=c.checkpointRestores,
            checkpoint_captures=c.checkpointCaptures,
            chunk_end_captures=c.chunkEndCaptures,
            mid_page_restores=self.mid_page_restores,
            in_flight_joins=c.liveAdmissions,
            prefill_chunks=c.prefillChunks,
            held_prefills=c.heldPrefills,
            evicted_misses=m.misses["evicted"],
            window_pages_dropped=self.window_pages_dropped,
            decode_kv_reused=self.decode_kv_reused,
        )

    def step_views(self, views, rows, counts):
        """The step's views of one table: the tables a kernel gathers through as torch tensors
        (int64) on the engine's device, the per-row scalars read once to host lists (so that the
        per-row loops below do not wait on the device for each)."""
        views.build([r.resident.slot for r in rows], [r.kv_length for r in rows], counts, 0)
        view = lambda tensor: torch.from_dlpack(tensor).to(self.device, torch.long)  # noqa: E731
        host = lambda tensor: torch.from_dlpack(tensor).tolist()  # noqa: E731
        return dict(
            page_map=view(views.physicalToLogical()) if self.flex else None,
            block_table=view(views.blockTable()),
            indices=view(views.kvIndices()),
            slot_mapping=view(views.slotMapping()),
            before=host(views.seqLensBefore()),
            after=host(views.seqLensAfter()),
            query_start=host(views.queryStartLoc()),
            indptr=host(views.kvIndptr()),
            last_page_len=host(views.kvLastPageLen()),
        )

    def forward(self, rows, new_tokens):
        """One step: row i appends new_tokens[i] (possibly none) at its KV length. Writes their K
        and V into the pool through slotMapping, attends through the views, returns per row the
        logits of its new tokens."""
        counts = [len(t) for t in new_tokens]
        steps = [self.step_views(self.views, rows, counts)]
        if self.swa_views is not None:
            steps.append(self.step_views(self.swa_views, rows, counts))
            self.count_dropped_window_pages(rows)
        full = steps[0]
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.long, device=self.device)
        positions = torch.cat(
            [torch.arange(full["before"][i], full["after"][i], device=self.device) for i in range(len(rows))]
        )
        m = self.model
        h = m.embed_tokens(ids)
        attention_layer = 0
        for layer, (cache, kind) in enumerate(self.layers):
            if kind is None:  # a recurrent layer: each row resumes from its resident slot's rows
                h = self.mix(layer, h, cache, rows, full["query_start"])
                continue
            v = steps[kind]
            block_table = self.reads_block_table[attention_layer]
            attention_layer += 1
            q, k, v_new = m.qkv(layer, h, positions)
            k_cache = cache[0].view(-1, m.kv_heads, m.head_dim)
            v_cache = cache[1].view(-1, m.kv_heads, m.head_dim)
            k_cache[v["slot_mapping"]] = k  # vLLM's reshape_and_cache, into the library's pages
            v_cache[v["slot_mapping"]] = v_new
            out = torch.empty_like(q)
            for i in range(len(rows)):
                first, last = v["query_start"][i], v["query_start"][i + 1]
                if first == last:
                    continue
                if self.flex:  # FlexAttention over the whole pool, the row's pages by its page map
                    out[first:last] = self.attend_flex(
                        layer, q[first:last], k_cache, v_cache, v["page_map"][i], positions[first:last]
                    )
                    continue
                if block_table:  # FlashAttention / vLLM: block_table + seq_lens
                    length = v["after"][i]
                    pages = v["block_table"][i, : (length + self.page - 1) // self.page]
                else:  # FlashInfer: paged_kv_indptr / indices / last_page_len
                    pages = v["indices"][v["indptr"][i] : v["indptr"][i + 1]]
                    length = (len(pages) - 1) * self.page + v["last_page_len"][i]
                slots = (pages[:, None] * self.page + torch.arange(self.page, device=self.device)).reshape(-1)
                slots = slots[:length]
                # A sliding layer's pages before its window are the null page: the window mask
                # never reads them (FlashAttention's window_size, FlashInfer's window_left).
                out[first:last] = self.attend(layer, q[first:last], k_cache[slots], v_cache[slots], positions[first:last])
            h = m.finish_layer(layer, h, out)
        self.steps += 1
        starts = full["query_start"]
        if self.keep_logits:
            logits = m.logits(h)
            return [logits[starts[i] : starts[i + 1]] for i in range(len(rows))]
        # Only each row's last new token is sampled from: the LM head runs on those alone.
        last = [starts[i + 1] - 1 for i in range(len(rows)) if starts[i + 1] > starts[i]]
        logits = iter(m.logits(h[torch.tensor(last, dtype=torch.long, device=self.device)]))
        return [next(logits)[None] if starts[i + 1] > starts[i] else h[:0] for i in range(len(rows))]

    def mix(self, layer, h, rows_state, rows, query_start):
        """A recurrent layer over the step's tokens: row i's tokens advance the memory and conv
        window in its resident slot's rows of the library's RecurrentStatePool, in place (what
        the library captures into checkpoints and restores from them)."""
        memory, conv = rows_state
        out = torch.empty_like(h)
        for i, row in enumerate(rows):
            first, last = query_start[i], query_start[i + 1]
            if first < last:
                slot = row.resident.slot
                out[first:last] = self.model.mix(layer, h[first:last], memory[slot], conv[slot])
        return out

    def attend(self, layer, q, k, v, query_positions):
        """One row's attention over the keys gathered from its pages: the model's matmul + softmax,
        or (``--attention sdpa``) torch's fused ``scaled_dot_product_attention`` kernel under the
        same causal and window mask."""
        m = self.model
        if not self.sdpa:
            return m.attend(layer, q, k, v, query_positions)
        window = m.layer_window(layer)
        if window is None and _causal_lower_right is not None:
            # The row's queries are its last keys: a causal mask aligned to the bottom right, which
            # the fused kernels take without materialising a [queries, keys] mask.
            mask = _causal_lower_right(q.shape[0], k.shape[0])
        else:
            keys = torch.arange(k.shape[0], device=q.device)
            mask = keys[None, :] <= query_positions[:, None]
            if window is not None:
                mask = mask & (keys[None, :] > query_positions[:, None] - window)
        repeat = m.heads // m.kv_heads
        k = k.repeat_interleave(repeat, dim=1).transpose(0, 1)[None]
        v = v.repeat_interleave(repeat, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=m.scaling)
        return out[0].transpose(0, 1)

    def attend_flex(self, layer, q, k_cache, v_cache, page_map, query_positions):
        """One row's attention by FlexAttention over the pool in its physical layout (every page,
        K and V ``[numPages * P, KVH, D]``), as torch's paged FlexAttention runs it: a key at
        physical slot s belongs to logical position ``page_map[s // P] * P + s % P`` of the row
        (``AttentionViews.physicalToLogical``), and is masked unless the row holds its page, it
        is not after the query and (sliding layers) it is inside the window."""
        m, page = self.model, self.page
        window = m.layer_window(layer)

        def mask_mod(b, h, q_index, kv_index):
            logical = page_map[kv_index // page]
            position = logical * page + kv_index % page
            allowed = (logical >= 0) & (position <= query_positions[q_index])
            if window is not None:
                allowed = allowed & (position > query_positions[q_index] - window)
            return allowed

        block_mask = _create_block_mask(mask_mod, None, None, q.shape[0], k_cache.shape[0], device=q.device)
        out = _flex_attention(
            q.transpose(0, 1)[None],
            k_cache.transpose(0, 1)[None],
            v_cache.transpose(0, 1)[None],
            block_mask=block_mask,
            scale=m.scaling,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def count_dropped_window_pages(self, rows):
        """Logical pages before a row's window that the sliding table no longer maps (rotation)."""
        for row in rows:
            first_kept = max(0, row.kv_length - self.window) // self.page
            self.window_pages_dropped += sum(
                1 for page in range(first_kept) if self.swa_table.entry(row.resident.slot, page) < 0
            )

    def check_lengths(self, rows):
        """The library's KV-length tensors, read through DLPack, hold the engine's lengths."""
        expected = [r.kv_length for r in rows]
        for pool in self.pools:
            lengths = torch.from_dlpack(pool.kvLengths()).tolist()
            if lengths != expected:
                raise AssertionError(f"KV lengths {lengths}, the engine's {expected}")

    def write_lengths(self, rows):
        for pool in self.pools:
            pool.writeLengths(0, [r.kv_length for r in rows])

    def join_row(self, row_index, start):
        for pool in self.pools:
            pool.setActiveBatchSize(row_index + 1)
            pool.writeLengths(row_index, [start])

    def summary(self, sequences, seconds):
        """What serving `sequences` took and reused (steps are engine steps, see ``clock``)."""
        prompt_tokens = sum(len(s.prompt) for s in sequences)
        first_token = sorted(s.token_steps[0] - s.arrival for s in sequences if s.token_steps)
        gaps = sorted(b - a for s in sequences for a, b in zip(s.token_steps, s.token_steps[1:]))
        quantile = lambda values, q: values[min(len(values) - 1, int(q * len(values)))] if values else 0  # noqa: E731
        generated = sum(len(s.generated) for s in sequences)
        metrics = self.metrics()
        return dict(
            sequences=len(sequences),
            prompt_tokens=prompt_tokens,
            prefill_tokens_computed=self.prefill_tokens,
            reused_fraction=round(1 - self.prefill_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
            generated_tokens=generated,
            engine_steps=self.clock,
            forward_passes=self.steps,
            chunked_prefills=sum(1 for s in sequences if s.prefill_chunks > 1),
            ttft_steps_p50=quantile(first_token, 0.5),
            ttft_steps_p99=quantile(first_token, 0.99),
            tbt_steps_p50=quantile(gaps, 0.5),
            tbt_steps_p99=quantile(gaps, 0.99),
            seconds=round(seconds, 3),
            generated_tokens_per_s=round(generated / seconds, 1) if seconds > 0 else 0.0,
            **metrics,
        )


def chat_workload(vocab, page, conversations, turns, seed):
    """Multi-turn chats: conversations in two tenants' system prompts; each turn's prompt is the
    previous turn's prompt and reply plus a new user message. Returns a function giving turn t's
    sequences (after turn t - 1 was served), arrivals staggered by 2 steps."""
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = lambda n: torch.randint(1, vocab, (n,), generator=generator).tolist()  # noqa: E731
    systems = [tokens(2 * page + 5), tokens(3 * page + 1)]
    history = [systems[c % 2] + tokens(9 + c) for c in range(conversations)]
    previous = [None] * conversations

    def turn(t, now):
        batch = []
        for c in range(conversations):
            written = None
            if previous[c] is not None:
                written = len(previous[c].prompt)
                history[c] = previous[c].prompt + previous[c].generated + tokens(7 + (c + t) % 5)
            seq = Sequence(f"c{c}t{t}", history[c], 6 + (c % 3) * 4, arrival=now + 2 * c, decode_written_from=written)
            previous[c] = seq
            batch.append(seq)
        return batch

    return turn


def build_model(name, size, seed, device, dtype):
    from managedkv import gemma3, parity  # noqa: PLC0415 (parity imports this module)

    geometry = dict(parity.MODEL_SIZES[name][size])
    if name == "gemma3":
        return gemma3.TinyGemma3.random(geometry, seed, device, dtype=dtype)
    if name == "hybrid":
        return qwen3_next.TinyQwen3Next.random(geometry, seed, device, dtype=dtype)
    return parity.TinyLlama.random(geometry, seed, device, dtype=dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m managedkv.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama", "gemma3", "hybrid"], default="llama")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--pages", type=int, default=48, help="full-attention pool pages")
    parser.add_argument("--host-pool-tokens", type=int, default=0, help="host tier (attention-only models)")
    parser.add_argument("--chunk", type=int, default=16, help="most prompt tokens of one joiner per step")
    parser.add_argument("--max-batched-tokens", type=int, default=32, help="token budget of a step (0: none)")
    parser.add_argument("--attention", choices=["matmul", "sdpa"], default="matmul")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="fp32: every sequence's greedy tokens must equal the model's dense greedy decoding, and "
        "the run must have reused tokens, joined in flight and chunked a prefill (exit status 1 otherwise)",
    )
    parser.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="FIGURE",
        help="with --verify: a summary figure that must be above 0 too (evicted_records, "
        "onboarded_pages, restored_checkpoints, window_pages_dropped, ...); repeatable",
    )
    parser.add_argument("--json", help="write the summary to this file")
    args = parser.parse_args(argv)
    if args.verify and args.dtype != "fp32":
        parser.error("--verify compares greedy tokens: fp32 only")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build_model(args.model, args.size, args.seed, device, dtype)
    engine = PagedEngine(
        model,
        args.pages,
        host_pool_tokens=args.host_pool_tokens,
        max_batch=args.max_batch,
        chunk=args.chunk,
        max_batched_tokens=args.max_batched_tokens or None,
        attention=args.attention,
        keep_logits=False,
    )
    turn = chat_workload(model.vocab, model.page, args.conversations, args.turns, args.seed)
    sequences = []
    began = time.time()
    for t in range(args.turns):
        batch = turn(t, engine.clock)
        for seq in batch:
            engine.submit(seq)
        engine.run()
        sequences += batch
    figures = engine.summary(sequences, time.time() - began)
    report = dict(model=args.model, size=args.size, device=args.device, dtype=args.dtype, **figures)
    if args.verify:
        mismatched = []
        for seq in sequences:
            tokens = list(seq.prompt)
            for token in seq.generated:
                expected = int(model.forward_dense(tokens)[-1].argmax())
                if expected != token:
                    mismatched.append(seq.name)
                    break
                tokens.append(token)
        unknown = [k for k in args.expect if k not in report]
        if unknown:
            parser.error(f"--expect names no summary figure: {unknown}")
        engaged = {k: report[k] > 0 for k in ("reused_tokens", "in_flight_joins", "chunked_prefills", *args.expect)}
        report.update(verified_sequences=len(sequences), mismatched_sequences=mismatched, engaged=engaged)
        report["passed"] = not mismatched and all(engaged.values())
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if report.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
