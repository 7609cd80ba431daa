#include "bea/replay.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <stdexcept>

namespace bea {
namespace {

inline int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }

int64_t target_output(const Request& r, const ReplayOptions& opt) {
  int64_t pred = r.predicted_output >= 0 ? r.predicted_output
                 : opt.default_output_tokens >= 0 ? opt.default_output_tokens
                                                  : r.max_tokens;
  pred = std::clamp<int64_t>(pred, 1, r.max_tokens);
  if (r.output_tokens < pred) return pred;
  // Already past its prediction: the documented residual rule.
  const double frac = std::isfinite(opt.overrun_fraction) ? std::max(0.0, opt.overrun_fraction) : 0.0;
  const double extra = std::ceil(frac * static_cast<double>(pred));
  const int64_t add = extra >= 1.0 ? static_cast<int64_t>(std::min(extra, 1.0e12)) : 1;
  const int64_t t = std::min(r.max_tokens, r.output_tokens + add);
  return t > r.output_tokens ? t : r.output_tokens + 1;
}

// Working state of one replay. Mirrors vLLM's Scheduler + KVCacheManager for one KV group.
class Replay {
 public:
  struct W : Prepared::Req {
    int64_t stale = 0;          // async: outputs of a pre-preemption batch still in flight
    int64_t cached_blocks = 0;  // prefix-cache model for requests preempted during the replay
    int64_t cache_ahead = 0;
    int64_t cache_mark = 0;
    bool finished = false;
    bool is_query = false;
  };
  struct Item {
    int32_t req;
    int64_t n, context;
    int64_t epoch;  // request's preemption count when scheduled (stale detection)
    bool samples;
  };

  Replay(const Prepared& p, const Query& q, const ReplayOptions& opt) : cfg_(p.cfg), opt_(opt) {
    free_ = p.free_blocks;
    reqs_.reserve(p.reqs.size() + 1);
    for (const auto& r : p.reqs) {
      W w;
      static_cast<Prepared::Req&>(w) = r;
      reqs_.push_back(w);
    }
    running_.reserve(p.reqs.size() + 1);
    for (size_t k = 0; k < p.n_running; ++k) running_.push_back(static_cast<int32_t>(k));
    for (size_t k = p.n_running; k < p.reqs.size(); ++k) waiting_.push_back(static_cast<int32_t>(k));
    // The query: behind every resident (FCFS), or by (priority, arrival) under PRIORITY.
    W w{};
    w.P = q.prompt_tokens;
    w.max_tokens = q.max_tokens;
    w.target_out = q.max_tokens;
    w.hit = q.prefix_hit_tokens;
    w.prio = q.priority;
    w.arrival = q.arrival > 0.0 ? q.arrival : p.time;
    w.is_query = true;
    query_ = static_cast<int32_t>(reqs_.size());
    reqs_.push_back(w);
    enqueue_back(query_);
    if (cfg_.policy == Policy::Priority) sort_waiting();
    if (p.has_inflight) {
      inflight_.clear();
      for (const auto& it : p.inflight) inflight_.push_back({it.req, it.n, it.context, reqs_[it.req].preemptions, it.samples});
      orphans_ = p.inflight_orphans;
      has_inflight_ = true;
      inflight_end_ = std::max(0.0, p.inflight_start + time_of(inflight_, &orphans_));
    }
    trace_ = opt.trace;
  }

