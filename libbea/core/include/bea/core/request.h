// One request as the scheduler tracks it (vLLM's Request in v1/request.py, reduced to what
// scheduling reads): token counts, the length it stops at, queue keys and its KV blocks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "bea/core/kv_cache.h"

namespace bea {

// Trivial (no default member values): a snapshot's request table is copied into every estimate's
// scheduler, and trivial records copy as one block. Make new records with SchedRequest{} (zeros)
// or through request_fields.h. Two cache lines, aligned: the first holds what a decoding step,
// a finish and an admission read.
struct alignas(64) SchedRequest {
  int64_t P;            // prompt tokens
  int64_t C;            // computed tokens
  int64_t O;            // output tokens
  int64_t target_out;   // total output tokens after which the request stops
  int64_t max_tokens;
  int32_t ph;           // async: placeholders (sampled on device, not yet delivered; < 2^17)
  bool finished;
  RequestBlocks kv;     // held and exclusive in the first line, the prefix-cache model in the second
  int64_t hit;          // reported prefix-cache hit tokens (waiting requests)
  int64_t stale;        // async: outputs of a pre-preemption batch still in flight
  int64_t preemptions;
  int64_t prio;
  double arrival;
};
static_assert(std::is_trivial<SchedRequest>::value, "request tables are copied as blocks");
static_assert(sizeof(SchedRequest) == 128, "two cache lines");

}  // namespace bea
