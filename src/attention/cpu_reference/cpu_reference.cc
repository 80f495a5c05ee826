// cpu_reference: the attention oracle. Scalar, float64 softmax and accumulation, every
// dtype pair, every shape. Written to be obviously right, not fast: each (sequence,
// kv head) decodes its K/V rows once with the reference codecs, then every query of
// the group runs a textbook two-pass softmax over the positions its mask allows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/backends.h"
#include "kvq/quant/codec.h"

namespace kvq {

namespace {

std::vector<std::pair<KvDtype, KvDtype>> every_concrete_pair() {
  std::vector<std::pair<KvDtype, KvDtype>> pairs;
  for (const auto& k : kKvDtypeTraits)
    for (const auto& v : kKvDtypeTraits)
      if (k.concrete && v.concrete && k.valid_as_k && v.valid_as_v)
        pairs.push_back({k.dtype, v.dtype});
  return pairs;
}

// Rows [0, kv_len) of one side of one kv head of one sequence, decoded to float
// (in the rotated space for rotated dtypes), widened to double.
std::vector<double> decode_rows(const LayerKvSpec& spec, const AttentionArgs& args, KvSide side,
                                int seq, int kv_head) {
  const BlockTableView& bt = args.block_table;
  const KvSideLayout& layout = args.cache.layout(side);
  const KvDtype dtype = spec.dtype(side);
  const int dim = spec.head_dim(side);
  const float tensor_scale = spec.scale(side).for_head(kv_head);
  const int kv_len = bt.seq_lens[seq];
  std::vector<double> rows(static_cast<size_t>(kv_len) * dim);
  std::vector<float> row(dim);
  for (int t = 0; t < kv_len; ++t) {
    const int32_t block = bt.indices[bt.indptr[seq] + t / bt.block_tokens];
    const int in_block = t % bt.block_tokens;
    const std::byte* base = args.cache.block(side, block);
    quant::decode_row(dtype, base + layout.value_offset(kv_head, in_block),
                      base + layout.scale_offset(kv_head, in_block), tensor_scale, row);
    std::copy(row.begin(), row.end(), rows.begin() + static_cast<ptrdiff_t>(t) * dim);
  }
  return rows;
}

class CpuReferenceBackend final : public AttentionBackend {
 public:
  CpuReferenceBackend() {
    caps_.device = Device::kCpu;
    caps_.priority = 0;
    caps_.kv_dtype_pairs = every_concrete_pair();
    caps_.attention_kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                             AttentionKind::kNonCausal};
    caps_.logit_soft_cap = true;
  }
  std::string_view name() const override { return "cpu_reference"; }
  const AttentionCapabilities& capabilities() const override { return caps_; }

 protected:
  void run_impl(const LayerKvSpec& spec, const AttentionArgs& args) const override {
    const int dk = spec.head_dim_k, dv = spec.head_dim_v;
    const int ratio = spec.gqa_ratio();
    const bool k_rotated = traits(spec.k_dtype).rotated;
    const bool v_rotated = traits(spec.v_dtype).rotated;
    const BlockTableView& bt = args.block_table;

    for (int seq = 0; seq < bt.num_seqs; ++seq) {
      const int kv_len = bt.seq_lens[seq];
      const int q_begin = args.q_indptr[seq];
      const int q_len = args.q_indptr[seq + 1] - q_begin;
      if (q_len == 0) continue;
      for (int g = 0; g < spec.num_kv_heads; ++g) {
        const std::vector<double> k = decode_rows(spec, args, KvSide::kK, seq, g);
        const std::vector<double> v = decode_rows(spec, args, KvSide::kV, seq, g);
        for (int j = 0; j < q_len; ++j) {
          // Visible kv positions [lo, hi) for the query at position p (see AttentionArgs).
          const int p = kv_len - q_len + j;
          int lo = 0, hi = p + 1;
          if (spec.attention == AttentionKind::kSlidingWindow)
            lo = std::max(0, p - spec.sliding_window + 1);
          if (spec.attention == AttentionKind::kNonCausal) hi = kv_len;

          for (int h = g * ratio; h < (g + 1) * ratio; ++h) {
            const size_t q_row = static_cast<size_t>(q_begin + j) * spec.num_q_heads + h;
            std::vector<float> q(args.q + q_row * dk, args.q + (q_row + 1) * dk);
            if (k_rotated) quant::hadamard_rotate(q);  // K rows are stored rotated

            std::vector<double> logits(static_cast<size_t>(hi - lo));
            double max_logit = -std::numeric_limits<double>::infinity();
            for (int t = lo; t < hi; ++t) {
              double dot = 0.0;
              for (int d = 0; d < dk; ++d) dot += static_cast<double>(q[d]) * k[size_t(t) * dk + d];
              double x = dot * args.softmax_scale;
              if (args.logit_soft_cap != 0.0f)
                x = args.logit_soft_cap * std::tanh(x / args.logit_soft_cap);
              logits[t - lo] = x;
              max_logit = std::max(max_logit, x);
            }
            double denom = 0.0;
            for (double& x : logits) {
              x = std::exp(x - max_logit);
              denom += x;
            }
            std::vector<double> acc(dv, 0.0);
            for (int t = lo; t < hi; ++t)
              for (int d = 0; d < dv; ++d) acc[d] += logits[t - lo] * v[size_t(t) * dv + d];

            std::vector<float> o(dv);
            for (int d = 0; d < dv; ++d) o[d] = static_cast<float>(acc[d] / denom);
            if (v_rotated) quant::hadamard_unrotate(o);  // back to model space
            std::copy(o.begin(), o.end(), args.out + q_row * dv);
          }
        }
      }
    }
  }

 private:
  AttentionCapabilities caps_;
};

}  // namespace

const AttentionBackend& cpu_reference_backend() {
  static const CpuReferenceBackend backend;
  return backend;
}

}  // namespace kvq
