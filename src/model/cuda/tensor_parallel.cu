// The tensor-parallel group (tensor_parallel.h): NCCL communicators, one worker thread per
// rank, and the caches of every rank behind the one cache the engine sees.
#include "model/cuda/tensor_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "cache/cuda/cuda_check.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "model/cuda/peer_all_reduce.h"

#ifndef KVQ_WITH_NCCL
#define KVQ_WITH_NCCL 0
#endif
#if KVQ_WITH_NCCL
#include <nccl.h>
#endif

namespace kvq::cuda_model {

#if KVQ_WITH_NCCL
#define KVQ_NCCL_CHECK(expr)                                                              \
  do {                                                                                    \
    const ncclResult_t r_ = (expr);                                                       \
    if (r_ != ncclSuccess)                                                                \
      throw ::kvq::InternalError(std::string("NCCL: ") + #expr + ": " +                   \
                                 ncclGetErrorString(r_) + " (" + __FILE__ + ":" +         \
                                 std::to_string(__LINE__) + ")");                         \
  } while (0)
#endif

bool tensor_parallel_available() {
  return KVQ_WITH_NCCL != 0;
}

void all_reduce_sum(const TpRank& tp, float* x, size_t n, cudaStream_t stream) {
  if (!tp.active() || tp.skip_all_reduce) return;
  if (tp.peer != nullptr && tp.peer->fits(n)) {
    tp.peer->run(tp.rank, x, n, stream);
    return;
  }
#if KVQ_WITH_NCCL
  KVQ_NCCL_CHECK(ncclAllReduce(x, x, n, ncclFloat, ncclSum, static_cast<ncclComm_t>(tp.comm),
                               stream));
#else
  (void)x, (void)n, (void)stream;
  throw InternalError("all_reduce_sum: this kvq was built without NCCL");
#endif
}

bool all_reduce_rms_norm(const TpRank& tp, float* x, int T, int H, const float* w, float eps,
                         void* out, bool bf16, cudaStream_t stream) {
  // Opt-in (KVQ_TP_FUSED_NORM=1): measured slower than the all-reduce and a separate RMSNorm
  // (one block per row sends and sums the row; docs/notes/tensor-parallel.md).
  static const bool on = [] {
    const char* e = std::getenv("KVQ_TP_FUSED_NORM");
    return e != nullptr && std::string(e) == "1";
  }();
  if (!tp.active() || tp.skip_all_reduce || tp.peer == nullptr || !on) return false;
  return tp.peer->run_rms_norm(tp.rank, x, T, H, w, eps, out, bf16, stream);
}

void all_gather(const TpRank& tp, const float* send, size_t n, float* recv, cudaStream_t stream) {
  KVQ_CHECK(tp.active(), "all_gather: not a tensor-parallel rank");
#if KVQ_WITH_NCCL
  KVQ_NCCL_CHECK(
      ncclAllGather(send, recv, n, ncclFloat, static_cast<ncclComm_t>(tp.comm), stream));
#else
  (void)send, (void)n, (void)recv, (void)stream;
  throw InternalError("all_gather: this kvq was built without NCCL");
#endif
}

#if KVQ_WITH_NCCL
namespace {

// The group's communicators, destroyed (or aborted, after a failure) once no model uses them.
struct Comms {
  std::vector<ncclComm_t> comms;
  std::unique_ptr<PeerAllReduce> peer;  // nullptr: no peer access (NCCL for every size)
  std::atomic<bool> aborted{false};
  ~Comms() {
    for (ncclComm_t c : comms)
      if (c != nullptr) (void)ncclCommDestroy(c);
  }
  // Aborts every communicator (their collectives return) and the peer all-reduce's waits;
  // the handles are never used again.
  void abort() {
    if (aborted.exchange(true)) return;
    if (peer) peer->abort();
    for (ncclComm_t& c : comms)
      if (c != nullptr) (void)ncclCommAbort(c), c = nullptr;
  }
};

// One thread per rank, on the rank's device; run() hands every rank the same job and waits.
class Workers {
 public:
  explicit Workers(int n) : n_(n), errors_(static_cast<size_t>(n)) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  // Runs job(rank) on every rank's thread and waits for all of them. When a rank fails, or the
  // call outlasts `timeout`, the ranks still running are waiting in a collective for a rank
  // that will not come: after `grace` (or the timeout) on_failure() aborts the communicators
  // so their collectives return, and the first failure is rethrown here. Never a hang.
  void run(const std::function<void(int)>& job, const std::function<void()>& on_failure,
           std::chrono::seconds timeout, std::chrono::seconds grace) {
    std::lock_guard<std::mutex> call(call_mu_);  // models sharing the workers take turns
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &job;
    pending_ = n_;
    failed_ = false;
    first_failed_ = -1;
    for (auto& e : errors_) e = nullptr;
    ++generation_;
    cv_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool aborted = false;
    while (pending_ > 0) {
      if (failed_) {
        if (!done_cv_.wait_for(lock, grace, [&] { return pending_ == 0; }) && !aborted) {
          lock.unlock();
          on_failure();
          aborted = true;
          lock.lock();
        }
        continue;
      }
      if (!done_cv_.wait_until(lock, deadline, [&] { return pending_ == 0 || failed_; }) &&
          !aborted) {
        timed_out_ = true;
        lock.unlock();
        on_failure();
        aborted = true;
        lock.lock();
        done_cv_.wait(lock, [&] { return pending_ == 0; });
      }
    }
    job_ = nullptr;
    if (timed_out_) {
      timed_out_ = false;
      throw InternalError("tensor-parallel step took over " + std::to_string(timeout.count()) +
                          " s (KVQ_TP_TIMEOUT_S); the communicators were aborted and the group "
                          "is stopped");
    }
    // The first rank to fail is the cause; the others' errors (a collective aborted under
    // them) follow from it.
    if (first_failed_ >= 0) {
      const int r = first_failed_;
      try {
        std::rethrow_exception(errors_[static_cast<size_t>(r)]);
      } catch (const InputError& e) {
        throw InputError("tensor-parallel rank " + std::to_string(r) + ": " + e.what());
      } catch (const std::exception& e) {
        throw InternalError("tensor-parallel rank " + std::to_string(r) + " failed: " +
                            e.what() + " (the group is stopped)");
      }
    }
  }

