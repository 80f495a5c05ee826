// The CPU kernels' threads (OpenMP) when a second thread runs them. OpenMP keeps the thread
// count (`--threads`, omp_set_num_threads) and the idle team of workers per calling thread: a
// thread started later runs with the default count, and while the first thread's idle team
// lives, libgomp wakes the second thread's workers through the kernel for every parallel
// region (measured on a 2-vCPU machine: ~40 us per region instead of ~2; the CPU engine's
// decode step 2.5 ms instead of 0.5, docs/notes/cpu-decode-profile.md). libgomp falls back to
// that slow wake-up whenever the process's OpenMP workers outnumber the CPUs, so two engines
// running CPU kernels at once, or the constructing thread running them again while the engine
// runs, bring it back.
#pragma once

namespace kvq {

// On the thread that starts a worker thread which will run the CPU kernels (the serving
// engine's): releases this thread's idle OpenMP team and returns its thread count.
int hand_over_cpu_threads();

// First thing on that worker thread: adopt the count hand_over_cpu_threads() returned.
void adopt_cpu_threads(int threads);

}  // namespace kvq
