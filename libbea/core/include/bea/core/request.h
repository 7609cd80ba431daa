// One request as the scheduler tracks it (vLLM's Request in v1/request.py, reduced to what
// scheduling reads): token counts, the length it stops at, queue keys and its KV blocks.
#pragma once

#include <cstdint>

#include "bea/core/kv_cache.h"

namespace bea {

struct SchedRequest {
  int64_t P = 0;           // prompt tokens
  int64_t C = 0;           // computed tokens
  int64_t O = 0;           // output tokens
  int64_t max_tokens = 1;
  int64_t ph = 0;          // async: placeholders (sampled on device, not yet delivered)
  int64_t hit = 0;         // reported prefix-cache hit tokens (waiting requests)
  int64_t prio = 0;
  int64_t target_out = 1;  // total output tokens after which the request stops
  int64_t preemptions = 0;
  double arrival = 0.0;
  int64_t stale = 0;       // async: outputs of a pre-preemption batch still in flight
  RequestBlocks kv;
  bool finished = false;
};

}  // namespace bea