  Estimate run() {
    Estimate est;
    if (reqs_[query_].P > cfg_.max_model_len) throw std::invalid_argument("request.prompt_tokens exceeds max_model_len");
    double now = 0.0;
    std::vector<Item> batch;
    batch.reserve(reqs_.size());
    const bool async = cfg_.async_scheduling;
    while (est.n_batches < opt_.max_steps) {
      if (!async && opt_.collapse && !trace_) {
        const int64_t k = collapse(now);
        if (k > 0) {
          est.n_batches += k;
          continue;
        }
      }
      schedule(batch);
      if (async) {
        const bool had_inflight = has_inflight_;
        if (had_inflight) {
          now = std::max(now, inflight_end_);
          if (apply(inflight_)) {
            est.ttft_s = now;
            return est;
          }
          has_inflight_ = false;
          orphans_.clear();
        }
        if (batch.empty()) {
          if (had_inflight) continue;  // the update may have freed room: schedule again
          return unschedulable(est);
        }
        ++est.n_batches;
        record(est, batch);
        inflight_.swap(batch);
        has_inflight_ = true;
        inflight_end_ = now + time_of(inflight_, nullptr);
      } else {
        if (batch.empty()) return unschedulable(est);
        ++est.n_batches;
        record(est, batch);
        now += time_of(batch, nullptr);
        if (apply(batch)) {
          est.ttft_s = now;
          return est;
        }
      }
    }
    est.status = Status::StepLimit;
    est.ttft_s = std::numeric_limits<double>::infinity();
    return est;
  }

 private:
  // ---------------------------------------------------------------- queues
  bool waiting_before(int32_t a, int32_t b) const {  // PRIORITY heap order
    const W& x = reqs_[a];
    const W& y = reqs_[b];
    if (x.prio != y.prio) return x.prio < y.prio;
    if (x.arrival != y.arrival) return x.arrival < y.arrival;
    return a < b;
  }
  void sort_waiting() {
    std::stable_sort(waiting_.begin(), waiting_.end(), [this](int32_t a, int32_t b) { return waiting_before(a, b); });
  }
  void enqueue_back(int32_t r) { waiting_.push_back(r); }
  void enqueue_preempted(int32_t r) {
    if (cfg_.policy == Policy::Fcfs) {
      waiting_.push_front(r);
    } else {
      auto pos = std::lower_bound(waiting_.begin(), waiting_.end(), r,
                                  [this](int32_t a, int32_t b) { return waiting_before(a, b); });
      waiting_.insert(pos, r);
    }
  }

  int64_t effective_lpt() const {
    int64_t lpt = cfg_.long_prefill_token_threshold;
    if (lpt <= 0) return 0;
    const int64_t total = static_cast<int64_t>(running_.size() + waiting_.size());
    if (total <= 1) return 0;  // nobody to starve
    if (cfg_.long_prefill_token_threshold_adaptive) lpt = std::max(lpt, cfg_.max_num_batched_tokens / total);
    return lpt;
  }

  // ---------------------------------------------------------------- KV accounting
  bool alloc_running(W& r, int64_t n) {
    const int64_t slots = std::min(r.C + n, cfg_.max_model_len);
    const int64_t need = ceil_div(slots, cfg_.block_size) - r.blocks;
    if (need <= 0) return true;
    if (need > free_) return false;
    take(r, need);
    return true;
  }
  void take(W& r, int64_t k) {
    free_ -= k;
    r.blocks += k;
    r.excl += k;
    alloc_total_ += k;
  }
  void release(W& r) {
    if (cfg_.enable_prefix_caching) {
      // Hashed (full, final-token) blocks stay cached at the back of the free queue; blocks taken
      // from the front afterwards evict them tail first (vllm-scheduler-replay.md §7.6).
      r.cached_blocks = std::min(r.blocks, std::min(r.C, r.P + r.O) / cfg_.block_size);
      r.cache_ahead = free_;
      r.cache_mark = alloc_total_;
    }
    free_ += r.excl;
    r.blocks = 0;
    r.excl = 0;
  }

  // Prefix-hit tokens and evictable hit blocks of a waiting request with C == 0.
  void prefix_hit(const W& w, int64_t& k, int64_t& evictable) const {
    k = 0;
    evictable = 0;
    if (!cfg_.enable_prefix_caching) return;
    const int64_t B = cfg_.block_size;
    const int64_t cap_blocks = (w.P + w.O - 1) / B;
    if (w.cached_blocks > 0) {  // preempted during the replay: its own freed blocks
      const int64_t evicted = std::max<int64_t>(0, (alloc_total_ - w.cache_mark) - w.cache_ahead);
      const int64_t left = std::max<int64_t>(0, w.cached_blocks - evicted);
      const int64_t hb = std::min(left, cap_blocks);
      k = hb * B;
      evictable = hb;
      return;
    }
    k = std::min(w.hit / B, cap_blocks) * B;
  }

