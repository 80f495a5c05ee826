#include "kvq/core/cpu_threads.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <filesystem>
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

// Threads of this process (Linux), -1 where /proc is not there.
int process_threads() {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return ec ? -1 : n;
}

#if defined(__GNUC__) && !defined(__clang__)
// libgomp (GCC's runtime) ends the handing thread's idle team: its workers exit.
TEST(CpuThreads, HandingOverReleasesTheIdleTeam) {
  if (process_threads() < 0) GTEST_SKIP() << "no /proc/self/task";
  const int before = omp_get_max_threads();
  omp_set_num_threads(4);
  ASSERT_EQ(team_size(), 4);
  const int with_team = process_threads();
  (void)hand_over_cpu_threads();
  // Exiting threads leave /proc/self/task shortly after they return.
  int after = process_threads();
  for (int i = 0; i < 200 && after > with_team - 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    after = process_threads();
  }
  EXPECT_EQ(after, with_team - 3) << "the 3 idle workers of the team should have exited";
  omp_set_num_threads(before);
}
#endif

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
