#include "kvq/core/cpu_threads.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <thread>

namespace kvq {
namespace {

// The team size a parallel region gets on the calling thread.
int team_size() {
  std::atomic<int> n{0};
#pragma omp parallel
  n.fetch_add(1);
  return n.load();
}

TEST(CpuThreads, ANewThreadAdoptsTheHandedOverCount) {
  const int before = omp_get_max_threads();
  const int wanted = before + 1;  // differs from what a new thread starts with
  omp_set_num_threads(wanted);
  EXPECT_EQ(team_size(), wanted);  // a team exists on this thread now
  const int handed = hand_over_cpu_threads();
  EXPECT_EQ(handed, wanted);
  int fresh = 0, adopted = 0, team = 0;
  std::thread worker([&] {
    fresh = omp_get_max_threads();
    adopt_cpu_threads(handed);
    adopted = omp_get_max_threads();
    team = team_size();
  });
  worker.join();
  EXPECT_NE(fresh, wanted) << "a new thread already had the count: the test shows nothing";
  EXPECT_EQ(adopted, wanted);
  EXPECT_EQ(team, wanted);
  // The released team comes back for this thread's next region.
  EXPECT_EQ(team_size(), wanted);
  omp_set_num_threads(before);
}

TEST(CpuThreads, ZeroOrNegativeLeavesTheCountAlone) {
  const int before = omp_get_max_threads();
  adopt_cpu_threads(0);
  EXPECT_EQ(omp_get_max_threads(), before);
  adopt_cpu_threads(-3);
  EXPECT_EQ(omp_get_max_threads(), before);
}

}  // namespace
}  // namespace kvq