 private:
  void loop(int rank) {
    uint64_t seen = 0;
    // A rank's CUDA calls go to its device (the worker keeps it current).
    const cudaError_t set = cudaSetDevice(rank);
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      std::exception_ptr err;
      try {
        if (set != cudaSuccess)
          throw InternalError(std::string("cudaSetDevice: ") + cudaGetErrorString(set));
        (*job)(rank);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      errors_[static_cast<size_t>(rank)] = err;
      if (err != nullptr && !failed_) first_failed_ = rank;
      failed_ = failed_ || err != nullptr;
      --pending_;
      done_cv_.notify_all();
    }
  }

  int n_;
  std::vector<std::thread> threads_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false, failed_ = false, timed_out_ = false;
  int first_failed_ = -1;
  std::vector<std::exception_ptr> errors_;
};

// Frees rank r's model with device r current (its streams, handles and memory are there).
void release_on_devices(std::vector<std::unique_ptr<CudaModel>>& ranks) {
  int current = 0;
  (void)cudaGetDevice(&current);
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!ranks[r]) continue;
    (void)cudaSetDevice(static_cast<int>(r));
    ranks[r].reset();
  }
  (void)cudaSetDevice(current);
}

// Every rank's cache of one create_cache() call; the engine's cache (rank 0's views) owns it.
// Freed with each rank's device current.
struct CacheGroup {
  std::vector<std::unique_ptr<PagedKvCache>> ranks;
  ~CacheGroup() {
    int current = 0;
    (void)cudaGetDevice(&current);
    for (size_t r = 0; r < ranks.size(); ++r) {
      (void)cudaSetDevice(static_cast<int>(r));
      ranks[r].reset();
    }
    (void)cudaSetDevice(current);
  }
};

class TensorParallelModel final : public CudaModel {
 public:
  TensorParallelModel(KvPlan plan, std::vector<std::unique_ptr<CudaModel>> ranks,
                      std::shared_ptr<Comms> comms, std::shared_ptr<Workers> workers)
      : plan_(std::move(plan)),
        ranks_(std::move(ranks)),
        comms_(std::move(comms)),
        workers_(std::move(workers)) {
    if (const char* e = std::getenv("KVQ_TP_TIMEOUT_S"); e != nullptr && std::atoi(e) > 0)
      timeout_ = std::chrono::seconds(std::atoi(e));
    if (const char* e = std::getenv("KVQ_TP_FAIL_RANK"); e != nullptr && *e != '\0')
      fail_rank_ = std::atoi(e);
  }
  ~TensorParallelModel() override { release_on_devices(ranks_); }

  std::unique_ptr<Model> with_plan(const KvPlan& plan,
                                   std::string_view forced_backend) const override {
    const TensorParallelSplit split = split_heads(plan.model, size());
    std::vector<std::unique_ptr<CudaModel>> ranks(ranks_.size());
    try {
      run(
          [&](int r) {
            std::unique_ptr<Model> m = ranks_[static_cast<size_t>(r)]->with_plan(
                slice_kv_plan(plan, split, r), forced_backend);
            ranks[static_cast<size_t>(r)].reset(static_cast<CudaModel*>(m.release()));
          },
          /*collective=*/false);
    } catch (...) {
      release_on_devices(ranks);
      throw;
    }
    return std::make_unique<TensorParallelModel>(plan, std::move(ranks), comms_, workers_);
  }
  const KvPlan& plan() const override { return plan_; }
  const ArchitectureConfig& arch() const override { return ranks_.front()->arch(); }
  int vocab_size() const override { return ranks_.front()->vocab_size(); }
  std::vector<const AttentionBackend*> layer_backends() const override {
    return ranks_.front()->layer_backends();
  }

