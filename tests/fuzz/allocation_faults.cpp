#include "fuzz/allocation_faults.h"

namespace mkv::fuzz {
namespace {

int32_t gDepth = 0;
int64_t gCounted = 0;
int64_t gFailAt = 0;

}  // namespace

LibraryCall::LibraryCall() noexcept { ++gDepth; }
LibraryCall::~LibraryCall() { --gDepth; }

void armAllocationFault(int64_t k) noexcept {
  gFailAt = k;
  gCounted = 0;
}

bool allocationFaultPending() noexcept { return gFailAt > 0; }

int64_t countedAllocations() noexcept { return gCounted; }

bool failThisAllocation() noexcept {
  if (gDepth == 0) {
    return false;
  }
  ++gCounted;
  if (gFailAt > 0 && gCounted == gFailAt) {
    gFailAt = 0;  // one-shot: the retry of the failed call succeeds
    return true;
  }
  return false;
}

}  // namespace mkv::fuzz
