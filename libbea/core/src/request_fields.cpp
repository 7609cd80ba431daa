#include "bea/core/request_fields.h"

#include "bea/core/scheduler.h"
#include "value_fields.h"

namespace bea {

using namespace fields;

Request request_from_value(const Value& r, const std::string& path, const Config& cfg) {
  if (r.type != Value::Type::Map) bad(path, "must be a map");
  const std::string p = path + ".";
  Request q;
  q.id = id_field(r, p);
  q.prompt_tokens = int_field(r, "prompt_tokens", p, 1, kMaxTokens);
  q.output_tokens = int_field(r, "output_tokens", p, 0, kMaxTokens);
  q.placeholders = opt_int(r, "placeholders", p, 0, 1 << 16, 0);
  q.computed_tokens =
      int_field(r, "computed_tokens", p, 0, q.prompt_tokens + q.output_tokens + q.placeholders);
  q.max_tokens = int_field(r, "max_tokens", p, 1, kMaxTokens);
  q.blocks = int_field(r, "blocks", p, 0, cfg.num_gpu_blocks);
  q.exclusive_blocks = opt_int(r, "exclusive_blocks", p, 0, q.blocks, q.blocks);
  q.preemptions = opt_int(r, "preemptions", p, 0, kMaxTokens, 0);
  q.prefix_hit_tokens = opt_int(r, "prefix_hit_tokens", p, 0, kMaxTokens, 0);
  q.priority = opt_int(r, "priority", p, -kMaxTokens, kMaxTokens, 0);
  q.arrival = opt_double(r, "arrival", p, 0.0);
  if (auto t = opt_index_list(r, "tracked", p, kMaxBlocks)) q.tracked = std::move(*t);  // checked against the table by the snapshot
  q.hit_blocks = opt_index_list(r, "hit_blocks", p, kMaxBlocks);
  q.block_keys = opt_key_list(r, "block_keys", p);
  q.tracked_ids = opt_key_list(r, "tracked_ids", p);  // checked against the table by the snapshot
  return q;
}

Query query_from_value(const Value& v) {
  if (v.type != Value::Type::Map) bad("request", "must be a map");
  Query q;
  q.id = opt_str(v, "id", "request.", "__query__");
  if (q.id.empty()) bad("request.id", "must not be empty");
  q.prompt_tokens = int_field(v, "prompt_tokens", "request.", 1, kMaxTokens);
  q.max_tokens = opt_int(v, "max_tokens", "request.", 1, kMaxTokens, 1);
  q.prefix_hit_tokens = opt_int(v, "prefix_hit_tokens", "request.", 0, kMaxTokens, 0);
  q.priority = opt_int(v, "priority", "request.", -kMaxTokens, kMaxTokens, 0);
  q.arrival = opt_double(v, "arrival", "request.", 0.0);
  q.predicted_output = opt_int(v, "predicted_output", "request.", -1, kMaxTokens, -1);
  q.sequences = opt_int(v, "sequences", "request.", 1, kMaxSequences, 1);
  q.skip_reading_prefix_cache = opt_bool(v, "skip_reading_prefix_cache", "request.", false);
  q.hit_blocks = opt_index_list(v, "hit_blocks", "request.", kMaxBlocks);  // checked against the table by the estimate
  q.block_keys = opt_key_list(v, "block_keys", "request.");
  return q;
}

Value request_to_value(const Request& r) {
  Value d = map_value();
  d.map.reserve(12);
  d.map.emplace_back("id", str_value(r.id));
  d.map.emplace_back("prompt_tokens", int_value(r.prompt_tokens));
  d.map.emplace_back("computed_tokens", int_value(r.computed_tokens));
  d.map.emplace_back("output_tokens", int_value(r.output_tokens));
  d.map.emplace_back("max_tokens", int_value(r.max_tokens));
  d.map.emplace_back("blocks", int_value(r.blocks));
  d.map.emplace_back("exclusive_blocks", int_value(r.exclusive_blocks));
  d.map.emplace_back("preemptions", int_value(r.preemptions));
  d.map.emplace_back("arrival", real_value(r.arrival));
  d.map.emplace_back("priority", int_value(r.priority));
  if (r.prefix_hit_tokens > 0) d.map.emplace_back("prefix_hit_tokens", int_value(r.prefix_hit_tokens));
  if (r.placeholders > 0) d.map.emplace_back("placeholders", int_value(r.placeholders));
  if (!r.tracked.empty()) d.map.emplace_back("tracked", int_list_value(r.tracked));
  if (r.hit_blocks) d.map.emplace_back("hit_blocks", int_list_value(*r.hit_blocks));
  if (!r.block_keys.empty()) d.map.emplace_back("block_keys", int_list_value(r.block_keys));
  if (!r.tracked_ids.empty()) d.map.emplace_back("tracked_ids", int_list_value(r.tracked_ids));
  return d;
}

SchedRequest sched_request(const Request& r, int64_t target_out, bool async_scheduling) {
  SchedRequest q{};
  q.P = r.prompt_tokens;
  q.C = r.computed_tokens;
  q.O = r.output_tokens;
  q.max_tokens = r.max_tokens;
  q.kv.held = r.blocks;
  q.kv.exclusive = r.exclusive_blocks;
  q.ph = async_scheduling ? static_cast<int32_t>(r.placeholders) : 0;
  q.hit = r.prefix_hit_tokens;
  q.prio = r.priority;
  q.preemptions = r.preemptions;
  q.arrival = r.arrival;
  q.target_out = target_out;
  return q;
}

SchedRequest sched_arrival(int64_t prompt_tokens, int64_t max_tokens, int64_t target_out, int64_t prefix_hit_tokens,
                           int64_t priority, double arrival) {
  SchedRequest q{};
  q.P = prompt_tokens;
  q.max_tokens = max_tokens;
  q.target_out = target_out;
  q.hit = prefix_hit_tokens;
  q.prio = priority;
  q.arrival = arrival;
  return q;
}

Request request_from_sched(const SchedRequest& r, const std::string& id) {
  Request q;
  q.id = id;
  q.prompt_tokens = r.P;
  q.computed_tokens = r.C;
  q.output_tokens = r.O;
  q.max_tokens = r.max_tokens;
  q.blocks = r.kv.held;
  q.exclusive_blocks = r.kv.exclusive;
  q.preemptions = r.preemptions;
  q.placeholders = r.ph;
  q.prefix_hit_tokens = r.C == 0 ? r.hit : 0;
  q.priority = r.prio;
  q.arrival = r.arrival;
  return q;  // the length it stops at (target_out) stays with the scheduler
}

Snapshot capture(const Scheduler& sched, const std::vector<std::string>& names) {
  Snapshot snap;
  snap.config = sched.config();
  snap.free_blocks = sched.free_blocks();
  const auto& reqs = sched.reqs();
  snap.running.reserve(sched.running().size());
  for (int32_t k : sched.running())
    snap.running.push_back(request_from_sched(reqs[static_cast<size_t>(k)], names[static_cast<size_t>(k)]));
  snap.waiting.reserve(sched.waiting().size());
  for (int32_t k : sched.waiting())
    snap.waiting.push_back(request_from_sched(reqs[static_cast<size_t>(k)], names[static_cast<size_t>(k)]));
  return snap;
}

}  // namespace bea