  void forward(const ForwardBatch& batch, PagedKvCache& cache,
               std::span<float> logits) const override {
    step(cache, logits, [&](const CudaModel& m, PagedKvCache& c, std::span<float> out) {
      m.forward(batch, c, out);
    });
  }
  void forward_sample(const ForwardBatch& batch, PagedKvCache& cache,
                      std::span<const DeviceSampling> per_row,
                      std::span<int32_t> next_tokens) const override {
    step(cache, next_tokens, [&](const CudaModel& m, PagedKvCache& c, std::span<int32_t> out) {
      m.forward_sample(batch, c, per_row, out);
    });
  }

  Device device() const override { return Device::kCuda; }
  std::unique_ptr<PagedKvCache> create_cache(int32_t num_blocks) const override {
    auto group = std::make_shared<CacheGroup>();
    group->ranks.resize(ranks_.size());
    run(
        [&](int r) {
          group->ranks[static_cast<size_t>(r)] =
              ranks_[static_cast<size_t>(r)]->create_cache(num_blocks);
        },
        /*collective=*/false);
    PagedKvCache& first = *group->ranks.front();
    std::vector<LayerCacheView> views;
    for (size_t l = 0; l < first.num_layers(); ++l) views.push_back(first.layer_view(l));
    auto cache = std::make_unique<PagedKvCache>(PagedKvCache::with_external_storage(
        ranks_.front()->plan().layers, num_blocks, std::move(views), group));
    // Keyed by rank 0's storage, not the PagedKvCache object: the engine moves the object.
    std::lock_guard<std::mutex> lock(caches_mu_);
    for (auto it = caches_.begin(); it != caches_.end();)
      it = it->second.expired() ? caches_.erase(it) : std::next(it);
    caches_[storage_key(*cache)] = group;
    return cache;
  }
  // Each rank asks its own device (the worker keeps it current).
  int64_t max_cache_blocks() const override {
    std::vector<int64_t> per(ranks_.size());
    run([&](int r) { per[static_cast<size_t>(r)] = ranks_[static_cast<size_t>(r)]->max_cache_blocks(); },
        /*collective=*/false);
    int64_t most = -1;
    for (int64_t m : per) most = most < 0 ? m : std::min(most, m);
    return most;
  }
  const CudaModelOptions& options() const override { return ranks_.front()->options(); }
  WeightPrecision weight_precision() const override { return ranks_.front()->weight_precision(); }
  // Rank 0's device (every rank holds the same share), asked on its worker.
  CudaMemoryReport memory() const override {
    CudaMemoryReport m;
    run([&](int r) { if (r == 0) m = ranks_.front()->memory(); }, /*collective=*/false);
    return m;
  }
  void copy_blocks(PagedKvCache& cache,
                   std::span<const std::pair<int32_t, int32_t>> src_dst) const override {
    const std::vector<PagedKvCache*> caches = rank_caches(cache);
    run(
        [&](int r) {
          ranks_[static_cast<size_t>(r)]->copy_blocks(*caches[static_cast<size_t>(r)], src_dst);
        },
        /*collective=*/false);
  }

