#include "bea/core/sync_fast_path.h"

#include <algorithm>

#include "bea/core/decode_stretch.h"

namespace bea {
namespace {

// The output count at which request `r` stops (its target, max_tokens or the model length).
inline int64_t stop_at(const SchedRequest& r, const Config& cfg) {
  return std::min(std::min(r.target_out, r.max_tokens), cfg.max_model_len - r.P);
}

// A plain decode that can join the group: one token per step (C = P + O − 1), blocks matching
// its context, nothing in flight, and at least one more token to come before it stops (a request
// already at its stop finishes on its next token: it stays with the exact per-request code).
inline bool plain_decode(const SchedRequest& r, const Config& cfg, const BlockMath& blocks) {
  return !r.finished && r.O >= 1 && r.C == r.P + r.O - 1 && r.ph == 0 && r.stale == 0 &&
         r.kv.held == blocks.ceil(r.C) && stop_at(r, cfg) > r.O;
}

}  // namespace

DecodeGroupStart decode_group_start(const std::vector<SchedRequest>& reqs, size_t n_running, const Config& cfg) {
  DecodeGroupStart g;
  if (cfg.async_scheduling || cfg.block_size > 4096) return g;  // the fast path does not run
  g.valid = true;
  const BlockMath blocks(cfg.block_size);
  g.bucket.assign(static_cast<size_t>(cfg.block_size), 0);
  std::vector<std::pair<int64_t, int32_t>> unsorted;
  unsorted.reserve(n_running);
  g.lazy.reserve(n_running);
  int64_t last = 0;
  for (size_t u = 0; u < n_running; ++u) {
    const SchedRequest& r = reqs[u];
    const auto k = static_cast<int32_t>(u);
    if (!plain_decode(r, cfg, blocks)) {
      g.eager.push_back(k);
      continue;
    }
    g.lazy.push_back(k);
    g.bucket[static_cast<size_t>(blocks.residue(-r.C))] += 1;
    g.sum_c += r.C;
    const int64_t step = stop_at(r, cfg) - r.O - 1;  // >= 0: a member has a token to come
    unsorted.emplace_back(step, k);
    last = std::max(last, step);
  }
  // Sorted by (step, request). Steps are usually few thousand at most: a counting sort (stable,
  // requests already ascending); a comparison sort when they spread wider.
  const size_t n = unsorted.size();
  if (static_cast<uint64_t>(last) <= 4 * static_cast<uint64_t>(n) + 4096) {
    std::vector<uint32_t> start(static_cast<size_t>(last) + 2, 0);
    for (const auto& f : unsorted) ++start[static_cast<size_t>(f.first) + 1];
    for (size_t s = 1; s < start.size(); ++s) start[s] += start[s - 1];
    g.finishes.resize(n);
    for (const auto& f : unsorted) g.finishes[start[static_cast<size_t>(f.first)]++] = f;
  } else {
    g.finishes = std::move(unsorted);
    std::sort(g.finishes.begin(), g.finishes.end());
  }
  return g;
}

SyncFastPath::SyncFastPath(Scheduler& s) : s_(s), blocks_(s.cfg_.block_size), B_(s.cfg_.block_size) {
  bucket_.assign(static_cast<size_t>(B_), 0);
  size_tables();
  finishes_.reset(s_.reqs_.size(), D_);
  batch_.reserve(64);
  rebuild(-1);
}

SyncFastPath::SyncFastPath(Scheduler& s, const DecodeGroupStart& start)
    : s_(s), blocks_(s.cfg_.block_size), B_(s.cfg_.block_size) {
  size_tables();
  for (int32_t k : start.lazy) since_[static_cast<size_t>(k)] = 0;
  bucket_ = start.bucket;
  eager_ = start.eager;
  finishes_.reset(s_.reqs_.size(), D_, &start.finishes);
  n_lazy_ = static_cast<int64_t>(start.lazy.size());
  sum_cbase_ = start.sum_c;
  batch_.reserve(64);
}

void SyncFastPath::size_tables() {
  if (since_.size() < s_.reqs_.size()) {
    since_.resize(s_.reqs_.size(), -1);
    finishes_.grow(s_.reqs_.size());
  }
}

bool SyncFastPath::join_group(int32_t k, int32_t watch, int64_t d) {
  const auto u = static_cast<size_t>(k);
  const Scheduler::Req& r = s_.reqs_[u];
  if (k == watch || !plain_decode(r, s_.cfg_, blocks_)) return false;
  since_[u] = d;
  const int64_t cbase = r.C - d;
  bucket_[static_cast<size_t>(blocks_.residue(-cbase))] += 1;
  n_lazy_ += 1;
  sum_cbase_ += cbase;
  // Its output count reaches its stop with the token of this step.
  finishes_.push(stop_at(r, s_.cfg_) - (r.O - d) - 1, k);
  return true;
}

// The record catches up with the steps it spent in the group (one token and context each).
void SyncFastPath::materialize(int32_t k, int64_t d) {
  const auto u = static_cast<size_t>(k);
  if (since_[u] < 0) return;
  Scheduler::Req& r = s_.reqs_[u];
  const int64_t cbase = r.C - since_[u];
  bucket_[static_cast<size_t>(blocks_.residue(-cbase))] -= 1;
  n_lazy_ -= 1;
  sum_cbase_ -= cbase;
  const int64_t steps = d - since_[u];
  r.C += steps;
  r.O += steps;
  const int64_t held = blocks_.ceil(r.C);
  r.kv.exclusive += held - r.kv.held;
  r.kv.held = held;
  since_[u] = -1;
}

void SyncFastPath::finish_lazy(int32_t k) {
  // Called after step D_ was executed but before D_ advances: its token of step D_ is the last.
  materialize(k, D_ + 1);
  s_.finish(s_.reqs_[static_cast<size_t>(k)]);
}

void SyncFastPath::materialize_all() {
  s_.drop_finished_running();
  for (int32_t k : s_.running_) materialize(k, D_);
  finishes_.clear();
  eager_ = s_.running_;
}

void SyncFastPath::rebuild(int32_t watch) {
  materialize_all();
  eager_.clear();
  for (int32_t k : s_.running_) {
    if (!join_group(k, watch, D_)) eager_.push_back(k);
  }
}

int64_t SyncFastPath::demand_over(int64_t k) const {
  int64_t d = blocks_.floor(k) * n_lazy_;
  const int64_t rem = blocks_.residue(k);
  int64_t j = d_mod_;
  for (int64_t i = 0; i < rem; ++i) {
    d += bucket_[static_cast<size_t>(j)];
    if (++j == B_) j = 0;
  }
  return d;
}

SyncFastPath::Result SyncFastPath::exact_step(double& now, const Coeffs& beta, int32_t watch, bool fold,
                                              int64_t& steps) {
  const int64_t k = fold ? fold_decode_stretch(s_, now, beta, INT64_MAX / 4) : 0;
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

// Fold the next k decode-only steps (k <= fold_room()) when nothing else can happen in them.
bool SyncFastPath::try_fold(double& now, const Coeffs& beta, int64_t k, int64_t& steps) {
  if (!eager_.empty() || n_lazy_ == 0 || s_.waiting_.empty()) return false;
  if (n_lazy_ > s_.cfg_.max_num_scheduled_tokens) return false;
  if (!s_.admission_blocked(s_.cfg_.max_num_scheduled_tokens - n_lazy_)) return false;
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
  now += decode_steps_time(beta, kd, nd, static_cast<double>(sum_cbase_) + nd * Dd);
  advance_d(k);
  steps = k;
  return true;
}

SyncFastPath::Result SyncFastPath::take_step(double& now, const Coeffs& beta, int32_t watch, int64_t max_steps, bool fold,
                                             int64_t& steps) {
  if (since_.size() < s_.reqs_.size()) size_tables();
  if (cooldown_ > 0) {
    const Result r = exact_step(now, beta, watch, fold, steps);
    if (--cooldown_ == 0 && r == Result::Continue) rebuild(watch);
    return r;
  }
  if (fold && eager_.empty()) {
    const int64_t room = fold_room(max_steps);
    if (room >= 2 && try_fold(now, beta, room, steps)) return Result::Continue;
  }

  // The records this step may admit are cold (untouched since the estimate began): start loading
  // the queue's head while the step's other work runs.
  if (!s_.waiting_.empty()) {
    const auto* head = &s_.reqs_[static_cast<size_t>(s_.waiting_.front())];
    __builtin_prefetch(head);
    __builtin_prefetch(reinterpret_cast<const char*>(head) + 64);
  }

  // Phase 1 without list order: valid when every running request's demand fits.
  const Config& cfg = s_.cfg_;
  const int64_t lpt = s_.effective_lpt();
  int64_t budget = cfg.max_num_scheduled_tokens;
  int64_t want = n_lazy_;
  int64_t demand = bucket_[static_cast<size_t>(d_mod_)];
  batch_.clear();
  for (int32_t k : eager_) {
    const Scheduler::Req& r = s_.reqs_[static_cast<size_t>(k)];
    int64_t n = r.P + r.O + r.ph - r.C;
    if (lpt > 0 && lpt < n) n = lpt;
    n = std::min(n, cfg.max_model_len - r.C - 1);
    if (n <= 0) continue;
    want += n;
    const int64_t need = blocks_.ceil(std::min(r.C + n, cfg.max_model_len)) - r.kv.held;
    if (need > 0) demand += need;
    batch_.push_back({k, n, r.C, r.preemptions, false});
  }
  if (want > budget || demand > s_.kv_.free_blocks()) {  // order matters or preemption may happen
    materialize_all();
    cooldown_ = 8;
    return exact_step(now, beta, watch, fold, steps);
  }
  s_.kv_.allocate_untracked(bucket_[static_cast<size_t>(d_mod_)]);
  for (const auto& it : batch_) {
    Scheduler::Req& r = s_.reqs_[static_cast<size_t>(it.req)];
    const int64_t need = blocks_.ceil(std::min(r.C + it.n, cfg.max_model_len)) - r.kv.held;
    if (need > 0) s_.kv_.allocate(r.kv, need);
  }
  budget -= want;
  // Usually every one-by-one request got tokens: then eager_ is the batch's first items, in
  // order, and the pass over the batch below also decides who joins the group.
  const size_t n_eager_items = batch_.size();
  const bool in_order = n_eager_items == eager_.size();
  if (budget > 0 && !s_.waiting_.empty() && static_cast<int64_t>(s_.n_running()) < cfg.max_num_active_seqs)
    s_.admit_waiting(budget, lpt, batch_);
  if (batch_.empty() && n_lazy_ == 0) return Result::Unschedulable;
  if (in_order) {
    still_eager_.clear();
  } else {
    for (size_t j = n_eager_items; j < batch_.size(); ++j) eager_.push_back(batch_[j].req);
  }

  // The step's eq. 12 terms (the group first, then the items in batch order), and
  // update_from_output for the one-by-one requests: those that sample get their token. Who
  // reaches plain decoding joins the group as of the next step.
  BatchFeatures f;
  f.add_decodes(n_lazy_, sum_cbase_ + n_lazy_ * D_);
  bool watched = false;
  size_t n_finished = 0;
  for (const auto& it : batch_) {
    Scheduler::Req& r = s_.reqs_[static_cast<size_t>(it.req)];
    f.add(it.n, it.context, is_decode(it.n, it.context, r.P));
    r.C += it.n;
    if (r.C >= r.P + r.O) {  // the step reaches the end of the sequence: a token
      r.O += 1;
      if (it.req == watch) watched = true;
      if (r.O >= r.target_out || r.O >= r.max_tokens || r.P + r.O >= cfg.max_model_len) {
        s_.finish(r);
        ++n_finished;
        continue;
      }
    }
    if (!in_order) continue;
    if (!join_group(it.req, watch, D_ + 1)) still_eager_.push_back(it.req);
  }
  if (in_order) eager_.swap(still_eager_);
  now += f.time(beta);
  steps = 1;
  last_tokens_ = static_cast<int64_t>(f.tokens);
  // The group's finishes of this step (in any order: finishing requests only return blocks).
  if (finishes_.next_step() == D_)
    finishes_.pop_step(D_, [&](int32_t k) {
      finish_lazy(k);
      ++n_finished;
    });
  ++D_;
  if (++d_mod_ == B_) d_mod_ = 0;
  finishes_.advance(D_);
  // Finished requests stay in the running list (n_running() does not count them) until a
  // fallback to the exact scheduler drops them in one pass: the list only grows by admissions.
  s_.finished_in_running_ += n_finished;
  if (watched) return Result::WatchSampled;
  if (!in_order) {  // requests that just reached plain decoding join the group
    size_t w = 0;
    for (int32_t k : eager_) {
      if (s_.reqs_[static_cast<size_t>(k)].finished) continue;
      if (!join_group(k, watch, D_)) eager_[w++] = k;
    }
    eager_.resize(w);
  }
  return Result::Continue;
}

}  // namespace bea
