#include "kvq/core/cpu_threads.h"

#include <omp.h>

namespace kvq {

int hand_over_cpu_threads() {
  const int threads = omp_get_max_threads();
  // Soft pause (OpenMP 5.0), outside any parallel region only (the standard leaves it
  // unspecified inside one). libgomp ends this thread's idle team (its next region starts a new
  // one); LLVM's libomp puts idle workers to sleep process-wide instead. A nonzero return means
  // the runtime kept them: nothing else changes.
  if (omp_get_level() == 0) (void)omp_pause_resource_all(omp_pause_soft);
  return threads;
}

void adopt_cpu_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

}  // namespace kvq