 private:
  int size() const { return static_cast<int>(ranks_.size()); }
  // One step on every rank with its cache: every rank computes the same outputs (the residual
  // stream is all-reduced); rank 0 writes `out`, the others scratch of the same size.
  template <typename T, typename F>
  void step(PagedKvCache& cache, std::span<T> out, const F& call) const {
    const std::vector<PagedKvCache*> caches = rank_caches(cache);
    std::vector<std::vector<T>> scratch(ranks_.size());
    run([&](int r) {
      const auto i = static_cast<size_t>(r);
      std::span<T> mine = out;
      if (r != 0) {
        scratch[i].resize(out.size());
        mine = scratch[i];
      }
      maybe_fail(r);
      call(*ranks_[i], *caches[i], mine);
    });
  }
  // Runs job on every rank. `collective`: the job runs NCCL collectives, so a rank that fails
  // leaves the others waiting in one and the communicators are aborted; other jobs (cache,
  // plan and memory calls) just report the failure.
  void run(const std::function<void(int)>& job, bool collective = true) const {
    // Calls from several threads (the server) take turns: a step is one collective sequence.
    std::lock_guard<std::mutex> lock(run_mu_);
    if (comms_->aborted)
      throw InternalError(
          "the tensor-parallel group was stopped (a rank failed or a step timed out); load the "
          "model again");
    if (collective)
      workers_->run(job, [this] { comms_->abort(); }, timeout_, std::chrono::seconds(5));
    else
      workers_->run(job, [] {}, std::chrono::seconds(3600), std::chrono::seconds(3600));
  }
  // The key of a cache made by create_cache(): rank 0's first K block (moves keep it).
  static const std::byte* storage_key(PagedKvCache& cache) { return cache.layer_view(0).k_base; }
  // Rank r's cache behind `cache` (made by create_cache()).
  std::vector<PagedKvCache*> rank_caches(PagedKvCache& cache) const {
    std::shared_ptr<CacheGroup> group;
    if (cache.external_storage() && cache.num_layers() > 0) {
      std::lock_guard<std::mutex> lock(caches_mu_);
      const auto it = caches_.find(storage_key(cache));
      if (it != caches_.end()) group = it->second.lock();
    }
    KVQ_CHECK(group != nullptr,
              "tensor-parallel forward: the cache was not made by this model's create_cache()");
    std::vector<PagedKvCache*> out;
    out.push_back(&cache);  // rank 0's views, the engine's bookkeeping
    for (size_t r = 1; r < group->ranks.size(); ++r) out.push_back(group->ranks[r].get());
    return out;
  }

  // Fault injection for the group's failure test: KVQ_TP_FAIL_RANK=r makes rank r throw
  // instead of running its forward pass (the others then wait in their first collective).
  void maybe_fail(int rank) const {
    if (rank == fail_rank_)
      throw InternalError("injected failure (KVQ_TP_FAIL_RANK=" + std::to_string(rank) + ")");
  }

  KvPlan plan_;  // the whole model's plan (each rank runs its slice)
  std::chrono::seconds timeout_{300};  // KVQ_TP_TIMEOUT_S: a step longer than this is a hang
  int fail_rank_ = -1;
  std::vector<std::unique_ptr<CudaModel>> ranks_;
  std::shared_ptr<Comms> comms_;
  std::shared_ptr<Workers> workers_;
  mutable std::mutex run_mu_, caches_mu_;
  mutable std::map<const std::byte*, std::weak_ptr<CacheGroup>> caches_;
};

}  // namespace
#endif

std::unique_ptr<CudaModel> make_tensor_parallel_model(const KvPlan& plan,
                                                      const CudaModelOptions& options,
                                                      const RankLoader& load) {
  const int n = options.tensor_parallel_size;
  const TensorParallelSplit split = split_heads(plan.model, n);
#if KVQ_WITH_NCCL
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < n)
    throw InputError("--tensor-parallel-size " + std::to_string(n) + ": this process sees " +
                     std::to_string(devices) + " CUDA device(s); accepted: 1 to " +
                     std::to_string(std::max(devices, 1)));
  auto comms = std::make_shared<Comms>();
  comms->comms.resize(static_cast<size_t>(n));
  std::vector<int> devs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) devs[static_cast<size_t>(r)] = r;
  KVQ_NCCL_CHECK(ncclCommInitAll(comms->comms.data(), n, devs.data()));
  // Decode messages (batch x hidden floats) up to 2 MB go through peer memory.
  comms->peer = PeerAllReduce::create(n, size_t{1} << 19);
  auto workers = std::make_shared<Workers>(n);
  std::vector<std::unique_ptr<CudaModel>> ranks(static_cast<size_t>(n));
  // Loaded one rank at a time on its own thread (device), so host memory holds one copy of
  // each tensor at a time.
  try {
    for (int r = 0; r < n; ++r) {
      std::function<void(int)> job = [&](int rank) {
        if (rank != r) return;
        TpRank tp;
        tp.rank = r;
        tp.size = n;
        tp.split = split;
        tp.comm = comms->comms[static_cast<size_t>(r)];
        tp.peer = comms->peer.get();
        if (const char* e = std::getenv("KVQ_TP_ALLREDUCE");
            e != nullptr && std::string(e) == "off")
          tp.skip_all_reduce = true;
        ranks[static_cast<size_t>(r)] = load(tp);
      };
      workers->run(job, [] {}, std::chrono::seconds(3600), std::chrono::seconds(3600));
    }
  } catch (...) {
    release_on_devices(ranks);  // the ranks loaded before the one that failed
    throw;
  }
  return std::make_unique<TensorParallelModel>(plan, std::move(ranks), std::move(comms),
                                               std::move(workers));
#else
  (void)load;
  (void)split;
  throw InputError("--tensor-parallel-size " + std::to_string(n) +
                   ": this kvq was built without NCCL; accepted: 1");
#endif
}

}  // namespace kvq::cuda_model
