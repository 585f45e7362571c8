#pragma once
/// \file patch_ring.h
/// The GPU path of InlinePatchBatch::flush that costs the engine thread about half a kernel
/// launch: the patch is written into a slot of mapped pinned host memory and one pre-built
/// graph is launched (cudaGraphLaunch), whose kernel reads the slot. On the H200 a graph launch
/// costs the host 1.9-2.3 µs against 4.3-4.8 µs for a kernel launch (docs/benchmarks.md, "What
/// one launch costs the engine thread"). Private to the library: not installed.
///
/// Slots are reused in order. The kernel counts its executions in a mapped host word as soon as
/// it has read its slot, so the host knows which slots are free without a CUDA call, and never
/// waits: when every slot is still to be read (the GPU is that many flushes behind), when the
/// stream is capturing a graph (a replay must carry the patch by value, not read a slot that
/// has been rewritten since), or when the stream is not the ring's, acquire() returns null and
/// the caller launches the inline kernel.

#include <cstdint>

#include "kernel_params.h"

namespace mkv::kernels::detail {

class PatchRing {
 public:
  /// Slots of the ring (512 KiB of pinned memory). An engine that prepares step N + 1 while the
  /// GPU runs step N has the flushes of a whole step waiting in the ring: a decode step makes one
  /// per batch, a request two or three (its prefill, its first decode step, finish), so 128 slots
  /// hold a step that begins and ends some 40 requests; flushes beyond that launch inline.
  static constexpr uint32_t kSlots = 128;

  /// Allocates the slots and the execution word in mapped pinned memory and instantiates the
  /// graph on the current device: construction time only (both synchronise the device).
  /// `firstExecution` starts the count elsewhere than 0 (tests of the 32-bit wrap).
  /// Throws mkv::Error on a CUDA failure or in a build without CUDA.
  explicit PatchRing(uint32_t firstExecution = 0);
  /// Waits for the device when a launch may still read a slot (destruction time only, like
  /// construction), then frees the graph and the memory.
  ~PatchRing();
  PatchRing(PatchRing const&) = delete;
  PatchRing& operator=(PatchRing const&) = delete;

  /// The slot the next launch will read, to be filled by the caller, or null when no slot is
  /// free, `stream` is capturing, or `stream` is not the ring's stream (the first one launched
  /// on: launches of one graph are ordered behind each other whatever their streams, so a launch
  /// on a second stream would wait on the device for the first stream's work). Never waits.
  /// Throws mkv::Error when the capture query fails.
  Int32InlinePatchLaunch* acquire(cudaStream_t stream);
  /// Launches the graph on `stream` for the slot acquire() returned last. Throws mkv::Error
  /// naming `call` when the launch fails; the slot stays free then.
  void launch(char const* call, cudaStream_t stream);

  /// Graph launches so far, counted from `firstExecution` (modulo 2^32).
  uint32_t launches() const noexcept { return mIssued; }

 private:
  void* mHost = nullptr;            // execution word, then the slots (one allocation)
  uint32_t* mExecutions = nullptr;  // host address of the word the kernel counts in
  Int32InlinePatchLaunch* mSlots = nullptr;
  [[maybe_unused]] void* mGraphExec = nullptr;  // cudaGraphExec_t; unused without CUDA
  uint32_t mIssued = 0;            // wraps with the kernel's 32-bit count: kSlots is a power of two
  cudaStream_t mStream = nullptr;  // the stream of every graph launch, once there was one
  bool mBound = false;             // whether mStream is set
};

}  // namespace mkv::kernels::detail
