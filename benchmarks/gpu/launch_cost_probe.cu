/// mkv_launch_probe: what it costs the engine thread to put a few int32 writes on a stream, by
/// mechanism (kernel launches by parameter size, cudaMemcpyAsync from pinned memory, stream
/// memory operations, a graph launch). Host microseconds per call, the median of 21 batches of
/// 200 calls, the stream drained before each batch so the launch queue never fills. It answers
/// which floor the page-table and KV-length writes of a request stand on (docs/benchmarks.md,
/// "The engine loop on the GPU"). Prints one line per mechanism; exit status 0, or 1 when CUDA
/// reports an error or the driver refuses a mechanism.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kCallsPerBatch = 200;
constexpr int kBatches = 21;

/// A kernel whose parameters carry `N` int32 values, as the inline patch kernel's do.
template <int N>
struct Values {
  int32_t* dst;
  int32_t count;
  int32_t values[N];
};

template <int N>
__global__ void writeValues(Values<N> const params) {
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < params.count; i += blockDim.x) {
    params.dst[i] = params.values[i];
  }
}

__global__ void emptyKernel() {}

/// Median host microseconds of one `call` on `stream`.
template <typename Call>
double hostMicroseconds(cudaStream_t stream, Call&& call) {
  std::vector<double> batches;
  for (int batch = 0; batch < kBatches; ++batch) {
    (void)cudaStreamSynchronize(stream);
    auto const start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCallsPerBatch; ++i) {
      call();
    }
    auto const end = std::chrono::steady_clock::now();
    batches.push_back(std::chrono::duration<double, std::micro>(end - start).count() /
                      kCallsPerBatch);
  }
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}

void report(char const* mechanism, double microseconds) {
  std::printf("%-48s %8.2f us\n", mechanism, microseconds);
}

/// Driver-API failures, which cudaGetLastError does not see: a mechanism the driver refuses is
/// reported and makes the probe fail instead of timing the refusal.
bool gDriverFailed = false;
bool driverAccepts(CUresult result, char const* mechanism) {
  if (result != CUDA_SUCCESS) {
    char const* name = nullptr;
    (void)cuGetErrorName(result, &name);
    std::printf("%-48s refused: %s\n", mechanism, name != nullptr ? name : "unknown error");
    gDriverFailed = true;
  }
  return result == CUDA_SUCCESS;
}

template <int N>
void probeKernel(cudaStream_t stream, int32_t* device, char const* label) {
  Values<N> params{};
  params.dst = device;
  params.count = N;
  report(label, hostMicroseconds(stream, [&] { writeValues<N><<<1, 256, 0, stream>>>(params); }));
}

void probeBatchMemOps(cudaStream_t stream, int32_t* device, int writes) {
  std::vector<CUstreamBatchMemOpParams> ops(static_cast<std::size_t>(writes));
  for (int i = 0; i < writes; ++i) {
    ops[i] = {};
    ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    ops[i].writeValue.address = reinterpret_cast<CUdeviceptr>(device + 3 * i);
    ops[i].writeValue.value = static_cast<cuuint32_t>(i);
  }
  char label[64];
  std::snprintf(label, sizeof(label), "cuStreamBatchMemOp, %d writes", writes);
  if (!driverAccepts(cuStreamBatchMemOp(stream, static_cast<unsigned>(writes), ops.data(), 0),
                     label)) {
    return;
  }
  report(label, hostMicroseconds(stream, [&] {
           (void)cuStreamBatchMemOp(stream, static_cast<unsigned>(writes), ops.data(), 0);
         }));
}

}  // namespace

int main() {
  int driver = 0;
  (void)cudaDriverGetVersion(&driver);
  cudaStream_t stream = nullptr;
  int32_t* device = nullptr;
  int32_t* pinned = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc(&device, 1 << 20) != cudaSuccess ||
      cudaMallocHost(&pinned, 1 << 16) != cudaSuccess) {
    std::fprintf(stderr, "mkv_launch_probe: no CUDA device\n");
    return 1;
  }
  std::printf("CUDA driver %d; host microseconds per call (median of %d x %d calls)\n", driver,
              kBatches, kCallsPerBatch);
  report("kernel launch, no parameters",
         hostMicroseconds(stream, [&] { emptyKernel<<<1, 32, 0, stream>>>(); }));
  probeKernel<1>(stream, device, "kernel launch, 16 B of parameters");
  probeKernel<64>(stream, device, "kernel launch, 272 B of parameters");
  probeKernel<1000>(stream, device, "kernel launch, 4 KiB of parameters");
  for (int bytes : {16, 256, 4096}) {
    char label[64];
    std::snprintf(label, sizeof(label), "cudaMemcpyAsync pinned -> device, %d B", bytes);
    report(label, hostMicroseconds(stream, [&] {
             (void)cudaMemcpyAsync(device, pinned, static_cast<std::size_t>(bytes),
                                   cudaMemcpyHostToDevice, stream);
           }));
  }
  if (driverAccepts(cuStreamWriteValue32(stream, reinterpret_cast<CUdeviceptr>(device), 7, 0),
                    "cuStreamWriteValue32")) {
    report("cuStreamWriteValue32", hostMicroseconds(stream, [&] {
             (void)cuStreamWriteValue32(stream, reinterpret_cast<CUdeviceptr>(device), 7, 0);
           }));
  }
  for (int writes : {8, 32, 128}) {
    probeBatchMemOps(stream, device, writes);
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graphExec = nullptr;
  (void)cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  emptyKernel<<<1, 32, 0, stream>>>();
  (void)cudaStreamEndCapture(stream, &graph);
  (void)cudaGraphInstantiate(&graphExec, graph, 0);
  report("cudaGraphLaunch, one kernel node",
         hostMicroseconds(stream, [&] { (void)cudaGraphLaunch(graphExec, stream); }));
  cudaError_t const status = cudaStreamSynchronize(stream);
  std::printf("CUDA status: %s\n", cudaGetErrorString(status));
  return status == cudaSuccess && cudaGetLastError() == cudaSuccess && !gDriverFailed ? 0 : 1;
}
