#include "kvq/engine/speculative.h"

#include <algorithm>
#include <functional>

#include "kvq/core/error.h"

namespace kvq {

namespace {

class NgramProposer final : public Proposer {
 public:
  NgramProposer(int min_n, int max_n) : min_n_(min_n), max_n_(max_n) {}
  SpecMethod method() const override { return SpecMethod::kNgram; }

  void propose(std::span<const DraftRequest> requests, std::span<Draft> out) override {
    KVQ_CHECK(out.size() == requests.size(), "NgramProposer: one draft per request");
    for (size_t r = 0; r < requests.size(); ++r) {
      out[r].tokens.clear();
      out[r].q.clear();
      const DraftRequest& q = requests[r];
      if (q.max_drafts <= 0) continue;
      const std::span<const int32_t> t = q.tokens;
      const int64_t len = static_cast<int64_t>(t.size());
      for (int n = max_n_; n >= min_n_; --n) {
        if (len < n + 1) continue;
        const auto pattern = t.subspan(static_cast<size_t>(len - n));
        // The latest earlier occurrence: recent text predicts the next tokens best.
        for (int64_t j = len - n - 1; j >= 0; --j) {
          if (!std::equal(pattern.begin(), pattern.end(), t.begin() + j)) continue;
          const int64_t from = j + n;
          const int64_t to = std::min<int64_t>(from + q.max_drafts, len);
          out[r].tokens.assign(t.begin() + from, t.begin() + to);
          break;
        }
        if (!out[r].tokens.empty()) break;
      }
    }
  }

 private:
  int min_n_, max_n_;
};

}  // namespace

std::unique_ptr<Proposer> make_ngram_proposer(int prompt_lookup_min, int prompt_lookup_max) {
  KVQ_CHECK(prompt_lookup_min >= 1 && prompt_lookup_min <= prompt_lookup_max,
            "make_ngram_proposer: bad n-gram range");
  return std::make_unique<NgramProposer>(prompt_lookup_min, prompt_lookup_max);
}

void check_drafter_vocab(const Model& target, const Model& drafter) {
  if (target.vocab_size() != drafter.vocab_size())
    throw InputError("--speculative-config: the drafter " + drafter.plan().model.dir + " has a " +
                     std::to_string(drafter.vocab_size()) + "-token vocabulary, the target " +
                     std::to_string(target.vocab_size()) +
                     "; a drafter must use the target's tokenizer");
}

Verified accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> target_ids) {
  KVQ_CHECK(target_ids.size() == drafts.size() + 1, "accept_greedy: one target id per row");
  Verified v;
  for (size_t i = 0; i < drafts.size(); ++i) {
    if (drafts[i] != target_ids[i]) break;
    v.tokens.push_back(drafts[i]);
    ++v.accepted;
  }
  v.tokens.push_back(target_ids[static_cast<size_t>(v.accepted)]);
  return v;
}

Verified accept_drafts(Sampler& sampler, std::span<const int32_t> drafts,
                       std::span<const SparseDist> q,
                       const std::function<std::span<const float>(size_t row)>& rows) {
  Verified v;
  SparseDist p;
  std::vector<double> dense_q;  // q of the current row by id (a drafter's q may be the whole vocab)
  for (size_t i = 0; i < drafts.size(); ++i) {
    const std::span<const float> row = rows(i);
    sampler.distribution(row, p);
    const int32_t x = drafts[i];
    if (p.size() == 1) {  // greedy (or a single survivor): the draft must be that token
      v.tokens.push_back(p.front().first);
      if (p.front().first != x) return v;
      ++v.accepted;
      continue;
    }
    // q as a dense row: a deterministic draft is one-hot at x.
    dense_q.assign(row.size(), 0.0);
    if (i < q.size() && !q[i].empty()) {
      for (const auto& [id, pr] : q[i])
        if (id >= 0 && static_cast<size_t>(id) < dense_q.size())
          dense_q[static_cast<size_t>(id)] = pr;
    } else if (x >= 0 && static_cast<size_t>(x) < dense_q.size()) {
      dense_q[static_cast<size_t>(x)] = 1.0;
    }
    double px = 0.0;
    for (const auto& [id, pr] : p)
      if (id == x) px = pr;
    const double qx =
        x >= 0 && static_cast<size_t>(x) < dense_q.size() ? dense_q[static_cast<size_t>(x)] : 0.0;
    // Accept with probability min(1, p(x) / q(x)); no random number is used when it is 0 or 1.
    const bool accept = px > 0.0 && (px >= qx || sampler.uniform() * qx < px);
    if (accept) {
      v.tokens.push_back(x);
      ++v.accepted;
      continue;
    }
    // Rejected: draw from the residual max(0, p - q), normalized by the draw.
    SparseDist residual;
    residual.reserve(p.size());
    for (const auto& [id, pr] : p) {
      const double rest = pr - dense_q[static_cast<size_t>(id)];
      if (rest > 0.0) residual.push_back({id, rest});
    }
    // p == q to rounding leaves no residual; p itself is then the right distribution.
    v.tokens.push_back(residual.empty() ? sampler.draw(p) : sampler.draw(residual));
    return v;
  }
  sampler.distribution(rows(drafts.size()), p);
  v.tokens.push_back(p.size() == 1 ? p.front().first : sampler.draw(p));
  return v;
}

}  // namespace kvq
