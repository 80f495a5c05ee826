// Requests past what the CUDA model was sized for at load are refused with InputError (a
// caller's mistake, not an internal failure). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kvq/cache/device_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/model/cuda_model.h"
#include "kvq/plan/kv_plan.h"
#include "support/source_dir.h"

namespace kvq::test {
namespace {

const std::string kTiny = ::kvq::test::source_dir() + "/models/kvq-code-tiny";

TEST(CudaModelLimits, SequenceLongerThanTheContextIsAnInputError) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!std::filesystem::exists(kTiny + "/model.safetensors")) GTEST_SKIP() << kTiny << " absent";
  const KvPlan plan = make_kv_plan(load_model_config(kTiny), KvPlanOptions{});
  CudaModelOptions o;
  o.max_num_seqs = 4;
  o.max_num_batched_tokens = 256;
  const std::unique_ptr<CudaModel> model = CudaModel::load(plan, o);
  const int32_t context = plan.model.max_position_embeddings;
  ASSERT_GT(context, 0);
  const int32_t bt = plan.layers.front().block_tokens;
  const std::unique_ptr<PagedKvCache> cache = model->create_cache(context / bt + 2);
  cache->add_sequence(1);
  const std::vector<int64_t> all = cache->append(1, context + 1);
  ASSERT_EQ(all.size(), static_cast<size_t>(context) + 1);
  const std::vector<int32_t> tokens{1}, positions{context}, q_indptr{0, 1}, rows{0};
  const std::vector<int64_t> slots{all.back()};
  PagedKvCache::BlockTableStorage storage;
  const SequenceId ids[1] = {1};
  const BlockTableView table = cache->block_table(ids, storage);
  std::vector<float> logits(static_cast<size_t>(model->vocab_size()));
  try {
    model->forward(ForwardBatch{tokens, positions, q_indptr, slots, table, rows}, *cache, logits);
    FAIL() << "a sequence of " << context + 1 << " tokens ran on a model sized for " << context;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(context)), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvq::test
