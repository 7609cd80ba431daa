#include "bea/core/scheduler.h"

#include <algorithm>
#include <stdexcept>

namespace bea {

void Scheduler::load(const std::vector<Req>& reqs, size_t n_running, int64_t free_blocks) {
  reqs_.reserve(reqs.size() + 16);  // room for the query (and dispatches ahead) without a reallocation
  reqs_.assign(reqs.begin(), reqs.end());
  running_.clear();
  waiting_.clear();
  running_.reserve(reqs.size() + 1);
  const size_t n = reqs.size();
  for (size_t k = 0; k < std::min(n_running, n); ++k) running_.push_back(static_cast<int32_t>(k));
  for (size_t k = n_running; k < n; ++k) waiting_.push_back(static_cast<int32_t>(k));
  kv_.reset(free_blocks);
  finished_in_running_ = 0;
}

int32_t Scheduler::add(const Req& r) {
  const auto k = static_cast<int32_t>(reqs_.size());
  reqs_.push_back(r);
  waiting_.add(k, [this](int32_t a, int32_t b) { return waiting_before(a, b); });
  return k;
}

void Scheduler::abort(int32_t k) {
  Req& r = req(k);
  if (r.finished) return;
  finish(r);
  running_.erase(std::remove(running_.begin(), running_.end(), k), running_.end());
  waiting_.remove(k);
}

// ------------------------------------------------------------------ queues
bool Scheduler::waiting_before(int32_t a, int32_t b) const {  // PRIORITY heap order
  const Req& x = reqs_[static_cast<size_t>(a)];
  const Req& y = reqs_[static_cast<size_t>(b)];
  if (x.prio != y.prio) return x.prio < y.prio;
  if (x.arrival != y.arrival) return x.arrival < y.arrival;
  return a < b;
}

int64_t Scheduler::adaptive_lpt() const {
  int64_t lpt = cfg_.long_prefill_token_threshold;
  const auto total = static_cast<int64_t>(n_running() + waiting_.size());
  if (total <= 1) return 0;  // nobody to starve
  if (cfg_.long_prefill_token_threshold_adaptive) lpt = std::max(lpt, cfg_.max_num_batched_tokens / total);
  return lpt;
}

void Scheduler::drop_finished_running() {
  if (finished_in_running_ == 0) return;
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [this](int32_t k) { return reqs_[static_cast<size_t>(k)].finished; }),
                 running_.end());
  finished_in_running_ = 0;
}

// A request that stops (finished or aborted) leaves the scheduler and returns its blocks.
void Scheduler::finish(Req& r) {
  r.finished = true;
  kv_.free_finished(r.kv);
  if (ledger_ != nullptr) {
    ledger_->released(static_cast<int32_t>(&r - reqs_.data()), false);
    sync_free();
  }
}

void Scheduler::preempt(int32_t v) {
  Req& r = req(v);
  if (cfg_.async_scheduling && r.ph > 0) r.stale += r.ph;
  kv_.free_preempted(r.kv, r.C, r.P + r.O);
  if (ledger_ != nullptr) {
    ledger_->released(v, true);
    sync_free();
  }
  r.C = 0;
  r.ph = 0;
  r.preemptions += 1;
  waiting_.add_preempted(v, [this](int32_t a, int32_t b) { return waiting_before(a, b); });
}

// ------------------------------------------------------------------ schedule()
namespace {
// Field-by-field into the vector's own storage: building a temporary Item and copying it made
// the compiler read back a just-written byte, a store-forwarding stall that cost half of schedule().
inline void push_item(std::vector<Scheduler::Item>& batch, int32_t req, int64_t n, int64_t context, int64_t epoch) {
  batch.emplace_back();
  Scheduler::Item& it = batch.back();
  it.req = req;
  it.n = n;
  it.context = context;
  it.epoch = epoch;
  it.samples = false;
}
}  // namespace

