// The knobs of one estimate: eq. 12 coefficients, the residents' length policy, the fast paths,
// and expected later arrivals.
#pragma once

#include <cstdint>
#include <vector>

#include "bea/core/batch_time.h"
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
  // The spread of the instance's answers around their predictions: σ of log(actual / predicted)
  // (0: unknown). When > 0, a resident that has already generated k tokens runs to the median of
  // its length given that it is longer than k — the length a log-normal around the prediction
  // with this σ has, conditioned on what the snapshot shows — instead of the prediction (or, past
  // it, the overrun rule). At k = 0 that median is the prediction itself.
  double length_sigma = 0.0;
  // With length_sigma > 0, > 0: the estimate is the median TTFT over this many replays, each
  // resident's length drawn from a log-normal with the prediction as its mean and this σ, given
  // that it is longer than what it generated (docs/libbea.md, "Output lengths drawn"). Each
  // draw is a function of the request's id and the draw's number: the same inputs, the same
  // estimate. 0: one replay with the point lengths above.
  int64_t length_draws = 0;
  int64_t max_steps = 2'000'000;  // a guard: no valid state needs this many steps
  // Expected prompt tokens per second that other clients will send to this instance after the
  // query (0: ignore). They queue behind the query, so they never change its schedule, but they
  // fill the budget the query's steps leave over and so lengthen those steps (sync mode).
  double arrival_tokens_per_s = 0.0;
  // The mean prompt of one such arrival (0: charge the expected tokens, rate x time). When set,
  // the arrivals are counted as whole prompts and the replay charges the median of their
  // Poisson count rather than its mean: a point estimate scored by its absolute relative error
  // (MAPE, and a feasibility test at 50 %) is best at the median, and while fewer than ln 2
  // arrivals are expected the median is none.
  double arrival_prompt_tokens = 0.0;
  // Later arrivals known exactly (the error decomposition's oracle, never a live input): each
  // joins the waiting queue at the first schedule() at or after `after_s` seconds past the
  // query's arrival. Sync mode, stepwise (no fast paths), no tracked blocks.
  struct Later {
    double after_s = 0.0;
    Query q;
  };
  std::vector<Later> later;
};

}  // namespace bea
