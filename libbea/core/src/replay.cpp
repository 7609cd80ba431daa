#include "bea/core/replay.h"

#include "bea/core/ageing.h"
#include "bea/core/decode_stretch.h"
#include "bea/core/request_fields.h"
#include "bea/core/scheduler.h"
#include "bea/core/sync_fast_path.h"
#include "bea/core/tracked_ledger.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

namespace bea {
namespace {

// With --trace: the step's composition and the state right after its schedule().
void record_step(Estimate& est, const Scheduler& sched, const std::vector<Scheduler::Item>& batch) {
  std::vector<TraceItem> step;
  step.reserve(batch.size());
  int64_t tokens = 0;
  for (const auto& it : batch) {
    step.push_back({it.req, it.n});
    tokens += it.n;
  }
  est.trace.push_back(std::move(step));
  est.steps.push_back({static_cast<int64_t>(sched.running().size()), sched.free_blocks(), tokens});
}

// Later arrivals from other clients: prompt tokens accumulate from the query's arrival at `rate`
// (in expectation, or as the median count of whole prompts of `prompt` tokens when that is set:
// ReplayOptions::arrival_prompt_tokens); a step whose waiting queue drained admits them into its
// leftover budget, which lengthens the step by their eq. 12 prefill cost (a fresh chunk: context 0).
class ArrivalFill {
 public:
  ArrivalFill(double rate, double arrival, double prompt) : rate_(rate), arrival_(arrival), last_(arrival), prompt_(prompt) {}
  double extra_time(const Scheduler& sched, double step_start, int64_t step_tokens, const Coeffs& beta) {
    if (rate_ <= 0.0) return 0.0;
    if (prompt_ > 0.0) {
      backlog_ = std::max(0.0, median_count(rate_ / prompt_ * std::max(0.0, step_start - arrival_)) * prompt_ - charged_);
    } else {
      backlog_ += rate_ * std::max(0.0, step_start - last_);
      last_ = std::max(last_, step_start);
    }
    if (!sched.waiting().empty()) return 0.0;  // FCFS: they wait behind whoever still waits
    const double leftover = static_cast<double>(sched.config().max_num_scheduled_tokens - step_tokens);
    const double n = std::floor(std::min(leftover, backlog_));
    if (n <= 0.0) return 0.0;
    backlog_ -= n;
    charged_ += n;
    return beta.b1 * n + beta.b3 * n * (n + 1.0) * 0.5;
  }

 private:
  // The median of a Poisson count of mean m (m + 1/3 - 0.02/m, floored: exact to within one
  // for every m, and 0 below ln 2).
  static double median_count(double m) {
    if (!(m > 0.0)) return 0.0;
    return std::max(0.0, std::floor(m + 1.0 / 3.0 - 0.02 / m));
  }

  double rate_;
  double arrival_;
  double last_;
  double prompt_;
  double backlog_ = 0.0;
  double charged_ = 0.0;
};

// Whether the estimate runs on the fast path (sync_fast_path.h): decoders advanced as a group,
// exact fallback when order matters.
// Not with tracked blocks: the fast paths allocate outside the ledger's hooks.
bool fast_path(const Prepared& p, const ReplayOptions& opt) {
  const Config& cfg = p.cfg;
  return !cfg.async_scheduling && opt.collapse && !opt.trace && cfg.block_size <= 4096 && !p.tracked &&
         opt.later.empty();
}

Scheduler::Req query_req(const Query& q, double default_arrival, const ReplayOptions& opt);

// The known later arrivals (ReplayOptions::later) due by the schedule() at `now` join the queue.
class LaterArrivals {
 public:
  LaterArrivals(const ReplayOptions& opt, double arrival, double base_time)
      : opt_(opt), arrival_(arrival), base_(base_time) {}
  void admit(Scheduler& sched, double now) {
    while (next_ < opt_.later.size() && arrival_ + opt_.later[next_].after_s <= now) {
      const auto& l = opt_.later[next_++];
      if (l.q.prompt_tokens > sched.config().max_model_len) throw std::invalid_argument("later.prompt_tokens exceeds max_model_len");
      sched.add(query_req(l.q, base_ + arrival_ + l.after_s, opt_));
    }
  }

