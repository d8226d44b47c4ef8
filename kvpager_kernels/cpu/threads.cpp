// Where the calling thread's OpenMP team runs: each team thread sets its own
// CPU affinity (Linux affinity is per thread, and the team's thread ids are
// known only inside it; torch offers no such call).
//
// Why: a CPU executor is idle between requests, and a lone request that
// wakes it often found its two threads running no faster than one: the
// likely cause is Linux placing the woken OpenMP worker on the core of the
// thread that wakes it, the two sharing it until the load balancer moves
// one, milliseconds later. Measured on the 2-core EPYC
// (the 30M Llama in bf16, a lone 149-token prefill every 0.5 s): unbound, 9
// of 24 forwards took 16-35 ms where the rest took 10-13; bound one thread
// per core (executor_service.cpu.CoreBinding), all 24 took 10.2-13.1.
//
// The team is the one torch's own ops use: this file is built with
// -fopenmp and loads the libgomp torch already loaded (same soname).

#include <torch/library.h>

#include <omp.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <vector>

namespace {

// A team of `threads` threads (the calling thread is thread 0). With
// `spread`, thread t runs on cpus[t % len] only; without, every thread may
// run on any of `cpus`. Returns, per team thread, 0 or the errno of its
// sched_setaffinity; a team smaller than asked (the runtime's thread limit)
// leaves -1 in the slots nobody filled.
std::vector<int64_t> bind_team(int64_t threads, std::vector<int64_t> cpus, bool spread) {
  TORCH_CHECK(threads >= 1, "bind_team: threads must be >= 1, got ", threads);
  TORCH_CHECK(!cpus.empty(), "bind_team: no CPUs given");
  for (int64_t c : cpus) {
    TORCH_CHECK(c >= 0 && c < 1024, "bind_team: CPU ", c, " out of range");  // CPU_SETSIZE on glibc
  }
  std::vector<int64_t> result(threads, -1);
#if defined(__linux__)
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    if (spread) {
      CPU_SET(static_cast<int>(cpus[t % cpus.size()]), &set);
    } else {
      for (int64_t c : cpus) CPU_SET(static_cast<int>(c), &set);
    }
    if (t < threads) result[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
  }
#else  // no per-thread affinity call: every thread reports it (the executor then stays unbound)
  std::fill(result.begin(), result.end(), static_cast<int64_t>(ENOSYS));
#endif
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpager_cpu, m) { m.def("bind_team(int threads, int[] cpus, bool spread) -> int[]", &bind_team); }
