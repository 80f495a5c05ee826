#include "kvq/core/cpu_threads.h"

#include <omp.h>

namespace kvq {

int hand_over_cpu_threads() {
  const int threads = omp_get_max_threads();
  // Soft pause: the team's threads exit; the next parallel region of this thread starts a new
  // team (OpenMP 5.0). A nonzero return means the runtime keeps them: nothing else changes.
  (void)omp_pause_resource_all(omp_pause_soft);
  return threads;
}

void adopt_cpu_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

}  // namespace kvq