 private:
  const ReplayOptions& opt_;
  double arrival_;
  double base_;
  size_t next_ = 0;
};

// The sync engine loop (§2) from `sched` as it stands, the query already queued; `now` is the
// time since the snapshot's capture at which the first schedule() happens; the query arrived at
// `arrival` (<= now). `fast`: the fast path driving `sched`, or nullptr for the stepwise replay.
Estimate run_sync(Scheduler& sched, SyncFastPath* fast, int32_t query, const ReplayOptions& opt, double now,
                  double arrival, double base_time) {
  Estimate est;
  ArrivalFill fill(opt.arrival_tokens_per_s, arrival, opt.arrival_prompt_tokens);
  LaterArrivals later(opt, arrival, base_time);
  if (fast != nullptr) {
    while (est.n_batches < opt.max_steps) {
      int64_t steps = 0;
      const double start = now;
      const SyncFastPath::Result r = fast->step(now, opt.beta, query, opt.max_steps - est.n_batches, steps);
      est.n_batches += steps;
      if (steps == 1 && opt.arrival_tokens_per_s > 0.0) now += fill.extra_time(sched, start, fast->last_tokens(), opt.beta);
      if (r == SyncFastPath::Result::WatchSampled) {
        est.ttft_s = now;
        return est;
      }
      if (r == SyncFastPath::Result::Unschedulable) {
        est.status = Status::Unschedulable;
        return est;
      }
    }
  } else {
    std::vector<Scheduler::Item> batch;
    batch.reserve(sched.reqs().size());
    while (est.n_batches < opt.max_steps) {
      if (opt.collapse && !opt.trace && opt.later.empty()) {
        const int64_t k = fold_decode_stretch(sched, now, opt.beta, opt.max_steps - est.n_batches);
        if (k > 0) {
          est.n_batches += k;
          continue;
        }
      }
      later.admit(sched, now);
      sched.schedule(batch);
      if (batch.empty()) {  // nothing runs and nothing will change: the query never starts
        est.status = Status::Unschedulable;
        return est;
      }
      ++est.n_batches;
      if (opt.trace) record_step(est, sched, batch);
      const double start = now;
      now += sched.last_features().time(opt.beta);
      now += fill.extra_time(sched, start, static_cast<int64_t>(sched.last_features().tokens), opt.beta);
      if (sched.apply(batch, query)) {
        est.ttft_s = now;
        return est;
      }
    }
  }
  est.status = Status::StepLimit;
  return est;
}

Scheduler::Req query_req(const Query& q, double default_arrival, const ReplayOptions& opt) {
  const int64_t pred = q.predicted_output >= 0 ? q.predicted_output
                       : opt.default_output_tokens >= 0 ? opt.default_output_tokens
                                                        : q.max_tokens;
  return sched_arrival(q.prompt_tokens, q.max_tokens, std::clamp<int64_t>(pred, 1, q.max_tokens), q.prefix_hit_tokens,
                       q.priority, q.arrival > 0.0 ? q.arrival : default_arrival);
}

// One arrival and, for n > 1, its siblings: vLLM queues the n child requests together; the first
// computes the prompt, the others hit its blocks (prefix caching on; the count model's hit is
// capped at admission, a ledger finds them by key). skip_reading_prefix_cache: no hit for any.
int32_t add_arrival(Scheduler& sched, const Query& a, double t, const ReplayOptions& opt, TrackedLedger* ledger,
                    const std::string& field) {
  const bool reads = !a.skip_reading_prefix_cache;
  Query first = a;
  if (!reads) first.prefix_hit_tokens = 0;
  const int32_t i = sched.add(query_req(first, t, opt));
  static const std::vector<int64_t> kNoKeys;
  if (ledger != nullptr)
    ledger->add_request(i, first.prefix_hit_tokens, reads ? a.hit_blocks : std::nullopt, reads ? a.block_keys : kNoKeys,
                        field);
  else if (a.hit_blocks && !a.hit_blocks->empty())
    throw std::invalid_argument(field + ": the snapshot has no tracked_blocks");
  Query sibling = first;
  sibling.prefix_hit_tokens = reads ? a.prompt_tokens : 0;
  for (int64_t k = 1; k < a.sequences; ++k) {
    const int32_t j = sched.add(query_req(sibling, t, opt));
    if (ledger != nullptr) ledger->add_request(j, sibling.prefix_hit_tokens, std::nullopt, reads ? a.block_keys : kNoKeys, field);
  }
  return i;
}

// Queue the router's recent dispatches, then the query itself (each with its siblings); with a
// ledger, their hit chains. Returns the query's (its first child's) index.
int32_t enqueue(Scheduler& sched, const Query& q, const std::vector<Query>& ahead, double t, const ReplayOptions& opt,
                int64_t max_model_len, TrackedLedger* ledger) {
  for (size_t k = 0; k < ahead.size(); ++k) {
    const Query& a = ahead[k];
    if (a.prompt_tokens > max_model_len) throw std::invalid_argument("ahead.prompt_tokens exceeds max_model_len");
    add_arrival(sched, a, t, opt, ledger, "ahead[" + std::to_string(k) + "].hit_blocks");
  }
  return add_arrival(sched, q, t, opt, ledger, "request.hit_blocks");
}

// Tracked blocks: the stepwise replay, no decode-stretch folding (it allocates outside the hooks).
ReplayOptions tracked_options(const ReplayOptions& opt) {
  ReplayOptions o = opt;
  o.collapse = false;
  return o;
}

// The estimate from the snapshot itself; `ledger`: its tracked blocks (options already without
// the fast paths), or nullptr. Inlined: as a call it cost the smallest estimates 8 % (bench a).
inline __attribute__((always_inline)) Estimate estimate_from(const Prepared& p, const Query& q,
                                                             const ReplayOptions& opt,
                                                             const std::vector<Query>& ahead, TrackedLedger* ledger) {
  Scheduler sched(p.cfg);
  sched.load(p.reqs, p.n_running, p.free_blocks);
  if (ledger != nullptr) sched.set_ledger(ledger);
  const int32_t query = enqueue(sched, q, ahead, p.time, opt, p.cfg.max_model_len, ledger);
  if (!p.cfg.async_scheduling) {
    std::optional<SyncFastPath> fast;
    if (fast_path(p, opt)) fast.emplace(sched, p.group_start());
    Estimate e = run_sync(sched, fast ? &*fast : nullptr, query, opt, 0.0, 0.0, p.time);
    if (e.status != Status::Ok) e.ttft_s = std::numeric_limits<double>::infinity();
    return e;
  }
  // Async engine loop (§10): schedule k+1 against the state before update(k); k+1 starts when
  // k finishes. The snapshot's in-flight batch is k at the start.
  Estimate est;
  auto time_of = [&](const std::vector<Scheduler::Item>& batch, const std::vector<std::pair<int64_t, int64_t>>* orphans) {
    BatchFeatures f;
    sched.add_features(batch, f);
    if (orphans != nullptr)
      for (const auto& o : *orphans) f.add(o.first, o.second, o.first == 1);
    return f.time(opt.beta);
  };
  double now = 0.0;  // seconds since the snapshot's capture
  std::vector<Scheduler::Item> batch;
  batch.reserve(p.reqs.size() + 1);
  {
    std::vector<Scheduler::Item> inflight;
    std::vector<std::pair<int64_t, int64_t>> orphans = p.inflight_orphans;
    bool has_inflight = p.has_inflight;
    double inflight_end = 0.0;
    if (has_inflight) {
      for (const auto& it : p.inflight)
        inflight.push_back({it.req, it.n, it.context, p.reqs[static_cast<size_t>(it.req)].preemptions, it.samples});
      inflight_end = std::max(0.0, p.inflight_start + time_of(inflight, &orphans));
    }
    while (est.n_batches < opt.max_steps) {
      sched.schedule(batch);
      const bool had_inflight = has_inflight;
      if (had_inflight) {
        now = std::max(now, inflight_end);
        if (sched.apply(inflight, query)) {
          est.ttft_s = now;
          return est;
        }
        has_inflight = false;
        orphans.clear();
      }
      if (batch.empty()) {
        if (had_inflight) continue;  // the update may have freed room: schedule again
        est.status = Status::Unschedulable;
        return est;
      }
      ++est.n_batches;
      if (opt.trace) record_step(est, sched, batch);
      inflight.swap(batch);
      has_inflight = true;
      inflight_end = now + sched.last_features().time(opt.beta);
    }
  }
  est.status = Status::StepLimit;
  est.ttft_s = std::numeric_limits<double>::infinity();
  return est;
}

// The draw whose TTFT is the upper median (unschedulable and step-limited draws are +inf: they
// sort last).
Estimate upper_median(std::vector<Estimate> draws) {
  std::vector<size_t> order(draws.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  const auto mid = order.begin() + static_cast<std::ptrdiff_t>(order.size() / 2);
  std::nth_element(order.begin(), mid, order.end(),
                   [&](size_t a, size_t b) { return draws[a].ttft_s < draws[b].ttft_s; });
  return std::move(draws[*mid]);
}

void check_later(const Prepared& p, const ReplayOptions& opt) {
  if (opt.later.empty()) return;
  if (p.cfg.async_scheduling) throw std::invalid_argument("later: sync scheduling only");
  if (p.tracked) throw std::invalid_argument("later: not with tracked_blocks");
  double prev = 0.0;
  for (const auto& l : opt.later) {
    if (!std::isfinite(l.after_s) || l.after_s < prev) throw std::invalid_argument("later.after_s must be finite, >= 0 and ordered");
    prev = l.after_s;
  }
}

}  // namespace

std::vector<std::string> arrival_names(const std::vector<Query>& ahead, const Query& q) {
  std::vector<std::string> out;
  auto add = [&out](const Query& a) {
    if (a.sequences <= 1) {
      out.push_back(a.id);
      return;
    }
    for (int64_t k = 0; k < a.sequences; ++k) out.push_back(std::to_string(k) + "_" + a.id);  // vLLM's child ids
  };
  for (const auto& a : ahead) add(a);
  add(q);
  return out;
}

double next_step_s(const Prepared& p, const Coeffs& beta) {
  if (p.cfg.async_scheduling) return 0.0;
  Scheduler sched(p.cfg);
  sched.load(p.reqs, p.n_running, p.free_blocks);
  std::optional<TrackedLedger> ledger;
  if (p.tracked) {
    ledger.emplace(p);
    sched.set_ledger(&*ledger);
  }
  std::vector<Scheduler::Item> batch;
  sched.schedule(batch);
  return batch.empty() ? 0.0 : sched.last_features().time(beta);
}

Estimate estimate(const Prepared& p, const Query& q, const ReplayOptions& opt, const std::vector<Query>& ahead) {
  if (q.prompt_tokens > p.cfg.max_model_len) throw std::invalid_argument("request.prompt_tokens exceeds max_model_len");
  check_later(p, opt);
  if (!p.tracked) return estimate_from(p, q, opt, ahead, nullptr);
  TrackedLedger ledger(p);
  return estimate_from(p, q, tracked_options(opt), ahead, &ledger);
}


Estimate estimate_at_age(const Prepared& p, const Query& q, const ReplayOptions& opt, double age_s,
                         const std::vector<Query>& ahead) {
  if (q.prompt_tokens > p.cfg.max_model_len) throw std::invalid_argument("request.prompt_tokens exceeds max_model_len");
  check_later(p, opt);
  if (p.cfg.async_scheduling || age_s <= 0.0) {
    Estimate e = estimate(p, q, opt, ahead);
    e.ttft_s -= std::max(0.0, age_s);
    return e;
  }
  Estimate e;
  if (fast_path(p, opt)) {  // the residents age on the fast path that then runs the estimate
    Scheduler sched(p.cfg);
    sched.load(p.reqs, p.n_running, p.free_blocks);
    SyncFastPath fast(sched, p.group_start());
    const AgeWindow w = advance_fast(fast, opt.beta, age_s);
    const int32_t query = enqueue(sched, q, ahead, p.time + age_s, opt, p.cfg.max_model_len, nullptr);
    e = run_sync(sched, &fast, query, opt, w.join_s, age_s, p.time);
    e.aged_steps = w.steps;
  } else {
    Advanced a = advance(p, opt.beta, age_s);
    const int32_t query = enqueue(a.sched, q, ahead, p.time + age_s, opt, p.cfg.max_model_len, a.ledger.get());
    e = a.ledger ? run_sync(a.sched, nullptr, query, tracked_options(opt), a.join_s, age_s, p.time)
                 : run_sync(a.sched, nullptr, query, opt, a.join_s, age_s, p.time);
    e.aged_steps = a.steps;
  }
  e.ttft_s = e.status == Status::Ok ? e.ttft_s - age_s : std::numeric_limits<double>::infinity();
  return e;
}

Estimate estimate_with_lengths(const Prepared& p, const Query& q, const ReplayOptions& opt, double age_s,
                               const std::vector<Query>& ahead, bool shortcut) {
  auto one = [&](const Prepared& from) {
    return age_s > 0.0 ? estimate_at_age(from, q, opt, age_s, ahead) : estimate(from, q, opt, ahead);
  };
  if (p.length_draws <= 0 || p.reqs.empty()) return one(p);
  if (!shortcut) {  // the reference: every draw replayed on a full copy of the form
    std::vector<Estimate> draws;
    draws.reserve(static_cast<size_t>(p.length_draws));
    Prepared drawn = p;
    for (int64_t d = 1; d <= p.length_draws; ++d) {
      use_drawn_lengths(drawn, p, d);
      draws.push_back(one(drawn));
    }
    return upper_median(std::move(draws));
  }
  // A resident gains at most one token a step (two with async scheduling's placeholder): if none
  // can reach its end, point or drawn, within the steps the point replay ran to the query's first
  // token, the draws run exactly these steps. Per draw the same holds with that draw's margin: a
  // draw whose residents are all beyond the point replay's reach gets the point estimate.
  Estimate point = one(p);
  const int64_t reach = point.aged_steps + point.n_batches + 2;
  if (point.status == Status::Ok && reach < p.draw_margin) return point;
  std::vector<Estimate> draws;
  draws.reserve(static_cast<size_t>(p.length_draws));
  Prepared drawn = draw_form(p);  // one copy (no names, no draw tables); each draw rewrites its lengths
  for (int64_t d = 1; d <= p.length_draws; ++d) {
    if (point.status == Status::Ok && reach < p.drawn_margins[static_cast<size_t>(d - 1)]) {
      draws.push_back(point);
      continue;
    }
    use_draw(drawn, p, d);
    draws.push_back(one(drawn));
  }
  return upper_median(std::move(draws));
}

}  // namespace bea