void Scheduler::schedule(std::vector<Item>& batch) {
  batch.clear();
  const bool async = cfg_.async_scheduling;
  const int64_t lpt = effective_lpt();
  int64_t budget = cfg_.max_num_scheduled_tokens;
  bool preempted = false;

  // Phase 1: running requests in list order.
  size_t i = 0;
  while (i < running_.size() && budget > 0) {
    const int32_t ri = running_[i];
    Req& r = req(ri);
    if (async && r.ph > 0 && r.C + 2 - r.ph >= r.P + r.max_tokens) {  // in-flight step ends it
      ++i;
      continue;
    }
    int64_t n = r.P + r.O + r.ph - r.C;
    if (lpt > 0 && lpt < n) n = lpt;
    n = std::min(n, budget);
    n = std::min(n, cfg_.max_model_len - r.C - 1);
    if (n <= 0) {
      ++i;
      continue;
    }
    bool ok = false;
    bool self = false;
    for (;;) {
      if (kv_.allocate_slots(r.kv, r.C, n)) {
        ok = true;
        break;
      }
      size_t vpos = running_.size() - 1;  // FCFS: the tail
      if (cfg_.policy == Policy::Priority) {  // first running request with max (priority, arrival)
        vpos = 0;
        for (size_t k = 1; k < running_.size(); ++k) {
          const Req& a = reqs_[static_cast<size_t>(running_[k])];
          const Req& b = reqs_[static_cast<size_t>(running_[vpos])];
          if (a.prio > b.prio || (a.prio == b.prio && a.arrival > b.arrival)) vpos = k;
        }
      }
      const int32_t vi = running_[vpos];
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(vpos));
      if (cfg_.policy == Policy::Priority) {
        for (size_t k = 0; k < batch.size(); ++k)
          if (batch[k].req == vi) {  // already granted this step: give its tokens back
            budget += batch[k].n;
            batch.erase(batch.begin() + static_cast<std::ptrdiff_t>(k));
            break;
          }
        if (vpos < i) --i;
      }
      preempt(vi);
      preempted = true;
      if (vi == ri) {
        self = true;
        break;
      }
    }
    if (!ok) {
      if (self && cfg_.policy == Policy::Priority && cfg_.priority_self_preempt_continues) continue;
      break;
    }
    if (ledger_ != nullptr) {
      ledger_->grew(ri, r.kv.held);
      ledger_->computed(ri, std::min(r.C + n, r.P + r.O));
      sync_free();
    }
    push_item(batch, ri, n, r.C, r.preemptions);
    budget -= n;
    ++i;
  }

  // Phase 2: waiting requests, only if nothing was preempted.
  if (!preempted) admit_waiting(budget, lpt, batch);

  // _update_after_schedule: computed tokens advance at schedule time.
  features_ = BatchFeatures{};
  for (auto& it : batch) {
    Req& r = req(it.req);
    features_.add(it.n, it.context, is_decode(it.n, it.context, r.P));
    r.C += it.n;
    it.samples = r.C >= r.P + r.O + r.ph;
    if (async && it.samples) r.ph += 1;
  }
}

// Phase 2 of schedule(): admit waiting requests in queue order until one does not fit.
void Scheduler::admit_waiting(int64_t& budget, int64_t lpt, std::vector<Item>& batch) {
  skipped_.clear();
  while (budget > 0 && !waiting_.empty()) {
    if (static_cast<int64_t>(n_running()) >= cfg_.max_num_active_seqs) break;
    const int32_t wi = waiting_.front();
    Req& w = req(wi);
    if (w.stale > 0) {  // async: not re-admitted before its stale output drains (skip, not block)
      skipped_.push_back(wi);
      waiting_.pop_front();
      continue;
    }
    const Admission a = plan_admission(wi, budget, lpt);
    if (!a.ok) break;
    waiting_.pop_front();
    kv_.allocate_admitted(w.kv, a.fresh, a.total);
    if (ledger_ != nullptr) {
      ledger_->admitted(wi, w.P + w.O, a.total);
      ledger_->computed(wi, std::min(a.c0 + a.n, w.P + w.O));
      sync_free();
    }
    w.C = a.c0;
    running_.push_back(wi);
    push_item(batch, wi, a.n, a.c0, w.preemptions);
    budget -= a.n;
  }
  for (auto it = skipped_.rbegin(); it != skipped_.rend(); ++it) waiting_.push_front(*it);
}

