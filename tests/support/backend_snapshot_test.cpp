/// BackendSnapshot's difference report (the capture itself is exercised by the lifecycle driver
/// and the allocation fault test on every rejected call).

#include "support/backend_snapshot.h"

#include <gtest/gtest.h>

namespace mkv::test {
namespace {

TEST(BackendSnapshotTest, DifferencesNameEveryDifferingField) {
  BackendSnapshot a;
  BackendSnapshot b;
  EXPECT_EQ(differences(a, b), "");
  b.freePages = 1;
  b.tables = {3};
  b.requests = {1};
  EXPECT_FALSE(a == b);
  EXPECT_EQ(differences(a, b), "free pages, page tables, request views");
}

}  // namespace
}  // namespace mkv::test