  // ---------------------------------------------------------------- schedule()
  void preempt(int32_t v) {
    W& r = reqs_[v];
    if (cfg_.async_scheduling && r.ph > 0) r.stale += r.ph;
    release(r);
    r.C = 0;
    r.ph = 0;
    r.preemptions += 1;
    enqueue_preempted(v);
  }

  void schedule(std::vector<Item>& batch) {
    batch.clear();
    const bool async = cfg_.async_scheduling;
    const int64_t lpt = effective_lpt();
    int64_t budget = cfg_.max_num_scheduled_tokens;
    bool preempted = false;

    // Phase 1: running requests in list order.
    size_t i = 0;
    while (i < running_.size() && budget > 0) {
      const int32_t ri = running_[i];
      W& r = reqs_[ri];
      if (async && r.ph > 0 && r.C + 2 - r.ph >= r.P + r.max_tokens) {
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
        if (alloc_running(r, n)) {
          ok = true;
          break;
        }
        size_t vpos = running_.size() - 1;
        if (cfg_.policy == Policy::Priority) {
          for (size_t k = 0; k < running_.size(); ++k) {
            const W& a = reqs_[running_[k]];
            const W& b = reqs_[running_[vpos]];
            if (k == 0 || a.prio > b.prio || (a.prio == b.prio && a.arrival > b.arrival)) vpos = k;
          }
        }
        const int32_t vi = running_[vpos];
        running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(vpos));
        if (cfg_.policy == Policy::Priority) {
          for (size_t k = 0; k < batch.size(); ++k)
            if (batch[k].req == vi) {
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
      batch.push_back({ri, n, r.C, r.preemptions, false});
      budget -= n;
      ++i;
    }

    // Phase 2: waiting requests, only if nothing was preempted.
    if (!preempted) {
      skipped_.clear();
      while (budget > 0 && !waiting_.empty()) {
        if (static_cast<int64_t>(running_.size()) >= cfg_.max_num_active_seqs) break;
        const int32_t wi = waiting_.front();
        W& w = reqs_[wi];
        if (w.stale > 0) {  // async: wait until the stale output is drained (skip, not block)
          skipped_.push_back(wi);
          waiting_.pop_front();
          continue;
        }
        int64_t k = 0, e = 0;
        if (w.C == 0) prefix_hit(w, k, e);
        const int64_t c0 = w.C == 0 ? k : w.C;
        const int64_t num_tokens = w.P + w.O;
        int64_t n = num_tokens - c0;
        if (lpt > 0 && lpt < n) n = lpt;
        if (n <= 0) break;
        if (!cfg_.enable_chunked_prefill && n > budget) break;
        n = std::min(n, budget);
        const int64_t B = cfg_.block_size;
        const int64_t hitb = k / B;
        const int64_t wm = running_.empty() ? 0 : cfg_.watermark_blocks;
        if (cfg_.scheduler_reserve_full_isl) {
          const int64_t full = ceil_div(std::min(num_tokens, cfg_.max_model_len), B) - hitb + e;
          if (full + wm > free_) break;
        }
        const int64_t total = ceil_div(std::min(c0 + n, cfg_.max_model_len), B);
        const int64_t fresh = std::max<int64_t>(0, total - hitb) + e;
        if (fresh + wm > free_) break;
        waiting_.pop_front();
        w.blocks = 0;
        w.excl = 0;
        take(w, fresh);
        w.blocks = std::max(total, w.blocks);
        w.cached_blocks = 0;
        w.C = c0;
        running_.push_back(wi);
        batch.push_back({wi, n, c0, w.preemptions, false});
        budget -= n;
      }
      for (auto it = skipped_.rbegin(); it != skipped_.rend(); ++it) waiting_.push_front(*it);
    }

    // _update_after_schedule: computed tokens advance at schedule time.
    for (auto& it : batch) {
      W& r = reqs_[it.req];
      r.C += it.n;
      it.samples = r.C >= r.P + r.O + r.ph;
      if (async && it.samples) r.ph += 1;
    }
  }

  // ---------------------------------------------------------------- update_from_output()
  // Applies one executed batch; returns true once the query got its first token.
  bool apply(const std::vector<Item>& batch) {
    bool any_finished = false;
    bool query_done = false;
    for (const auto& it : batch) {
      if (it.req < 0) continue;
      W& r = reqs_[it.req];
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
      if (r.is_query) {
        query_done = true;
        continue;
      }
      if (r.O >= r.target_out || r.P + r.O >= cfg_.max_model_len) {
        r.finished = true;
        release(r);
        r.cached_blocks = 0;
        any_finished = true;
      }
    }
    if (any_finished)
      running_.erase(std::remove_if(running_.begin(), running_.end(), [this](int32_t k) { return reqs_[k].finished; }),
                     running_.end());
    return query_done;
  }

  // ---------------------------------------------------------------- batch time
  double time_of(const std::vector<Item>& batch, const std::vector<std::pair<int64_t, int64_t>>* orphans) const {
    BatchFeatures f;
    for (const auto& it : batch) f.add(it.n, it.context, is_decode(it.n, it.context, reqs_[it.req].P));
    if (orphans != nullptr)
      for (const auto& o : *orphans) f.add(o.first, o.second, o.first == 1);
    return f.time(opt_.beta);
  }

  // ---------------------------------------------------------------- closed-form decode stretches
  // A run of steps in which every running request decodes one token and admission stays blocked
  // has a fixed composition except for contexts growing by one per step. It ends at the first
  // finish or when the running requests' new blocks would exhaust the free pool; folding the
  // steps before that is exact. Returns the number of steps folded (0: take a normal step).
  int64_t collapse(double& now) {
    const size_t R = running_.size();
    if (R < 1 || waiting_.empty()) return 0;
    if (static_cast<int64_t>(R) > cfg_.max_num_scheduled_tokens) return 0;
    int64_t min_rem = INT64_MAX;
    int64_t sum_ctx = 0;
    for (int32_t k : running_) {
      const W& r = reqs_[k];
      if (r.C != r.P + r.O - 1 || r.O < 1) return 0;
      const int64_t rem = std::min(r.target_out - r.O, cfg_.max_model_len - r.P - r.O);
      min_rem = std::min(min_rem, rem);
      sum_ctx += r.C;
    }
    int64_t steps = std::min<int64_t>(min_rem - 1, opt_.max_steps);
    if (steps < 2) return 0;
    if (!admission_blocked(cfg_.max_num_scheduled_tokens - static_cast<int64_t>(R))) return 0;
    const int64_t B = cfg_.block_size;
    auto demand = [&](int64_t s) {
      int64_t d = 0;
      for (int32_t k : running_) {
        const W& r = reqs_[k];
        const int64_t need = ceil_div(r.C + s, B) - r.blocks;
        if (need > 0) d += need;
      }
      return d;
    };
    if (demand(steps) > free_) {
      int64_t lo = 0, hi = steps;  // demand(lo) <= free < demand(hi)
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        (demand(mid) <= free_ ? lo : hi) = mid;
      }
      steps = lo;
      if (steps < 2) return 0;
    }
    const double Rd = static_cast<double>(R);
    const double sd = static_cast<double>(steps);
    const Coeffs& c = opt_.beta;
    now += sd * (c.b0 + c.b1 * Rd + c.b2 * static_cast<double>(sum_ctx)) + c.b2 * Rd * sd * (sd - 1.0) * 0.5;
    for (int32_t k : running_) {
      W& r = reqs_[k];
      const int64_t need = ceil_div(r.C + steps, B) - r.blocks;
      if (need > 0) take(r, need);
      r.C += steps;
      r.O += steps;
    }
    return steps;
  }

  // Would phase 2 admit nothing with `leftover` budget? Side-effect free; mirrors schedule().
  bool admission_blocked(int64_t leftover) const {
    if (leftover <= 0) return true;
    if (static_cast<int64_t>(running_.size()) >= cfg_.max_num_active_seqs) return true;
    const W& w = reqs_[waiting_.front()];
    if (w.cached_blocks > 0 || w.stale > 0) return false;  // hit may change: step normally
    int64_t k = 0, e = 0;
    if (w.C == 0) prefix_hit(w, k, e);
    const int64_t c0 = w.C == 0 ? k : w.C;
    const int64_t num_tokens = w.P + w.O;
    int64_t n = num_tokens - c0;
    const int64_t lpt = effective_lpt();
    if (lpt > 0 && lpt < n) n = lpt;
    if (n <= 0) return true;
    if (!cfg_.enable_chunked_prefill && n > leftover) return true;
    n = std::min(n, leftover);
    const int64_t B = cfg_.block_size;
    const int64_t hitb = k / B;
    const int64_t wm = running_.empty() ? 0 : cfg_.watermark_blocks;
    if (cfg_.scheduler_reserve_full_isl &&
        ceil_div(std::min(num_tokens, cfg_.max_model_len), B) - hitb + e + wm > free_)
      return true;
    const int64_t total = ceil_div(std::min(c0 + n, cfg_.max_model_len), B);
    return std::max<int64_t>(0, total - hitb) + e + wm > free_;
  }

  // ---------------------------------------------------------------- helpers
  Estimate& unschedulable(Estimate& est) const {
    est.status = Status::Unschedulable;
    est.ttft_s = std::numeric_limits<double>::infinity();
    return est;
  }

  void record(Estimate& est, const std::vector<Item>& batch) const {
    if (!trace_) return;
    std::vector<TraceItem> step;
    step.reserve(batch.size());
    for (const auto& it : batch) step.push_back({it.req, it.n});
    est.trace.push_back(std::move(step));
  }

  const Config& cfg_;
  const ReplayOptions& opt_;
  std::vector<W> reqs_;
  std::vector<int32_t> running_;
  std::deque<int32_t> waiting_;
  std::vector<int32_t> skipped_;
  int64_t free_ = 0;
  int64_t alloc_total_ = 0;
  int32_t query_ = -1;
  bool trace_ = false;
  bool has_inflight_ = false;
  double inflight_end_ = 0.0;
  std::vector<Item> inflight_;
  std::vector<std::pair<int64_t, int64_t>> orphans_;
};

}  // namespace

Prepared prepare(const Snapshot& s, const ReplayOptions& opt) {
  Prepared p;
  p.cfg = s.config;
  p.free_blocks = s.free_blocks;
  p.time = s.time;
  p.n_running = s.running.size();
  p.reqs.reserve(s.running.size() + s.waiting.size());
  p.names.reserve(s.running.size() + s.waiting.size() + 1);
  std::unordered_map<std::string, int32_t> index;
  for (const auto* list : {&s.running, &s.waiting})
    for (const auto& r : *list) {
      Prepared::Req q{};
      q.P = r.prompt_tokens;
      q.C = r.computed_tokens;
      q.O = r.output_tokens;
      q.max_tokens = r.max_tokens;
      q.blocks = r.blocks;
      q.excl = r.exclusive_blocks;
      q.ph = p.cfg.async_scheduling ? r.placeholders : 0;
      q.hit = r.prefix_hit_tokens;
      q.prio = r.priority;
      q.preemptions = r.preemptions;
      q.arrival = r.arrival;
      q.target_out = target_output(r, opt);
      if (s.inflight) index.emplace(r.id, static_cast<int32_t>(p.reqs.size()));
      p.reqs.push_back(q);
      p.names.push_back(r.id);
    }
  if (s.inflight && p.cfg.async_scheduling) {
    p.has_inflight = true;
    p.inflight_start = s.inflight->started - s.time;
    for (const auto& it : s.inflight->items) {
      auto f = index.find(it.id);
      if (f == index.end()) {
        p.inflight_orphans.emplace_back(it.n, it.context);
        continue;
      }
      const Prepared::Req& r = p.reqs[static_cast<size_t>(f->second)];
      p.inflight.push_back({f->second, it.n, it.context, it.context + it.n >= r.P + r.O});
    }
  }
  return p;
}

Estimate estimate(const Prepared& p, const Query& q, const ReplayOptions& opt) {
  Replay r(p, q, opt);
  return r.run();
}

}  // namespace bea
