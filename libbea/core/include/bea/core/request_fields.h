// Request fields between their forms, in one place: the value tree (bear.snapshot/1 maps, and
// Python dicts through it), the snapshot model (Request, Query) and the scheduler's record
// (SchedRequest). Every other piece converts requests through these functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bea/core/request.h"
#include "bea/core/snapshot.h"
#include "bea/core/value.h"

namespace bea {

class Scheduler;

// Value → model, validated: throws std::invalid_argument naming the field (`path`, e.g.
// "running[3]", prefixes the request's own fields).
Request request_from_value(const Value& v, const std::string& path, const Config& cfg);
Query query_from_value(const Value& v);

// Model → value: the bear.snapshot/1 request map.
Value request_to_value(const Request& r);

// Model → scheduler record. `target_out`: the output length the replay lets it run to.
SchedRequest sched_request(const Request& r, int64_t target_out, bool async_scheduling);
// A new arrival: the query, a dispatch queued ahead of it, a request the sim engine receives.
SchedRequest sched_arrival(int64_t prompt_tokens, int64_t max_tokens, int64_t target_out, int64_t prefix_hit_tokens,
                           int64_t priority, double arrival);

// Scheduler record → model. A request that has not started keeps its reported prefix hit.
Request request_from_sched(const SchedRequest& r, const std::string& id);

// A scheduler's state between steps as a snapshot model (config, free blocks, running and
// waiting in queue order); `names[k]` is request k's id. Instance, model, seq and time are left
// to the caller; there is no in-flight batch (sync scheduling).
Snapshot capture(const Scheduler& sched, const std::vector<std::string>& names);

}  // namespace bea
