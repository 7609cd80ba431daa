// Forward replay of vLLM V1 scheduling (vllm-scheduler-replay.md §15) from one snapshot, until
// a new query's first token: the BEA estimate (paper eq. 10-12).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bea/core/prepared.h"
#include "bea/core/replay_options.h"
#include "bea/core/snapshot.h"

namespace bea {

enum class Status : uint8_t { Ok = 0, Unschedulable = 1, StepLimit = 2 };

struct TraceItem {
  int32_t req;  // index into Prepared::names, then into arrival_names(ahead, query)
  int64_t n;
};

struct Estimate {
  double ttft_s = std::numeric_limits<double>::infinity();  // from the snapshot's capture time
  int64_t n_batches = 0;
  int64_t aged_steps = 0;  // estimate_at_age: the steps the residents ran alone before the query joined
  Status status = Status::Ok;
  std::vector<std::vector<TraceItem>> trace;
  struct StepState { int64_t running, free_blocks, tokens; };
  std::vector<StepState> steps;  // with trace: state right after each simulated schedule()
};

// The BEA estimate for `q` joining the instance described by `p`. `ahead`: requests already sent
// to the instance after the snapshot was captured (the router's own dispatches): they queue in
// front of the query, with their predicted output lengths.
Estimate estimate(const Prepared& p, const Query& q, const ReplayOptions& opt, const std::vector<Query>& ahead = {});

// The same estimate for a query arriving `age_s` after the snapshot was captured (staleness
// compensation, sync mode): the residents first run alone through every step that starts before
// the arrival, then the query joins. Returns TTFT measured from the query's arrival.
Estimate estimate_at_age(const Prepared& p, const Query& q, const ReplayOptions& opt, double age_s,
                         const std::vector<Query>& ahead = {});

// The estimate as the options ask for it: where `p` was prepared with length draws (the options'
// length_draws > 0 and length_sigma > 0), the draw whose TTFT is the (upper) median over that many
// replays, each with the residents' lengths drawn (Prepared::drawn_targets); else the one replay
// (estimate_at_age when `age_s` > 0, else estimate). The point replay runs first: when no
// resident comes within Prepared::draw_margin tokens of its end in any draw before the query's
// first token, every draw runs the same steps and the point estimate is returned (exact; off with
// `shortcut` = false, for the tests that check it).
Estimate estimate_with_lengths(const Prepared& p, const Query& q, const ReplayOptions& opt, double age_s,
                               const std::vector<Query>& ahead = {}, bool shortcut = true);

// The names of the requests an estimate queues after the residents, in its order: each request
// ahead, then the query; one with sequences = n > 1 as vLLM's children "0_<id>" … "<n-1>_<id>".
std::vector<std::string> arrival_names(const std::vector<Query>& ahead, const Query& q);

// Seconds (eq. 12) of the step the engine runs next from this state (sync mode; 0 when nothing
// would run or under async scheduling): how long the snapshot stays current while it runs.
double next_step_s(const Prepared& p, const Coeffs& beta);

}  // namespace bea
