// The request registry both KV backends keep (src/resources/request_registry.h): ids, the live
// requests, the quarantine and poison, and the one way a request leaves (finish's release,
// abandonment, shutdown's drain). The backends' own tests pin the same paths with their pages:
// BoundedSwaFaultTest, ContextCacheCoordinatorTest.
#include "resources/request_registry.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

namespace mkv {
namespace {

struct FakeSequence {
  ResidentRef resident;
};

struct FakeRequest {
  uint64_t id = 0;
  bool pending = false;
  std::vector<FakeSequence> sequences;
  bool needsSynchronization() const noexcept { return pending; }
};

using Registry = detail::RequestRegistry<FakeRequest>;

/// What the registry asked the backend to do, and how the backend answers.
struct Backend {
  bool syncSucceeds = true;
  bool clearThrows = false;
  int32_t syncs = 0;
  int32_t clears = 0;  // requests whose rows were cleared
  std::vector<uint64_t> freed;

  auto synchronize() {
    return [this] {
      ++syncs;
      return syncSucceeds;
    };
  }
  auto clearRows() {
    return [this](Registry::Requests requests) {
      if (clearThrows) {
        throw std::runtime_error("upload failed");
      }
      clears += static_cast<int32_t>(requests.size());
    };
  }
  auto freeResources() {
    return [this](FakeRequest& request) { freed.push_back(request.id); };
  }
};

/// Publishes a request holding resident rows `slots`, with device work pending or not.
uint64_t admit(Registry& registry, std::vector<CacheSlot> const& slots, bool pending) {
  auto request = std::make_unique<FakeRequest>();
  request->id = registry.nextId();
  request->pending = pending;
  for (CacheSlot slot : slots) {
    request->sequences.push_back({ResidentRef{slot, 1}});
  }
  registry.reserveAdmission();
  return registry.publish(std::move(request));
}

/// Drains what a test left so that the registry's destructor does not terminate.
void drain(Registry& registry) {
  Backend backend;
  ASSERT_TRUE(registry.drainQuarantine("shutdown", backend.synchronize(), backend.clearRows(),
                                       backend.freeResources()));
  for (uint64_t id = 1; id < registry.nextId(); ++id) {
    registry.detach(id);
  }
}

/// A registry that drains itself before its destructor runs, so that a failing expectation ends
/// the test instead of the process.
struct DrainedRegistry : Registry {
  DrainedRegistry() : Registry("Backend") {}
  DrainedRegistry(DrainedRegistry const&) = delete;
  DrainedRegistry& operator=(DrainedRegistry const&) = delete;
  ~DrainedRegistry() { drain(*this); }
};

TEST(RequestRegistryTest, IdsFollowAdmissionOrderAndALeftRequestIsNotFoundAnyMore) {
  DrainedRegistry registry;
  EXPECT_EQ(registry.nextId(), 1u);
  EXPECT_EQ(admit(registry, {0}, false), 1u);
  EXPECT_EQ(admit(registry, {1}, false), 2u);
  ASSERT_NE(registry.find(1), nullptr);
  EXPECT_EQ(registry.find(2)->sequences.front().resident.slot, 1);
  EXPECT_EQ(registry.active().size(), 2u);
  std::unique_ptr<FakeRequest> const detached = registry.detach(1);
  ASSERT_NE(detached, nullptr);
  EXPECT_EQ(detached->id, 1u);
  EXPECT_EQ(registry.find(1), nullptr);
  EXPECT_EQ(registry.detach(1), nullptr);
  EXPECT_EQ(registry.nextId(), 3u) << "ids are never reused";
}

TEST(RequestRegistryTest, AbandoningSettledWorkReleasesWithoutSynchronising) {
  DrainedRegistry registry;
  uint64_t const id = admit(registry, {0, 1}, false);
  Backend backend;
  registry.abandon(id, backend.synchronize(), backend.clearRows(), backend.freeResources());
  EXPECT_EQ(backend.syncs, 0);
  EXPECT_EQ(backend.clears, 1);
  EXPECT_EQ(backend.freed, std::vector<uint64_t>{id});
  EXPECT_TRUE(registry.active().empty());
  EXPECT_TRUE(registry.quarantined().empty());
  EXPECT_FALSE(registry.poisoned());
}

TEST(RequestRegistryTest, AFailedAbandonmentSynchronisationQuarantinesAndShutdownDrainsIt) {
  DrainedRegistry registry;
  uint64_t const id = admit(registry, {0, 2}, true);
  uint64_t const other = admit(registry, {1}, true);
  Backend backend;
  backend.syncSucceeds = false;
  registry.abandon(id, backend.synchronize(), backend.clearRows(), backend.freeResources());
  EXPECT_EQ(backend.syncs, 1);
  EXPECT_EQ(backend.clears, 0) << "rows a kernel may still read stay mapped";
  EXPECT_TRUE(backend.freed.empty());
  EXPECT_TRUE(registry.poisoned());
  EXPECT_EQ(registry.find(id), nullptr);
  ASSERT_EQ(registry.quarantined().size(), 1u);
  EXPECT_EQ(registry.quarantinedTotal(), 1u);
  EXPECT_TRUE(registry.quarantineHolds(0));
  EXPECT_TRUE(registry.quarantineHolds(2));
  EXPECT_FALSE(registry.quarantineHolds(1)) << "held by a live request, not a quarantined one";
  ASSERT_NE(registry.find(other), nullptr) << "the other request stays live";

  // A failing drain keeps everything; a succeeding one frees the request and clears the poison.
  EXPECT_FALSE(registry.drainQuarantine("shutdown", backend.synchronize(), backend.clearRows(),
                                        backend.freeResources()));
  EXPECT_EQ(registry.quarantined().size(), 1u);
  EXPECT_TRUE(registry.poisoned());
  backend.syncSucceeds = true;
  backend.clearThrows = true;
  EXPECT_FALSE(registry.drainQuarantine("shutdown", backend.synchronize(), backend.clearRows(),
                                        backend.freeResources()));
  EXPECT_EQ(registry.quarantined().size(), 1u);
  EXPECT_TRUE(backend.freed.empty());
  backend.clearThrows = false;
  EXPECT_TRUE(registry.drainQuarantine("shutdown", backend.synchronize(), backend.clearRows(),
                                       backend.freeResources()));
  EXPECT_EQ(backend.freed, std::vector<uint64_t>{id});
  EXPECT_TRUE(registry.quarantined().empty());
  EXPECT_FALSE(registry.quarantineHolds(0));
  EXPECT_FALSE(registry.poisoned());
  EXPECT_EQ(registry.quarantinedTotal(), 1u) << "drained requests stay counted";
}

TEST(RequestRegistryTest, RowsThatCannotBeClearedQuarantineTheRequest) {
  DrainedRegistry registry;
  uint64_t const abandoned = admit(registry, {0}, true);
  uint64_t const finished = admit(registry, {1}, false);
  Backend backend;
  backend.clearThrows = true;
  registry.abandon(abandoned, backend.synchronize(), backend.clearRows(), backend.freeResources());
  EXPECT_EQ(backend.syncs, 1);
  EXPECT_EQ(registry.quarantined().size(), 1u);
  EXPECT_TRUE(registry.poisoned());
  std::unique_ptr<FakeRequest> settled = registry.detachSettled(finished, backend.synchronize());
  ASSERT_NE(settled, nullptr);
  EXPECT_EQ(backend.syncs, 1) << "nothing pending: no synchronisation";
  EXPECT_FALSE(
      registry.release(std::move(settled), "finish", backend.clearRows(), backend.freeResources()));
  EXPECT_EQ(registry.quarantined().size(), 2u);
  EXPECT_TRUE(backend.freed.empty());
  EXPECT_EQ(registry.quarantinedTotal(), 2u);
}

TEST(RequestRegistryTest, AFailedFinishSynchronisationQuarantinesInsteadOfReturningTheRequest) {
  DrainedRegistry registry;
  uint64_t const id = admit(registry, {3}, true);
  Backend backend;
  backend.syncSucceeds = false;
  EXPECT_EQ(registry.detachSettled(id, backend.synchronize()), nullptr);
  EXPECT_EQ(registry.find(id), nullptr);
  EXPECT_TRUE(registry.quarantineHolds(3));
  EXPECT_TRUE(registry.poisoned());
  EXPECT_EQ(registry.detachSettled(id, backend.synchronize()), nullptr) << "not live any more";
  EXPECT_EQ(backend.syncs, 1);
}

TEST(RequestRegistryDeathTest, DestroyingTheRegistryWithAQuarantinedRequestTerminates) {
  EXPECT_DEATH(
      {
        Registry registry("Backend");
        registry.quarantine(admit(registry, {0}, false));
      },
      "Backend destroyed with 0 active and 1 quarantined requests");
}

}  // namespace
}  // namespace mkv
