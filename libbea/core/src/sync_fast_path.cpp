#include "bea/core/sync_fast_path.h"

#include <algorithm>
#include <functional>

namespace bea {
namespace {
inline int64_t mod(int64_t a, int64_t b) { return ((a % b) + b) % b; }
}  // namespace

SyncFastPath::SyncFastPath(Scheduler& s) : s_(s), B_(s.cfg_.block_size) {
  lz_.resize(s_.reqs_.size());
  is_lazy_.assign(s_.reqs_.size(), 0);
  bucket_.assign(static_cast<size_t>(B_), 0);
  heap_.reserve(s_.reqs_.size());
  batch_.reserve(s_.reqs_.size());
  rebuild(-1);
}

bool SyncFastPath::eligible(int32_t k, int32_t watch) const {
  if (k == watch) return false;
  const Scheduler::Req& r = s_.reqs_[static_cast<size_t>(k)];
  return !r.finished && r.O >= 1 && r.C == r.P + r.O - 1 && r.ph == 0 && r.stale == 0 &&
         r.kv.held == ceil_div(r.C, B_);
}

// Min-heap on finish step; entries of requests that left the lazy group are skipped lazily.
bool SyncFastPath::finishes_later(int32_t a, int32_t b) const {
  return lz_[static_cast<size_t>(a)].finish_d > lz_[static_cast<size_t>(b)].finish_d;
}

void SyncFastPath::heap_push(int32_t k) {
  heap_.push_back(k);
  std::push_heap(heap_.begin(), heap_.end(), [this](int32_t a, int32_t b) { return finishes_later(a, b); });
}

void SyncFastPath::heap_pop() {
  std::pop_heap(heap_.begin(), heap_.end(), [this](int32_t a, int32_t b) { return finishes_later(a, b); });
  heap_.pop_back();
}

void SyncFastPath::lazify(int32_t k, bool push) {
  const auto u = static_cast<size_t>(k);
  const Scheduler::Req& r = s_.reqs_[u];
  Lazy& l = lz_[u];
  l.cbase = r.C - D_;
  l.obase = r.O - D_;
  l.blocks0 = r.kv.held;
  l.excl0 = r.kv.exclusive;
  const int64_t stop = std::min(std::min(r.target_out, r.max_tokens), s_.cfg_.max_model_len - r.P);
  l.finish_d = stop - l.obase - 1;  // the step whose token is its last
  l.bucket = static_cast<int32_t>(mod(-l.cbase, B_));
  is_lazy_[u] = 1;
  bucket_[static_cast<size_t>(l.bucket)] += 1;
  n_lazy_ += 1;
  sum_cbase_ += l.cbase;
  if (push) heap_push(k);
}

void SyncFastPath::materialize(int32_t k) {
  const auto u = static_cast<size_t>(k);
  if (!is_lazy_[u]) return;
  Scheduler::Req& r = s_.reqs_[u];
  const Lazy& l = lz_[u];
  r.C = l.cbase + D_;
  r.O = l.obase + D_;
  r.kv.held = ceil_div(r.C, B_);
  r.kv.exclusive = l.excl0 + (r.kv.held - l.blocks0);
  is_lazy_[u] = 0;
  bucket_[static_cast<size_t>(l.bucket)] -= 1;
  n_lazy_ -= 1;
  sum_cbase_ -= l.cbase;
}

void SyncFastPath::finish_lazy(int32_t k) {
  // Called after step D_ was executed but before D_ advances: its token of step D_ is the last.
  ++D_;
  materialize(k);
  --D_;
  s_.finish(s_.reqs_[static_cast<size_t>(k)]);
}

void SyncFastPath::materialize_all() {
  for (int32_t k : s_.running_) materialize(k);
  heap_.clear();
  eager_ = s_.running_;
}

void SyncFastPath::rebuild(int32_t watch) {
  materialize_all();
  eager_.clear();
  for (int32_t k : s_.running_) {
    if (eligible(k, watch)) {
      lazify(k, false);
      heap_.push_back(k);
    } else {
      eager_.push_back(k);
    }
  }
  std::make_heap(heap_.begin(), heap_.end(), [this](int32_t a, int32_t b) { return finishes_later(a, b); });
}

int64_t SyncFastPath::demand_over(int64_t k) const {
  int64_t d = (k / B_) * n_lazy_;
  const int64_t rem = k % B_;
  for (int64_t j = 0; j < rem; ++j) d += bucket_[static_cast<size_t>(mod(D_ + j, B_))];
  return d;
}

SyncFastPath::Result SyncFastPath::exact_step(double& now, const Coeffs& beta, int32_t watch, int64_t& steps) {
  const int64_t k = s_.collapse_decode(now, beta, INT64_MAX / 4);
  if (k > 0) {
    steps = k;
    return Result::Continue;
  }
  s_.schedule(batch_);
  if (batch_.empty()) return Result::Unschedulable;
  steps = 1;
  last_tokens_ = static_cast<int64_t>(s_.last_features().tokens);
  now += s_.last_features().time(beta);
  return s_.apply(batch_, watch) ? Result::WatchSampled : Result::Continue;
}

bool SyncFastPath::try_fold(double& now, const Coeffs& beta, int64_t max_steps, int64_t& steps) {
  if (!eager_.empty() || n_lazy_ == 0 || s_.waiting_.empty()) return false;
  if (n_lazy_ > s_.cfg_.max_num_scheduled_tokens) return false;
  if (!s_.admission_blocked(s_.cfg_.max_num_scheduled_tokens - n_lazy_)) return false;
  while (!heap_.empty() && !is_lazy_[static_cast<size_t>(heap_.front())]) heap_pop();
  if (heap_.empty()) return false;
  int64_t k = std::min(lz_[static_cast<size_t>(heap_.front())].finish_d - D_, max_steps);
  if (k < 2) return false;
  const int64_t pool_free = s_.kv_.free_blocks();
  if (demand_over(k) > pool_free) {
    int64_t lo = 0, hi = k;  // demand(lo) <= free < demand(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (demand_over(mid) <= pool_free ? lo : hi) = mid;
    }
    k = lo;
    if (k < 2) return false;
  }
  s_.kv_.allocate_untracked(demand_over(k));
  const auto kd = static_cast<double>(k);
  const auto nd = static_cast<double>(n_lazy_);
  const auto Dd = static_cast<double>(D_);
  now += kd * (beta.b0 + beta.b1 * nd) +
         beta.b2 * (kd * static_cast<double>(sum_cbase_) + nd * (kd * Dd + kd * (kd - 1.0) * 0.5));
  D_ += k;
  steps = k;
  return true;
}