// ------------------------------------------------------------------ update_from_output()
bool Scheduler::apply(const std::vector<Item>& batch, int32_t watch, std::vector<int32_t>* finished) {
  bool any_finished = false;
  bool watched = false;
  for (const auto& it : batch) {
    if (it.req < 0) continue;
    Req& r = req(it.req);
    if (r.finished) continue;
    if (it.epoch != r.preemptions) {  // output of a batch scheduled before a preemption
      if (it.samples) {
        r.O += 1;
        if (r.stale > 0) r.stale -= 1;
      }
      continue;
    }
    if (!it.samples) continue;
    r.O += 1;
    if (cfg_.async_scheduling && r.ph > 0) r.ph -= 1;
    if (it.req == watch) watched = true;
    if (r.O >= r.target_out || r.O >= r.max_tokens || r.P + r.O >= cfg_.max_model_len) {
      finish(r);
      any_finished = true;
      if (finished != nullptr) finished->push_back(it.req);
    }
  }
  if (any_finished)
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [this](int32_t k) { return reqs_[static_cast<size_t>(k)].finished; }),
                   running_.end());
  return watched;
}

// ------------------------------------------------------------------ batch time
void Scheduler::add_features(const std::vector<Item>& batch, BatchFeatures& f) const {
  for (const auto& it : batch) f.add(it.n, it.context, is_decode(it.n, it.context, reqs_[static_cast<size_t>(it.req)].P));
}

double Scheduler::batch_time(const std::vector<Item>& batch, const Coeffs& beta) const {
  BatchFeatures f;
  add_features(batch, f);
  return f.time(beta);
}

bool Scheduler::admission_blocked(int64_t leftover) const {
  if (leftover <= 0 || waiting_.empty()) return true;
  if (static_cast<int64_t>(n_running()) >= cfg_.max_num_active_seqs) return true;
  const int32_t wi = waiting_.front();
  const Req& w = reqs_[static_cast<size_t>(wi)];
  if (w.kv.cached > 0 || w.stale > 0) return false;  // its hit may change: step normally
  return !plan_admission(wi, leftover, effective_lpt()).ok;
}

// The gates of admitting waiting request `w` with `budget` tokens left (§7.3-7.4): prefix hit,
// LPT, chunking, full-sequence gate, first-chunk allocation; watermark when others run.
Scheduler::Admission Scheduler::plan_admission(int32_t wi, int64_t budget, int64_t lpt) const {
  Admission a;
  const Req& w = reqs_[static_cast<size_t>(wi)];
  const PrefixHit hit = w.C != 0 ? PrefixHit{}
                        : ledger_ != nullptr ? ledger_->hit(wi, w.P + w.O)
                                             : kv_.computed_blocks(w.kv, w.P + w.O, w.hit);
  const int64_t k = hit.tokens, e = hit.evictable, hitb = hit.blocks;
  a.c0 = w.C == 0 ? k : w.C;
  const int64_t num_tokens = w.P + w.O;
  int64_t n = num_tokens - a.c0;
  if (lpt > 0 && lpt < n) n = lpt;
  if (n <= 0) return a;
  if (!cfg_.enable_chunked_prefill && n > budget) return a;
  a.n = std::min(n, budget);
  const int64_t wm = n_running() == 0 ? 0 : cfg_.watermark_blocks;
  const int64_t pool_free = kv_.free_blocks();
  if (cfg_.scheduler_reserve_full_isl && kv_.blocks_for(std::min(num_tokens, cfg_.max_model_len)) - hitb + e + wm > pool_free)
    return a;
  a.total = kv_.blocks_for(std::min(a.c0 + a.n, cfg_.max_model_len));
  a.fresh = std::max<int64_t>(0, a.total - hitb) + e;
  a.ok = a.fresh + wm <= pool_free;
  return a;
}

}  // namespace bea
