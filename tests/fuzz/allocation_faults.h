#pragma once
/// \file allocation_faults.h
/// Hooks for the allocation fault test (tests/fuzz/fault_injection_test.cpp). The lifecycle
/// driver marks every call into the library under test with a LibraryCall scope; a test binary
/// that replaces the global operator new asks failThisAllocation() whether the current
/// allocation must throw std::bad_alloc. Without such a replacement the hooks only count scopes.
/// Single-threaded (the driver is).

#include <cstdint>

namespace mkv::fuzz {

/// Marks a call into the library under test: heap allocations made while one is alive are
/// counted, and the armed one fails. Scopes nest.
class LibraryCall {
 public:
  LibraryCall() noexcept;
  ~LibraryCall();
  LibraryCall(LibraryCall const&) = delete;
  LibraryCall& operator=(LibraryCall const&) = delete;
};

/// The k-th counted allocation from now on throws (k >= 1); 0 disarms. Resets the count.
void armAllocationFault(int64_t k) noexcept;
/// True while a fault is armed and has not fired yet.
bool allocationFaultPending() noexcept;
/// Allocations counted inside LibraryCall scopes since the last armAllocationFault.
int64_t countedAllocations() noexcept;
/// Called by a replacement operator new for every allocation: counts it when a LibraryCall is
/// alive and returns true exactly for the armed one.
bool failThisAllocation() noexcept;

}  // namespace mkv::fuzz
