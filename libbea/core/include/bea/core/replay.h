// Forward replay of vLLM V1 scheduling (vllm-scheduler-replay.md §15) from one snapshot, until
// a new query's first token: the BEA estimate (paper eq. 10-12).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/scheduler.h"
#include "bea/core/snapshot.h"

namespace bea {

struct ReplayOptions {
  Coeffs beta;
  bool trace = false;      // record every simulated step's composition
  bool collapse = true;    // fold decode-only stretches in closed form (exact; off under trace)
  // Residents without a prediction run for this many output tokens (-1: until max_tokens).
  int64_t default_output_tokens = -1;
  // A resident already past its prediction is given this fraction of its prediction again
  // (at least one token) as remaining length, capped by max_tokens (design.md §3).
  double overrun_fraction = 0.5;
  int64_t max_steps = 2'000'000;  // a guard: no valid state needs this many steps
  // Expected prompt tokens per second that other clients will send to this instance after the
  // query (0: ignore). They queue behind the query, so they never change its schedule, but they
  // fill the budget the query's steps leave over and so lengthen those steps (sync mode).
  double arrival_tokens_per_s = 0.0;
};

enum class Status : uint8_t { Ok = 0, Unschedulable = 1, StepLimit = 2 };

struct TraceItem {
  int32_t req;  // index into Prepared::names; names.size() is the query
  int64_t n;
};

struct Estimate {
  double ttft_s = std::numeric_limits<double>::infinity();  // from the snapshot's capture time
  int64_t n_batches = 0;
  Status status = Status::Ok;
  std::vector<std::vector<TraceItem>> trace;
  struct StepState { int64_t running, free_blocks, tokens; };
  std::vector<StepState> steps;  // with trace: state right after each simulated schedule()
};

// Replay-ready form of a snapshot: the request table flattened once, reused by every estimate.
struct Prepared {
  using Req = Scheduler::Req;
  Config cfg;
  int64_t free_blocks = 0;
  double time = 0.0;
  std::vector<Req> reqs;            // running first, then waiting, in snapshot order
  std::vector<std::string> names;   // ids, same order
  size_t n_running = 0;
  bool has_inflight = false;
  double inflight_start = 0.0;      // relative to `time`
  struct Item { int32_t req; int64_t n, context; bool samples; };
  std::vector<Item> inflight;       // items whose request is resident; others only cost time
  std::vector<std::pair<int64_t, int64_t>> inflight_orphans;  // (n, context) of unknown ids
};

Prepared prepare(const Snapshot& s, const ReplayOptions& opt);

// The BEA estimate for `q` joining the instance described by `p`. `ahead`: requests already sent
// to the instance after the snapshot was captured (the router's own dispatches): they queue in
// front of the query, with their predicted output lengths.
Estimate estimate(const Prepared& p, const Query& q, const ReplayOptions& opt, const std::vector<Query>& ahead = {});

// The same estimate for a query arriving `age_s` after the snapshot was captured (staleness
// compensation, sync mode): the residents first run alone through every step that starts before
// the arrival, then the query joins. Returns TTFT measured from the query's arrival.
Estimate estimate_at_age(const Prepared& p, const Query& q, const ReplayOptions& opt, double age_s,
                         const std::vector<Query>& ahead = {});

}  // namespace bea
