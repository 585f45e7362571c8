/// mkv_gpu_bench: CUDA-event benchmark of the managedkv data-movement kernels, cases G1-G5, G7 and
/// G8 of docs/benchmarks.md, "What is measured" (method and results there too), and G9, the
/// kernel-ready attention views of one decode step (docs/benchmarks.md, "Kernel-ready views").
///
/// Per case, in one run and on one non-blocking stream, it times
///   1. a contiguous cudaMemcpyAsync of the same byte count (the denominator of "ratio"),
///   2. the managedkv launcher (and, for the decode step, the same call replayed as a graph),
///   3. a loop of one cudaMemcpyAsync per page / row (subsampled beyond kLoopCopies copies and
///      scaled to the full count; the row says so),
/// poisoning the destination with 0xFF before each method and verifying it bitwise on the
/// device afterwards. Times are medians of --reps repetitions after --warmups, each repetition
/// bracketed by CUDA events. TB/s counts read + write: 2 * bytes / time.
///
/// Exit status: 0 = every case ran and verified (performance misses do not fail the run);
/// 2 = a verification found mismatching bytes; 77 = no CUDA device visible (nothing measured);
/// 1 = usage or CUDA error.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench_device.h"
#include "mkv/attention_views.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/tensor.h"

#ifndef MKV_BENCH_COMMIT
#define MKV_BENCH_COMMIT "unknown"
#endif

namespace {

using mkv::DataType;
using mkv::DeviceType;
using mkv::Tensor;
using mkv::kernels::PagedBuffers;
using mkv::kernels::RowBuffer;
using mkv::kernels::RowBufferPair;

constexpr int kExitNoDevice = 77;
constexpr int kExitMismatch = 2;
constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;
constexpr int64_t kGiB = 1024 * kMiB;
/// K or V page row of one token: 8 KV heads x 128 dims x 2 B (bf16).
constexpr int64_t kTokenBytes = int64_t{8} * 128 * 2;
/// Bytes one G1-G3 call moves (>= 256 MiB so HBM, not L2, is measured: docs/benchmarks.md, "The
/// measurements behind the kernels").
constexpr int64_t kBandwidthBytes = kGiB;
/// Per-copy loops are subsampled beyond this many cudaMemcpyAsync calls per repetition
/// (~4 us each on the H200: docs/benchmarks.md, "The measurements behind the kernels").
constexpr int64_t kLoopCopies = 4096;
/// Bytes one G7 call moves between the GPU and pinned host memory (about 5 ms over PCIe 5).
constexpr int64_t kTierBytes = 256 * kMiB;
constexpr int kLoopReps = 3;

struct Options {
  std::string csvPath;
  std::string filter;
  int reps = 15;
  int warmups = 3;
};

[[noreturn]] void fail(std::string const& message) {
  std::fprintf(stderr, "mkv_gpu_bench: %s\n", message.c_str());
  std::exit(1);
}

void check(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess) {
    fail(fmt::format("{}: {}: {}", what, cudaGetErrorName(status), cudaGetErrorString(status)));
  }
}

/// Owning device allocation.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t bytes) : mBytes(bytes) {
    check(cudaMalloc(&mData, static_cast<std::size_t>(bytes)),
          fmt::format("cudaMalloc({} B)", bytes));
  }
  ~DeviceBuffer() { (void)cudaFree(mData); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(mData); }
  int64_t size() const { return mBytes; }

 private:
  void* mData = nullptr;
  int64_t mBytes;
};

/// Owning pinned host allocation, mapped into the device's address space: what a host KV tier
/// would hold (issue #18). `device()` is the address kernels use.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(int64_t bytes) : mBytes(bytes) {
    check(cudaHostAlloc(&mHost, static_cast<std::size_t>(bytes), cudaHostAllocMapped),
          fmt::format("cudaHostAlloc({} B)", bytes));
    check(cudaHostGetDevicePointer(&mDevice, mHost, 0), "cudaHostGetDevicePointer");
  }
  ~PinnedBuffer() { (void)cudaFreeHost(mHost); }
  PinnedBuffer(PinnedBuffer const&) = delete;
  PinnedBuffer& operator=(PinnedBuffer const&) = delete;
  uint8_t* host() const { return static_cast<uint8_t*>(mHost); }
  uint8_t* device() const { return static_cast<uint8_t*>(mDevice); }
  int64_t size() const { return mBytes; }

 private:
  void* mHost = nullptr;
  void* mDevice = nullptr;
  int64_t mBytes;
};

/// One line of the result table.
struct Row {
  Row(std::string name, std::string how, int64_t byteCount)
      : caseName(std::move(name)), method(std::move(how)), bytes(byteCount) {}
  std::string caseName;
  std::string method;
  int64_t bytes = 0;
  double us = 0;
  double ratio = 0;  // same-run memcpy time / this time
  std::string target;
  std::string status;  // PASS, MISS, or "-" (reported only)
  std::string note;
  uint64_t mismatches = 0;
  double tbps() const { return us > 0 ? 2.0 * static_cast<double>(bytes) / (us * 1e6) : 0.0; }
};

std::string humanBytes(int64_t bytes) {
  if (bytes >= kGiB && bytes % kGiB == 0) {
    return fmt::format("{} GiB", bytes / kGiB);
  }
  if (bytes >= kMiB) {
    return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / static_cast<double>(kMiB));
  }
  return fmt::format("{} KiB", bytes / kKiB);
}

std::vector<int32_t> distinct(int64_t count, int64_t limit, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<std::size_t>(limit));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(count));
  return ids;
}