SyncFastPath::Result SyncFastPath::step(double& now, const Coeffs& beta, int32_t watch, int64_t max_steps, int64_t& steps) {
  if (lz_.size() < s_.reqs_.size()) {
    lz_.resize(s_.reqs_.size());
    is_lazy_.resize(s_.reqs_.size(), 0);
  }
  if (cooldown_ > 0) {
    const Result r = exact_step(now, beta, watch, steps);
    if (--cooldown_ == 0 && r == Result::Continue) rebuild(watch);
    return r;
  }
  if (try_fold(now, beta, max_steps, steps)) return Result::Continue;

  // Phase 1 without list order: valid when every running request's demand fits.
  const Config& cfg = s_.cfg_;
  const int64_t lpt = s_.effective_lpt();
  int64_t budget = cfg.max_num_scheduled_tokens;
  int64_t want = n_lazy_;
  int64_t demand = bucket_[static_cast<size_t>(mod(D_, B_))];
  batch_.clear();
  for (int32_t k : eager_) {
    const Scheduler::Req& r = s_.reqs_[static_cast<size_t>(k)];
    int64_t n = r.P + r.O + r.ph - r.C;
    if (lpt > 0 && lpt < n) n = lpt;
    n = std::min(n, cfg.max_model_len - r.C - 1);
    if (n <= 0) continue;
    want += n;
    const int64_t need = ceil_div(std::min(r.C + n, cfg.max_model_len), B_) - r.kv.held;
    if (need > 0) demand += need;
    batch_.push_back({k, n, r.C, r.preemptions, false});
  }
  if (want > budget || demand > s_.kv_.free_blocks()) {  // order matters or preemption may happen
    materialize_all();
    cooldown_ = 8;
    return exact_step(now, beta, watch, steps);
  }
  s_.kv_.allocate_untracked(bucket_[static_cast<size_t>(mod(D_, B_))]);
  for (const auto& it : batch_) {
    Scheduler::Req& r = s_.reqs_[static_cast<size_t>(it.req)];
    const int64_t need = ceil_div(std::min(r.C + it.n, cfg.max_model_len), B_) - r.kv.held;
    if (need > 0) s_.kv_.allocate(r.kv, need);
  }
  budget -= want;
  const size_t n_eager_items = batch_.size();
  s_.admit_waiting(budget, lpt, batch_);
  for (size_t j = n_eager_items; j < batch_.size(); ++j) eager_.push_back(batch_[j].req);
  if (batch_.empty() && n_lazy_ == 0) return Result::Unschedulable;

  BatchFeatures f;
  f.add_decodes(n_lazy_, sum_cbase_ + n_lazy_ * D_);
  for (auto& it : batch_) {
    Scheduler::Req& r = s_.reqs_[static_cast<size_t>(it.req)];
    f.add(it.n, it.context, is_decode(it.n, it.context, r.P));
    r.C += it.n;
    it.samples = r.C >= r.P + r.O;
  }
  now += f.time(beta);
  steps = 1;
  last_tokens_ = static_cast<int64_t>(f.tokens);

  // update_from_output: lazy finishes of this step, then the one-by-one requests.
  bool any_finished = false;
  while (!heap_.empty()) {
    const int32_t k = heap_.front();
    if (!is_lazy_[static_cast<size_t>(k)]) {
      heap_pop();
      continue;
    }
    if (lz_[static_cast<size_t>(k)].finish_d != D_) break;
    heap_pop();
    finish_lazy(k);
    any_finished = true;
  }
  ++D_;
  bool watched = false;
  for (const auto& it : batch_) {
    if (!it.samples) continue;
    Scheduler::Req& r = s_.reqs_[static_cast<size_t>(it.req)];
    r.O += 1;
    if (it.req == watch) watched = true;
    if (r.O >= r.target_out || r.O >= r.max_tokens || r.P + r.O >= cfg.max_model_len) {
      s_.finish(r);
      any_finished = true;
    }
  }
  auto gone = [this](int32_t k) { return s_.reqs_[static_cast<size_t>(k)].finished; };
  if (any_finished) s_.running_.erase(std::remove_if(s_.running_.begin(), s_.running_.end(), gone), s_.running_.end());
  if (watched) return Result::WatchSampled;
  // Requests that just reached plain decoding join the group.
  size_t w = 0;
  for (int32_t k : eager_) {
    if (gone(k)) continue;
    if (eligible(k, watch)) {
      lazify(k);
    } else {
      eager_[w++] = k;
    }
  }
  eager_.resize(w);
  return Result::Continue;
}

}  // namespace bea
