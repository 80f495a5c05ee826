// A kernel timeline of any CUDA program, graph replays included (the GPU machine has no Nsight
// Systems, and Nsight Compute times each kernel alone, which hides launch gaps and the overlap
// that programmatic dependent launch gives). Loaded by the CUDA driver as an injection library:
//   CUDA_INJECTION64_PATH=build/bench/libkvq_cupti_trace.so KVQ_TRACE_OUT=trace.csv kvq bench ...
// It records, through CUPTI's activity API, every kernel (start, end, graph id, the correlation
// id of the launch or the cudaGraphLaunch that ran it), every memcpy / memset, and every CUDA
// runtime call (host start and end), and writes one CSV line per record at exit:
//   kind,name,start_ns,end_ns,correlation,graph_id,stream
// kind is K (kernel), M (memcpy / memset) or R (runtime API). GPU and host timestamps come from
// the same CUPTI clock. bench/trace_summary.py reads it. Timing only: CUPTI adds ~1 us of host
// time to each runtime call; kernel durations inside a graph are not affected measurably.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;

struct Row {
  char kind;
  std::string name;
  uint64_t start, end;
  uint32_t correlation, graph, stream;
};

std::mutex g_mu;
std::vector<Row>* g_rows = nullptr;  // leaked on purpose: written from CUPTI's thread at exit

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kvq_cupti_trace: %s failed: %s\n", what, msg ? msg : "?");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Row> rows;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        rows.push_back({'K', k->name ? k->name : "?", k->start, k->end, k->correlationId,
                        k->graphId, k->streamId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        rows.push_back({'M',
                        "memcpy" + std::to_string(m->copyKind) + ":" + std::to_string(m->bytes),
                        m->start, m->end, m->correlationId, m->graphId, m->streamId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        rows.push_back({'M', "memset:" + std::to_string(m->bytes), m->start, m->end,
                        m->correlationId, m->graphId, m->streamId});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        rows.push_back({'R', name ? name : "?", a->start, a->end, a->correlationId, 0, 0});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_rows) g_rows->insert(g_rows->end(), rows.begin(), rows.end());
}

void write_out() {
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const char* path = std::getenv("KVQ_TRACE_OUT");
  std::FILE* f = std::fopen(path && *path ? path : "kvq-trace.csv", "w");
  if (!f) {
    std::fprintf(stderr, "kvq_cupti_trace: cannot write %s\n", path ? path : "kvq-trace.csv");
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "kind,name,start_ns,end_ns,correlation,graph_id,stream\n");
  for (const Row& r : *g_rows) {
    std::string name = r.name;
    for (char& c : name)
      if (c == ',' || c == '\n') c = ';';
    std::fprintf(f, "%c,%s,%llu,%llu,%u,%u,%u\n", r.kind, name.c_str(),
                 static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                 r.correlation, r.graph, r.stream);
  }
  std::fclose(f);
  std::fprintf(stderr, "kvq_cupti_trace: %zu records\n", g_rows->size());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  g_rows = new std::vector<Row>();
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
        "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  if (const char* e = std::getenv("KVQ_TRACE_RUNTIME"); !e || std::strcmp(e, "0") != 0)
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime");
  std::atexit(write_out);
  return 1;
}