std::vector<int32_t> sequence(int64_t count) {
  std::vector<int32_t> ids(static_cast<std::size_t>(count));
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

class Bench {
 public:
  explicit Bench(Options options)
      : mOptions(std::move(options)),
        mSource(4 * kGiB),
        mDestination(2 * kGiB),
        mScratch(2 * kGiB),
        mMap(int64_t{2} * 2 * 65536 * static_cast<int64_t>(sizeof(int64_t))) {
    check(cudaStreamCreateWithFlags(&mStream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&mStart), "cudaEventCreate");
    check(cudaEventCreate(&mStop), "cudaEventCreate");
    mkv::bench::fillRandom(mSource.data(), mSource.size(), 0x5EED0001, mStream);
    mkv::bench::fillRandom(mScratch.data(), mScratch.size(), 0x5EED0002, mStream);
    check(cudaStreamSynchronize(mStream), "initial fill");
  }
  ~Bench() {
    (void)cudaEventDestroy(mStart);
    (void)cudaEventDestroy(mStop);
    (void)cudaStreamDestroy(mStream);
  }
  Bench(Bench const&) = delete;
  Bench& operator=(Bench const&) = delete;

  void runAll() {
    for (int64_t const pageKiB : {32, 64, 128, 256}) {
      pageCase("G1 gather", pageKiB * kKiB, PageIds::kGather, 0.93);
    }
    for (int64_t const pageKiB : {32, 64, 128, 256}) {
      pageCase("G2 scatter-gather", pageKiB * kKiB, PageIds::kScatterGather, 0.90);
    }
    for (int64_t const pageKiB : {32, 64, 128, 256}) {
      pageCase("G3 sequential", pageKiB * kKiB, PageIds::kSequential, 0.96);
    }
    for (int32_t const layers : {32, 80}) {
      for (int32_t const pages : {16, 64, 256}) {
        decodeCase(layers, pages);
      }
    }
    for (int64_t const n : {256, 32768}) {
      for (int64_t const rowKiB : {2, 8, 16, 64}) {
        rowCase(RowKind::kCopyRows, rowKiB * kKiB, n);
        rowCase(RowKind::kCompactBatch, rowKiB * kKiB, n);
        rowCase(RowKind::kHiddenCapture, rowKiB * kKiB, n);
      }
    }
    // 2 KiB rows at n = 32768 move 64 MiB, where a launch's fixed costs weigh a few percent; the
    // same rows over 256 MiB separate those costs from the kernel's streaming rate.
    rowCase(RowKind::kCopyRows, 2 * kKiB, 131072);
    rowCase(RowKind::kHiddenCapture, 2 * kKiB, 131072);
    for (bool const offload : {true, false}) {
      for (int64_t const pageKiB : {32, 256}) {
        tierCase(offload, pageKiB * kKiB);
      }
    }
    for (bool const offload : {true, false}) {
      for (int64_t const pageKiB : {32, 256}) {
        hostTierCase(offload, pageKiB * kKiB);
      }
    }
    for (int32_t const rows : {64, 256, 1024}) {
      for (int32_t const context : {4096, 32768}) {
        viewsCase(rows, context);
      }
    }
  }

  std::vector<Row> const& rows() const { return mRows; }
  bool anyMismatch() const {
    return std::any_of(mRows.begin(), mRows.end(), [](Row const& r) { return r.mismatches != 0; });
  }

 private:
  enum class PageIds { kGather, kScatterGather, kSequential };
  enum class RowKind { kCopyRows, kCompactBatch, kHiddenCapture };

  bool selected(std::string const& name) const {
    return mOptions.filter.empty() || name.find(mOptions.filter) != std::string::npos;
  }

  /// Median time in us of `op` over `reps` event-bracketed repetitions after `warmups`.
  double medianUs(int reps, int warmups, std::function<void()> const& op) {
    for (int i = 0; i < warmups; ++i) {
      op();
    }
    check(cudaStreamSynchronize(mStream), "warm-up");
    std::vector<double> times;
    for (int i = 0; i < reps; ++i) {
      check(cudaEventRecord(mStart, mStream), "cudaEventRecord");
      op();
      check(cudaEventRecord(mStop, mStream), "cudaEventRecord");
      check(cudaEventSynchronize(mStop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, mStart, mStop), "cudaEventElapsedTime");
      times.push_back(static_cast<double>(ms) * 1000.0);
    }
    check(cudaGetLastError(), "timed operation");
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }
  double medianUs(std::function<void()> const& op) {
    return medianUs(mOptions.reps, mOptions.warmups, op);
  }

  void poison(void* dst, int64_t bytes) {
    check(cudaMemsetAsync(dst, 0xFF, static_cast<std::size_t>(bytes), mStream), "poison");
  }
  void copy(void* dst, void const* src, int64_t bytes) {
    check(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice,
                          mStream),
          "cudaMemcpyAsync");
  }

  /// Mismatching words of `rows` rows at dst against ref rows map[r] (0xFF rows for -1).
  uint64_t verify(void const* dst, void const* ref, int64_t rowBytes,
                  std::vector<int64_t> const& map) {
    auto const bytes = static_cast<int64_t>(map.size() * sizeof(int64_t));
    if (bytes > mMap.size()) {
      fail("verification map too large");
    }
    check(cudaMemcpyAsync(mMap.data(), map.data(), static_cast<std::size_t>(bytes),
                          cudaMemcpyHostToDevice, mStream),
          "upload map");
    return mkv::bench::countMismatches(dst, ref, rowBytes, static_cast<int64_t>(map.size()),
                                       reinterpret_cast<int64_t const*>(mMap.data()), mStream);
  }

  Tensor upload(std::vector<int32_t> const& values) {
    Tensor tensor({static_cast<int64_t>(values.size())}, DataType::kInt32, DeviceType::kGPU);
    check(cudaMemcpy(tensor.rawPointer(), values.data(), values.size() * sizeof(int32_t),
                     cudaMemcpyHostToDevice),
          "upload ids");
    return tensor;
  }

  /// The same-run denominator: one contiguous cudaMemcpyAsync of `bytes`, verified.
  Row memcpyRow(std::string const& name, int64_t bytes) {
    poison(mDestination.data(), bytes);
    Row row{name, "cudaMemcpyAsync contiguous", bytes};
    row.us = medianUs([&] { copy(mDestination.data(), mSource.data(), bytes); });
    row.mismatches = verify(mDestination.data(), mSource.data(), bytes, {0});
    row.ratio = 1.0;
    row.target = "denominator";
    row.status = "-";
    return row;
  }

  void add(Row row) {
    fmt::print("  {:<30} {:<34} {:>10.1f} us {:>6.2f} TB/s  x{:<6.3f} {:<18} {:<5} {}{}\n",
               row.caseName, row.method, row.us, row.tbps(), row.ratio, row.target, row.status,
               row.mismatches == 0 ? "" : fmt::format("MISMATCHES {} ", row.mismatches), row.note);
    std::fflush(stdout);
    mRows.push_back(std::move(row));
  }

  static std::string passIf(bool ok) { return ok ? "PASS" : "MISS"; }

  /// Row of a per-copy loop; `kernelUs` is the launcher's time for the same case.
  Row loopRow(std::string const& name, int64_t bytes, double memcpyUs, double loopUs,
              double kernelUs, int64_t copies, int64_t timedCopies, double minSpeedup,
              std::string method) {
    Row row{name, std::move(method), bytes};
    row.us = loopUs;
    row.ratio = memcpyUs / loopUs;
    if (timedCopies < copies) {
      row.note = fmt::format("subsampled {}/{} copies, time scaled", timedCopies, copies);
    }
    if (minSpeedup > 0) {
      row.target = fmt::format("mkv >= {:.0f}x loop", minSpeedup);
      row.status = passIf(loopUs >= minSpeedup * kernelUs);
      row.note +=
          fmt::format("{}mkv is {:.0f}x faster", row.note.empty() ? "" : "; ", loopUs / kernelUs);
    } else {
      row.target = "report";
      row.status = "-";
    }
    return row;
  }

  /// G1-G3: whole K+V pages of one layer, 1 GiB moved per call.
  void pageCase(char const* kind, int64_t pageBytes, PageIds ids, double minRatio) {
    std::string const name = fmt::format("{} {}KiB", kind, pageBytes / kKiB);
    if (!selected(name)) {
      return;
    }
    int64_t const items = kBandwidthBytes / (2 * pageBytes);
    auto const tokensPerPage = static_cast<int32_t>(pageBytes / kTokenBytes);
    auto const srcPages = static_cast<int32_t>(2 * items);
    auto const dstPages = static_cast<int32_t>(ids == PageIds::kScatterGather ? 2 * items : items);
    std::mt19937_64 rng(static_cast<uint64_t>(pageBytes) * 31 + static_cast<uint64_t>(ids));
    std::vector<int32_t> const srcIds =
        ids == PageIds::kSequential ? sequence(items) : distinct(items, srcPages, rng);
    std::vector<int32_t> const dstIds =
        ids == PageIds::kScatterGather ? distinct(items, dstPages, rng) : sequence(items);
    int64_t const bytes = 2 * items * pageBytes;
    int64_t const dstBytes = 2 * int64_t{dstPages} * pageBytes;

    fmt::print("{}: {} items x K+V pages of {}, {} moved\n", name, items, humanBytes(pageBytes),
               humanBytes(bytes));
    Row const denominator = memcpyRow(name, bytes);
    add(denominator);

    auto expectedMap = [&](int64_t usedItems) {
      std::vector<int64_t> map(static_cast<std::size_t>(2 * dstPages), -1);
      for (int64_t i = 0; i < usedItems; ++i) {
        for (int64_t half = 0; half < 2; ++half) {
          map[static_cast<std::size_t>(half * dstPages + dstIds[static_cast<std::size_t>(i)])] =
              half * srcPages + srcIds[static_cast<std::size_t>(i)];
        }
      }
      return map;
    };

    Tensor const srcIdTensor = upload(srcIds);
    Tensor const dstIdTensor = upload(dstIds);
    std::vector<void*> const srcBase{mSource.data()};
    std::vector<void*> const dstBase{mDestination.data()};
    PagedBuffers const src{srcBase, DeviceType::kGPU, srcPages, tokensPerPage, kTokenBytes};
    PagedBuffers const dst{dstBase, DeviceType::kGPU, dstPages, tokensPerPage, kTokenBytes};
    poison(mDestination.data(), dstBytes);
    Row kernel{name, "mkv copyPages", bytes};
    kernel.us = medianUs(
        [&] { mkv::kernels::copyPages(src, dst, srcIdTensor, dstIdTensor, nullptr, mStream); });
    kernel.mismatches = verify(mDestination.data(), mSource.data(), pageBytes, expectedMap(items));
    kernel.ratio = denominator.us / kernel.us;
    kernel.target = fmt::format(">= {:.2f}x memcpy", minRatio);
    kernel.status = passIf(kernel.ratio >= minRatio);
    add(kernel);

    int64_t const loopItems = std::min(items, kLoopCopies / 2);
    poison(mDestination.data(), dstBytes);
    double const loopUs =
        medianUs(kLoopReps, 1,
                 [&] {
                   for (int64_t i = 0; i < loopItems; ++i) {
                     for (int64_t half = 0; half < 2; ++half) {
                       copy(mDestination.data() +
                                (half * dstPages + dstIds[static_cast<std::size_t>(i)]) * pageBytes,
                            mSource.data() +
                                (half * srcPages + srcIds[static_cast<std::size_t>(i)]) * pageBytes,
                            pageBytes);
                     }
                   }
                 }) *
        static_cast<double>(items) / static_cast<double>(loopItems);
    Row loop = loopRow(name, bytes, denominator.us, loopUs, kernel.us, 2 * items, 2 * loopItems,
                       pageBytes <= 64 * kKiB ? 20.0 : 0.0, "cudaMemcpyAsync per page");
    loop.mismatches =
        verify(mDestination.data(), mSource.data(), pageBytes, expectedMap(loopItems));
    add(loop);
  }

  /// G7: pages between the GPU pool and a pool in pinned host memory (a host KV tier), through
  /// PCIe: offload gathers random GPU pages into consecutive host pages, onboard scatters
  /// consecutive host pages into random GPU pages. The kernel reads or writes host memory through
  /// its mapped address; the denominator is one contiguous cudaMemcpyAsync of the same bytes in
  /// the same direction (the copy engines). Reported, not gated.
  void tierCase(bool offload, int64_t pageBytes) {
    std::string const name = fmt::format(
        "G7 {} {}KiB", offload ? "offload GPU->host" : "onboard host->GPU", pageBytes / kKiB);
    if (!selected(name)) {
      return;
    }
    int64_t const items = kTierBytes / (2 * pageBytes);
    auto const tokensPerPage = static_cast<int32_t>(pageBytes / kTokenBytes);
    auto const gpuPages = static_cast<int32_t>(2 * items);
    auto const hostPages = static_cast<int32_t>(items);
    std::mt19937_64 rng(static_cast<uint64_t>(pageBytes) * 37 + (offload ? 1 : 2));
    std::vector<int32_t> const gpuIds = distinct(items, gpuPages, rng);
    std::vector<int32_t> const hostIds = sequence(items);
    int64_t const bytes = 2 * items * pageBytes;
    PinnedBuffer& host = pinned();
    mkv::bench::fillRandom(host.device(), bytes, 0x5EED0003, mStream);
    // GPU side: the source pool (offload) or the destination pool (onboard, poisoned).
    uint8_t* const gpu = offload ? mSource.data() : mDestination.data();
    int64_t const gpuBytes = 2 * int64_t{gpuPages} * pageBytes;
    fmt::print("{}: {} items x K+V pages of {}, {} moved\n", name, items, humanBytes(pageBytes),
               humanBytes(bytes));

    Row denominator{name,
                    offload ? "cudaMemcpyAsync D2H contiguous"
                            : "cudaMemcpyAsync H2D "
                              "contiguous",
                    bytes};
    denominator.us = medianUs([&] {
      check(cudaMemcpyAsync(offload ? host.host() : gpu, offload ? gpu : host.host(),
                            static_cast<std::size_t>(bytes),
                            offload ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, mStream),
            "cudaMemcpyAsync across tiers");
    });
    denominator.mismatches =
        verify(offload ? host.device() : gpu, offload ? gpu : host.device(), bytes, {0});
    denominator.ratio = 1.0;
    denominator.target = "denominator";
    denominator.status = "-";
    add(denominator);

    // Row r of the destination pool against the source pool: page ids per half.
    auto expectedMap = [&](int64_t usedItems) {
      int32_t const dstPages = offload ? hostPages : gpuPages;
      int32_t const srcPages = offload ? gpuPages : hostPages;
      std::vector<int64_t> map(static_cast<std::size_t>(2 * dstPages), -1);
      for (int64_t i = 0; i < usedItems; ++i) {
        auto const u = static_cast<std::size_t>(i);
        int32_t const srcId = offload ? gpuIds[u] : hostIds[u];
        int32_t const dstId = offload ? hostIds[u] : gpuIds[u];
        for (int64_t half = 0; half < 2; ++half) {
          map[static_cast<std::size_t>(half * dstPages + dstId)] = half * srcPages + srcId;
        }
      }
      return map;
    };
    std::vector<void*> const gpuBase{gpu};
    std::vector<void*> const hostBase{host.device()};
    PagedBuffers const gpuPool{gpuBase, DeviceType::kGPU, gpuPages, tokensPerPage, kTokenBytes};
    PagedBuffers const hostPool{hostBase, DeviceType::kGPU, hostPages, tokensPerPage, kTokenBytes};
    Tensor const gpuIdTensor = upload(gpuIds);
    Tensor const hostIdTensor = upload(hostIds);
    uint8_t* const dstData = offload ? host.device() : gpu;
    uint8_t const* const srcData = offload ? gpu : host.device();
    int64_t const dstBytes = offload ? bytes : gpuBytes;
    poison(dstData, dstBytes);
    Row kernel{name, "mkv copyPages", bytes};
    kernel.us = medianUs([&] {
      mkv::kernels::copyPages(offload ? gpuPool : hostPool, offload ? hostPool : gpuPool,
                              offload ? gpuIdTensor : hostIdTensor,
                              offload ? hostIdTensor : gpuIdTensor, nullptr, mStream);
    });
    kernel.mismatches = verify(dstData, srcData, pageBytes, expectedMap(items));
    kernel.ratio = denominator.us / kernel.us;
    kernel.target = "report";
    kernel.status = "-";
    add(kernel);

    int64_t const loopItems = std::min(items, kLoopCopies / 2);
    poison(dstData, dstBytes);
    auto pageAt = [&](uint8_t* base, int32_t pages, int64_t half, int32_t id) {
      return base + (half * pages + id) * pageBytes;
    };
    double const loopUs =
        medianUs(
            kLoopReps, 1,
            [&] {
              for (int64_t i = 0; i < loopItems; ++i) {
                auto const u = static_cast<std::size_t>(i);
                for (int64_t half = 0; half < 2; ++half) {
                  uint8_t* const g = pageAt(gpu, gpuPages, half, gpuIds[u]);
                  uint8_t* const h = pageAt(host.host(), hostPages, half, hostIds[u]);
                  check(cudaMemcpyAsync(
                            offload ? h : g, offload ? g : h, static_cast<std::size_t>(pageBytes),
                            offload ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, mStream),
                        "cudaMemcpyAsync per page across tiers");
                }
              }
            }) *
        static_cast<double>(items) / static_cast<double>(loopItems);
    Row loop = loopRow(name, bytes, denominator.us, loopUs, kernel.us, 2 * items, 2 * loopItems,
                       0.0, "cudaMemcpyAsync per page");
    loop.mismatches = verify(dstData, srcData, pageBytes, expectedMap(loopItems));
    add(loop);
  }

  /// G8: the G7 copies through mkv::HostKvTier, the library's host tier: one transfer() of every
  /// page (ids in inline patch launches on the tier stream, which waits for this stream first,
  /// then one copyPages launch) and orderBefore() of this stream, so the events bracket the whole
  /// tier round. Denominator: one contiguous cudaMemcpyAsync of the same bytes, same direction.
  void hostTierCase(bool offload, int64_t pageBytes) {
    std::string const name =
        fmt::format("G8 HostKvTier {} {}KiB", offload ? "offload" : "onboard", pageBytes / kKiB);
    if (!selected(name)) {
      return;
    }
    int64_t const items = kTierBytes / (2 * pageBytes);
    auto const tokensPerPage = static_cast<int32_t>(pageBytes / kTokenBytes);
    auto const gpuPages = static_cast<int32_t>(2 * items);
    auto const hostPages = static_cast<int32_t>(items);
    mkv::KVCachePool gpuPool(mkv::KVCachePoolConfig{1, 8, 128, tokensPerPage, gpuPages, 1,
                                                    DataType::kBFloat16, DeviceType::kGPU});
    mkv::HostKvTier tier(mkv::HostKvTierConfig{hostPages, {}}, gpuPool);
    void* const gpu = gpuPool.layer(0).rawPointer();
    void* const hostMapped = tier.pagedBuffers().layerBases[0];
    void* const hostAddress = const_cast<void*>(tier.hostPage(0, 0, 0));
    int64_t const bytes = 2 * items * pageBytes;
    int64_t const gpuBytes = 2 * int64_t{gpuPages} * pageBytes;
    mkv::bench::fillRandom(gpu, gpuBytes, 0x5EED0004, mStream);
    mkv::bench::fillRandom(hostMapped, bytes, 0x5EED0005, mStream);
    std::mt19937_64 rng(static_cast<uint64_t>(pageBytes) * 41 + (offload ? 1 : 2));
    std::vector<int32_t> const gpuIds = distinct(items, gpuPages, rng);
    std::vector<mkv::HostPageCopy> copies;
    for (int64_t i = 0; i < items; ++i) {
      int32_t const g = gpuIds[static_cast<std::size_t>(i)];
      auto const h = static_cast<int32_t>(i);
      copies.push_back(offload ? mkv::HostPageCopy{g, h} : mkv::HostPageCopy{h, g});
    }
    fmt::print("{}: {} items x K+V pages of {}, {} moved\n", name, items, humanBytes(pageBytes),
               humanBytes(bytes));

    Row denominator{
        name, offload ? "cudaMemcpyAsync D2H contiguous" : "cudaMemcpyAsync H2D contiguous", bytes};
    denominator.us = medianUs([&] {
      check(cudaMemcpyAsync(offload ? hostAddress : gpu, offload ? gpu : hostAddress,
                            static_cast<std::size_t>(bytes),
                            offload ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, mStream),
            "cudaMemcpyAsync across tiers");
    });
    denominator.mismatches =
        verify(offload ? hostMapped : gpu, offload ? gpu : hostMapped, bytes, {0});
    denominator.ratio = 1.0;
    denominator.target = "denominator";
    denominator.status = "-";
    add(denominator);

    void* const dstData = offload ? hostMapped : gpu;
    void const* const srcData = offload ? gpu : hostMapped;
    poison(dstData, offload ? bytes : gpuBytes);
    std::span<mkv::HostPageCopy const> const none;
    Row transfer{name, "HostKvTier::transfer + orderBefore", bytes};
    transfer.us = medianUs([&] {
      tier.transfer("G8", offload ? std::span<mkv::HostPageCopy const>(copies) : none,
                    offload ? none : std::span<mkv::HostPageCopy const>(copies), mStream);
      tier.orderBefore("G8", mStream);
    });
    // Row r of the destination pool against the source pool, per half.
    int32_t const dstPages = offload ? hostPages : gpuPages;
    int32_t const srcPages = offload ? gpuPages : hostPages;
    std::vector<int64_t> map(static_cast<std::size_t>(2 * dstPages), -1);
    for (mkv::HostPageCopy const& copy : copies) {
      for (int64_t half = 0; half < 2; ++half) {
        map[static_cast<std::size_t>(half * dstPages + copy.to)] = half * srcPages + copy.from;
      }
    }
    transfer.mismatches = verify(dstData, srcData, pageBytes, map);
    transfer.ratio = denominator.us / transfer.us;
    transfer.target = "report";
    transfer.status = "-";
    transfer.note =
        fmt::format("{} launches per call", tier.launches() / (mOptions.reps + mOptions.warmups));
    add(transfer);
    check(tier.synchronize(), "HostKvTier::synchronize");
  }

  /// G9: the kernel-ready views of one decode step (AttentionViews::build): `rows` rows of
  /// `context` tokens each in pages of 16 tokens (distinct random page ids), one new token per row,
  /// resident slots in reverse execution order. Rows: the views' bytes as one contiguous
  /// cudaMemcpyAsync (denominator); the GPU build, one launch from the table's device copy
  /// (event-timed); what that build() call costs the engine thread (host clock, nothing waited
  /// for: validation and the launch); the host twin over the same table on the CPU (host clock).
  /// Every GPU view is compared with the twin's, byte for byte.
  void viewsCase(int32_t rows, int32_t context) {
    std::string const name = fmt::format("G9 views n={} ctx={}", rows, context);
    if (!selected(name)) {
      return;
    }
    constexpr int32_t kViewPage = 16;
    int32_t const pagesPerRow = (context + 1 + kViewPage - 1) / kViewPage;
    int32_t const numPages = rows * pagesPerRow + 1;  // page 0 stays the null page
    std::mt19937_64 rng(static_cast<uint64_t>(rows) * 131 + static_cast<uint64_t>(context));
    std::vector<int32_t> ids = distinct(int64_t{rows} * pagesPerRow, numPages - 1, rng);
    for (int32_t& id : ids) {
      ++id;
    }
    std::vector<mkv::CacheSlot> slots(static_cast<std::size_t>(rows));
    std::vector<int32_t> const lengths(static_cast<std::size_t>(rows), context);
    std::vector<int32_t> const newTokens(static_cast<std::size_t>(rows), 1);
    mkv::KVPageTable gpuTable(rows, pagesPerRow, numPages, mkv::PageTableMode::kDense,
                              DeviceType::kGPU);
    mkv::KVPageTable cpuTable(rows, pagesPerRow, numPages, mkv::PageTableMode::kDense,
                              DeviceType::kCPU);
    for (int32_t r = 0; r < rows; ++r) {
      slots[static_cast<std::size_t>(r)] = rows - 1 - r;
      std::span<int32_t const> const row(ids.data() + int64_t{r} * pagesPerRow,
                                         static_cast<std::size_t>(pagesPerRow));
      gpuTable.setRow(r, row);
      cpuTable.setRow(r, row);
    }
    if (!gpuTable.upload(mStream)) {
      fail(name + ": table upload failed");
    }
    mkv::AttentionViews gpuViews(gpuTable, kViewPage, rows, rows, mStream);
    mkv::AttentionViews cpuViews(cpuTable, kViewPage, rows, rows);
    auto const build = [&](mkv::AttentionViews& views) { views.build(slots, lengths, newTokens); };
    build(cpuViews);
    build(gpuViews);
    check(cudaStreamSynchronize(mStream), "first build");
    std::vector<Tensor const*> const gpuTensors = viewTensors(gpuViews);
    std::vector<Tensor const*> const cpuTensors = viewTensors(cpuViews);
    int64_t bytes = 0;
    uint64_t mismatches = 0;
    for (std::size_t i = 0; i < gpuTensors.size(); ++i) {
      auto const size = static_cast<std::size_t>(cpuTensors[i]->sizeBytes());
      std::vector<unsigned char> host(size);
      check(cudaMemcpy(host.data(), gpuTensors[i]->rawPointer(), size, cudaMemcpyDeviceToHost),
            "read views");
      auto const* twin = static_cast<unsigned char const*>(cpuTensors[i]->rawPointer());
      for (std::size_t b = 0; b < size; ++b) {
        mismatches += host[b] != twin[b] ? 1U : 0U;
      }
      bytes += static_cast<int64_t>(size);
    }
    fmt::print("{}: {} table entries, {} of views\n", name, int64_t{rows} * pagesPerRow,
               humanBytes(bytes));
    Row denominator = memcpyRow(name, bytes);
    add(denominator);
    Row kernel{name, "AttentionViews::build GPU (1 launch)", bytes};
    kernel.us = medianUs([&] { build(gpuViews); });
    kernel.ratio = denominator.us / kernel.us;
    kernel.target = "report";
    kernel.status = "-";
    kernel.mismatches = mismatches;
    add(kernel);
    Row call{name, "build() GPU: engine-thread cost", bytes};
    call.us = hostMedianUs([&] { build(gpuViews); });
    call.ratio = denominator.us / call.us;
    call.target = "report";
    call.status = "-";
    call.note = "host clock, no wait";
    add(call);
    check(cudaStreamSynchronize(mStream), "views builds");
    Row twin{name, "AttentionViews::build CPU twin", bytes};
    twin.us = hostMedianUs([&] { build(cpuViews); });
    twin.ratio = denominator.us / twin.us;
    twin.target = "report";
    twin.status = "-";
    twin.note = fmt::format("host clock; the GPU launch takes 1/{:.1f} of it", twin.us / kernel.us);
    add(twin);
  }

  static std::vector<Tensor const*> viewTensors(mkv::AttentionViews const& views) {
    return {&views.blockTable(),    &views.seqLensBefore(), &views.seqLensAfter(),
            &views.queryStartLoc(), &views.kvIndptr(),      &views.kvIndices(),
            &views.kvLastPageLen(), &views.slotMapping()};
  }

  /// Median host-clock time in us of `op` over the run's repetitions after its warm-ups (what a
  /// call costs the calling thread; nothing is synchronised between calls).
  double hostMedianUs(std::function<void()> const& op) const {
    for (int i = 0; i < mOptions.warmups; ++i) {
      op();
    }
    std::vector<double> times;
    for (int i = 0; i < mOptions.reps; ++i) {
      auto const start = std::chrono::steady_clock::now();
      op();
      times.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  /// The pinned host pool of the G7 cases, allocated at their first use.
  PinnedBuffer& pinned() {
    if (!mPinned) {
      mPinned = std::make_unique<PinnedBuffer>(kTierBytes);
    }
    return *mPinned;
  }

  /// G4: one decode step over every layer; separate per-layer pools, random ids.
  /// `pagesPerLayer` pages of 32 KiB per layer = pagesPerLayer / 2 ids with K and V halves.
  void decodeCase(int32_t layers, int32_t pagesPerLayer) {
    std::string const name = fmt::format("G4 decode L={} n={}", layers, pagesPerLayer);
    if (!selected(name)) {
      return;
    }
    int64_t const pageBytes = 32 * kKiB;
    int32_t const items = pagesPerLayer / 2;
    int32_t const poolPages = pagesPerLayer;
    int64_t const poolBytes = 2 * int64_t{poolPages} * pageBytes;
    int64_t const bytes = int64_t{layers} * 2 * items * pageBytes;
    std::mt19937_64 rng(static_cast<uint64_t>(layers) * 1000 +
                        static_cast<uint64_t>(pagesPerLayer));
    std::vector<int32_t> const srcIds = distinct(items, poolPages, rng);
    std::vector<int32_t> const dstIds = distinct(items, poolPages, rng);
    std::vector<void*> srcBases;
    std::vector<void*> dstBases;
    for (int32_t l = 0; l < layers; ++l) {
      srcBases.push_back(mSource.data() + l * poolBytes);
      dstBases.push_back(mDestination.data() + l * poolBytes);
    }
    fmt::print("{}: {} layers x {} ids x K+V pages of 32 KiB in one call, {} moved\n", name, layers,
               items, humanBytes(bytes));
    Row const denominator = memcpyRow(name, bytes);
    add(denominator);

    auto verifyLayers = [&](int64_t usedItems) {
      std::vector<int64_t> map(static_cast<std::size_t>(2 * poolPages), -1);
      for (int64_t i = 0; i < usedItems; ++i) {
        for (int64_t half = 0; half < 2; ++half) {
          map[static_cast<std::size_t>(half * poolPages + dstIds[static_cast<std::size_t>(i)])] =
              half * poolPages + srcIds[static_cast<std::size_t>(i)];
        }
      }
      uint64_t mismatches = 0;
      for (int32_t l = 0; l < layers; ++l) {
        mismatches += verify(dstBases[static_cast<std::size_t>(l)],
                             srcBases[static_cast<std::size_t>(l)], pageBytes, map);
      }
      return mismatches;
    };

    Tensor const srcIdTensor = upload(srcIds);
    Tensor const dstIdTensor = upload(dstIds);
    PagedBuffers const src{srcBases, DeviceType::kGPU, poolPages, 16, kTokenBytes};
    PagedBuffers const dst{dstBases, DeviceType::kGPU, poolPages, 16, kTokenBytes};
    auto launch = [&] {
      mkv::kernels::copyPages(src, dst, srcIdTensor, dstIdTensor, nullptr, mStream);
    };
    poison(mDestination.data(), layers * poolBytes);
    Row kernel{name, "mkv copyPages (one launch)", bytes};
    kernel.us = medianUs(launch);
    kernel.mismatches = verifyLayers(items);
    kernel.ratio = denominator.us / kernel.us;
    bool const gated = layers == 32 && pagesPerLayer == 64;
    kernel.target = gated ? "<= 45 us" : "report";
    kernel.status = gated ? passIf(kernel.us <= 45.0) : "-";
    add(kernel);

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check(cudaStreamBeginCapture(mStream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    launch();
    check(cudaStreamEndCapture(mStream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    poison(mDestination.data(), layers * poolBytes);
    Row replay{name, "mkv copyPages as CUDA graph", bytes};
    replay.us = medianUs([&] { check(cudaGraphLaunch(exec, mStream), "cudaGraphLaunch"); });
    replay.mismatches = verifyLayers(items);
    replay.ratio = denominator.us / replay.us;
    replay.target = "mkv <= 1.3x graph";
    replay.status = passIf(kernel.us <= 1.3 * replay.us);
    add(replay);
    check(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    check(cudaGraphDestroy(graph), "cudaGraphDestroy");

    int64_t const copies = int64_t{layers} * 2 * items;
    int64_t const loopItems = std::clamp<int64_t>(kLoopCopies / (2 * int64_t{layers}), 1, items);
    poison(mDestination.data(), layers * poolBytes);
    double const loopUs =
        medianUs(
            kLoopReps, 1,
            [&] {
              for (int64_t i = 0; i < loopItems; ++i) {
                for (int32_t l = 0; l < layers; ++l) {
                  for (int64_t half = 0; half < 2; ++half) {
                    copy(static_cast<uint8_t*>(dstBases[static_cast<std::size_t>(l)]) +
                             (half * poolPages + dstIds[static_cast<std::size_t>(i)]) * pageBytes,
                         static_cast<uint8_t const*>(srcBases[static_cast<std::size_t>(l)]) +
                             (half * poolPages + srcIds[static_cast<std::size_t>(i)]) * pageBytes,
                         pageBytes);
                  }
                }
              }
            }) *
        static_cast<double>(items) / static_cast<double>(loopItems);
    Row loop = loopRow(name, bytes, denominator.us, loopUs, kernel.us, copies,
                       int64_t{layers} * 2 * loopItems, 10.0, "cudaMemcpyAsync per page");
    loop.mismatches = verifyLayers(loopItems);
    add(loop);
  }

  /// G5: rows of per-slot state / hidden states: gather (copyRows), in-place forward
  /// compaction (compactBatch), scatter-gather of hidden rows (captureHiddenRows).
  void rowCase(RowKind kind, int64_t rowBytes, int64_t n) {
    char const* const kindName = kind == RowKind::kCopyRows       ? "copyRows"
                                 : kind == RowKind::kCompactBatch ? "compactBatch"
                                                                  : "captureHidden";
    std::string const name = fmt::format("G5 {} {}KiB n={}", kindName, rowBytes / kKiB, n);
    if (!selected(name)) {
      return;
    }
    std::mt19937_64 rng(static_cast<uint64_t>(rowBytes) * 7 + static_cast<uint64_t>(n) +
                        static_cast<uint64_t>(kind));
    bool const gated = n >= 32768;
    double const minRatio = 0.90;

    if (kind == RowKind::kCompactBatch) {
      compactCase(name, rowBytes, n, gated, minRatio, rng);
      return;
    }
    // Gather from a 2n-row source into n destination rows.
    std::vector<int32_t> const srcRows = distinct(n, 2 * n, rng);
    std::vector<int32_t> const dstRows =
        kind == RowKind::kCopyRows ? sequence(n) : distinct(n, n, rng);
    int64_t const bytes = n * rowBytes;
    fmt::print("{}: {} rows of {} from a pool of {}, {} moved\n", name, n, humanBytes(rowBytes),
               2 * n, humanBytes(bytes));
    Row const denominator = memcpyRow(name, bytes);
    add(denominator);
    auto expectedMap = [&](int64_t usedItems) {
      std::vector<int64_t> map(static_cast<std::size_t>(n), -1);
      for (int64_t i = 0; i < usedItems; ++i) {
        map[static_cast<std::size_t>(dstRows[static_cast<std::size_t>(i)])] =
            srcRows[static_cast<std::size_t>(i)];
      }
      return map;
    };
    Tensor const srcTensor = upload(srcRows);
    Tensor const dstTensor = upload(dstRows);
    poison(mDestination.data(), bytes);
    Row kernel{name, kind == RowKind::kCopyRows ? "mkv copyRows" : "mkv captureHiddenRows", bytes};
    if (kind == RowKind::kCopyRows) {
      std::vector<RowBufferPair> const pairs{{RowBuffer{mSource.data(), rowBytes, 2 * n},
                                              RowBuffer{mDestination.data(), rowBytes, n}}};
      kernel.us = medianUs(
          [&] { mkv::kernels::copyRows(pairs, DeviceType::kGPU, srcTensor, dstTensor, mStream); });
    } else {
      Tensor const hidden = Tensor::view(mSource.data(), {2 * n, rowBytes / 2}, DataType::kBFloat16,
                                         DeviceType::kGPU);
      Tensor slab = Tensor::view(mDestination.data(), {n, rowBytes / 2}, DataType::kBFloat16,
                                 DeviceType::kGPU);
      kernel.us = medianUs(
          [&] { mkv::kernels::captureHiddenRows(hidden, srcTensor, slab, dstTensor, mStream); });
    }
    kernel.mismatches = verify(mDestination.data(), mSource.data(), rowBytes, expectedMap(n));
    kernel.ratio = denominator.us / kernel.us;
    kernel.target = gated ? fmt::format(">= {:.2f}x memcpy", minRatio) : "report";
    kernel.status = gated ? passIf(kernel.ratio >= minRatio) : "-";
    add(kernel);

    int64_t const loopItems = std::min(n, kLoopCopies);
    poison(mDestination.data(), bytes);
    double const loopUs =
        medianUs(kLoopReps, 1,
                 [&] {
                   for (int64_t i = 0; i < loopItems; ++i) {
                     copy(mDestination.data() + dstRows[static_cast<std::size_t>(i)] * rowBytes,
                          mSource.data() + srcRows[static_cast<std::size_t>(i)] * rowBytes,
                          rowBytes);
                   }
                 }) *
        static_cast<double>(n) / static_cast<double>(loopItems);
    Row loop = loopRow(name, bytes, denominator.us, loopUs, kernel.us, n, loopItems,
                       rowBytes <= 64 * kKiB ? 20.0 : 0.0, "cudaMemcpyAsync per row");
    loop.mismatches = verify(mDestination.data(), mSource.data(), rowBytes, expectedMap(loopItems));
    add(loop);
  }

  /// In-place forward compaction of n rows, each surviving with probability 1/2. The
  /// pristine rows live in mScratch; the compacted buffer is mDestination.
  void compactCase(std::string const& name, int64_t rowBytes, int64_t n, bool gated,
                   double minRatio, std::mt19937_64& rng) {
    std::vector<int32_t> oldToNew(static_cast<std::size_t>(n), -1);
    std::vector<std::pair<int64_t, int64_t>> moves;  // (old row, new row), ascending
    std::bernoulli_distribution survives(0.5);
    int32_t next = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (survives(rng)) {
        oldToNew[static_cast<std::size_t>(i)] = next;
        if (next != i) {
          moves.emplace_back(i, next);
        }
        ++next;
      }
    }
    int64_t const bytes = static_cast<int64_t>(moves.size()) * rowBytes;
    fmt::print("{}: {} rows of {}, {} survivors, {} moved rows = {} in place\n", name, n,
               humanBytes(rowBytes), next, moves.size(), humanBytes(bytes));
    Row const denominator = memcpyRow(name, bytes);
    add(denominator);
    auto restore = [&] { copy(mDestination.data(), mScratch.data(), n * rowBytes); };
    auto expectedMap = [&](std::size_t usedMoves) {
      std::vector<int64_t> map(static_cast<std::size_t>(n));
      std::iota(map.begin(), map.end(), int64_t{0});
      for (std::size_t m = 0; m < usedMoves; ++m) {
        map[static_cast<std::size_t>(moves[m].second)] = moves[m].first;
      }
      return map;
    };
    Tensor const mapping = upload(oldToNew);
    std::vector<RowBuffer> const buffers{RowBuffer{mDestination.data(), rowBytes, n}};
    int64_t const workspaceBytes =
        mkv::kernels::compactBatchWorkspaceBytes(n, std::span(&rowBytes, 1));
    Tensor workspace({workspaceBytes / static_cast<int64_t>(sizeof(int32_t))}, DataType::kInt32,
                     DeviceType::kGPU);
    auto launch = [&] {
      mkv::kernels::compactBatch(buffers, DeviceType::kGPU, mapping, next, workspace, mStream);
    };
    restore();
    Row kernel{name, "mkv compactBatch (in place)", bytes};
    kernel.us = medianUs(launch);  // repetitions compact already compacted rows: same traffic
    restore();
    launch();
    kernel.mismatches =
        verify(mDestination.data(), mScratch.data(), rowBytes, expectedMap(moves.size()));
    kernel.ratio = denominator.us / kernel.us;
    kernel.target = gated ? fmt::format(">= {:.2f}x memcpy", minRatio) : "report";
    kernel.status = gated ? passIf(kernel.ratio >= minRatio) : "-";
    add(kernel);

    std::size_t const loopMoves = std::min(moves.size(), static_cast<std::size_t>(kLoopCopies));
    auto loopOnce = [&] {
      for (std::size_t m = 0; m < loopMoves; ++m) {
        copy(mDestination.data() + moves[m].second * rowBytes,
             mDestination.data() + moves[m].first * rowBytes, rowBytes);
      }
    };
    restore();
    double const loopUs = medianUs(kLoopReps, 1, loopOnce) * static_cast<double>(moves.size()) /
                          static_cast<double>(std::max<std::size_t>(loopMoves, 1));
    restore();
    loopOnce();
    Row loop = loopRow(name, bytes, denominator.us, loopUs, kernel.us,
                       static_cast<int64_t>(moves.size()), static_cast<int64_t>(loopMoves),
                       rowBytes <= 64 * kKiB ? 20.0 : 0.0, "cudaMemcpyAsync per row (ascending)");
    loop.mismatches =
        verify(mDestination.data(), mScratch.data(), rowBytes, expectedMap(loopMoves));
    add(loop);
  }

  Options mOptions;
  DeviceBuffer mSource;                   // random; source pools and rows
  DeviceBuffer mDestination;              // destinations, poisoned before every method
  DeviceBuffer mScratch;                  // random; pristine rows of the compaction cases
  DeviceBuffer mMap;                      // verification maps
  std::unique_ptr<PinnedBuffer> mPinned;  // the host pool of the G7 cases
  cudaStream_t mStream = nullptr;
  cudaEvent_t mStart = nullptr;
  cudaEvent_t mStop = nullptr;
  std::vector<Row> mRows;
};

void printTable(std::vector<Row> const& rows) {
  fmt::print("\n{:<30} {:<36} {:>10} {:>12} {:>7} {:>7} {:<18} {:<6} {}\n", "case", "method",
             "bytes", "us (median)", "TB/s", "ratio", "target", "status", "note");
  for (Row const& r : rows) {
    fmt::print("{:<30} {:<36} {:>10} {:>12.1f} {:>7.2f} {:>7.3f} {:<18} {:<6} {}{}\n", r.caseName,
               r.method, humanBytes(r.bytes), r.us, r.tbps(), r.ratio, r.target, r.status,
               r.mismatches == 0 ? "" : fmt::format("MISMATCHES {} ", r.mismatches), r.note);
  }
  auto const count = [&](std::string_view s) {
    return std::count_if(rows.begin(), rows.end(), [&](Row const& r) { return r.status == s; });
  };
  fmt::print("\n{} PASS, {} MISS, {} reported only; {} rows with mismatches\n", count("PASS"),
             count("MISS"), count("-"), std::count_if(rows.begin(), rows.end(), [](Row const& r) {
               return r.mismatches != 0;
             }));
}

void writeCsv(std::string const& path, std::vector<Row> const& rows) {
  std::ofstream out(path);
  if (!out) {
    fail("cannot write " + path);
  }
  out << "case,method,bytes,us_median,tbps_rw,ratio_vs_memcpy,target,status,mismatches,note\n";
  for (Row const& r : rows) {
    out << fmt::format("\"{}\",\"{}\",{},{:.3f},{:.4f},{:.4f},\"{}\",{},{},\"{}\"\n", r.caseName,
                       r.method, r.bytes, r.us, r.tbps(), r.ratio, r.target, r.status, r.mismatches,
                       r.note);
  }
}

Options parse(int argc, char** argv) {
  Options options;
  CLI::App app(
      "Times memcpy / managedkv kernels / per-copy loops on the cases G1-G9 of "
      "docs/benchmarks.md,\n"
      "verifying every method bitwise on the device.",
      "mkv_gpu_bench");
  app.footer(
      "exit: 0 ran and verified, 2 mismatches, 77 no CUDA device (nothing measured), 1 usage or "
      "CUDA error");
  app.add_option("--csv", options.csvPath, "also write the rows to a CSV file")->type_name("PATH");
  app.add_option("--filter", options.filter, "only the cases whose name contains it")
      ->type_name("SUBSTRING");
  app.add_option("--reps", options.reps, "timed repetitions per method (the median is reported)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmups", options.warmups, "untimed repetitions before them")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (CLI::CallForHelp const&) {
    std::fputs(app.help().c_str(), stdout);
    std::exit(0);
  } catch (CLI::ParseError const& error) {
    fail(fmt::format("{} (see --help)", error.what()));
  }
  return options;
}

/// The program; main() turns an exception that escapes it into exit status 1.
int run(int argc, char** argv) {
  Options options = parse(argc, argv);
  int devices = 0;
  cudaError_t const status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "mkv_gpu_bench: no CUDA device visible (%s); nothing measured\n",
                 status == cudaSuccess ? "0 devices" : cudaGetErrorName(status));
    return kExitNoDevice;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int driver = 0;
  int runtime = 0;
  check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
  fmt::print(
      "mkv_gpu_bench (commit {}) on {}: {} SMs, {} MiB L2, {} GiB, driver {}, runtime {}; "
      "median of {} reps after {} warm-ups\n",
      MKV_BENCH_COMMIT, prop.name, prop.multiProcessorCount, prop.l2CacheSize / kMiB,
      static_cast<int64_t>(prop.totalGlobalMem) / kGiB, driver, runtime, options.reps,
      options.warmups);
  std::vector<Row> rows;
  bool mismatch = false;
  {
    Bench bench(options);
    bench.runAll();
    rows = bench.rows();
    mismatch = bench.anyMismatch();
  }
  if (!options.csvPath.empty()) {
    writeCsv(options.csvPath, rows);
  }
  printTable(rows);
  return mismatch ? kExitMismatch : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (std::exception const& error) {  // a library or allocation error outside check()
    std::fprintf(stderr, "mkv_gpu_bench: %s\n", error.what());
    return 1;
  }
}
