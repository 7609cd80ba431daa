#include "bea/core/snapshot.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "bea/core/request_fields.h"
#include "value_fields.h"

namespace bea {
namespace {

using namespace fields;

Config config_from(const Value& c) {
  if (c.type != Value::Type::Map) bad("config", "must be a map");
  const std::string p = "config.";
  Config k;
  k.max_num_batched_tokens = int_field(c, "max_num_batched_tokens", p, 1, kMaxTokens);
  k.max_num_scheduled_tokens =
      opt_int(c, "max_num_scheduled_tokens", p, 1, kMaxTokens, k.max_num_batched_tokens);
  k.max_num_seqs = int_field(c, "max_num_seqs", p, 1, kMaxTokens);
  k.max_num_active_seqs = opt_int(c, "max_num_active_seqs", p, 1, kMaxTokens, k.max_num_seqs);
  k.long_prefill_token_threshold = opt_int(c, "long_prefill_token_threshold", p, 0, kMaxTokens, 0);
  k.long_prefill_token_threshold_adaptive = opt_bool(c, "long_prefill_token_threshold_adaptive", p, false);
  k.enable_chunked_prefill = opt_bool(c, "enable_chunked_prefill", p, true);
  const std::string pol = opt_str(c, "policy", p, "fcfs");
  if (pol == "fcfs") k.policy = Policy::Fcfs;
  else if (pol == "priority") k.policy = Policy::Priority;
  else bad("config.policy", "must be 'fcfs' or 'priority'");
  k.block_size = int_field(c, "block_size", p, 1, 1 << 20);
  k.num_gpu_blocks = int_field(c, "num_gpu_blocks", p, 1, kMaxBlocks);
  k.watermark_blocks = opt_int(c, "watermark_blocks", p, 0, kMaxBlocks, 0);
  k.max_model_len = int_field(c, "max_model_len", p, 2, kMaxTokens);
  k.scheduler_reserve_full_isl = opt_bool(c, "scheduler_reserve_full_isl", p, true);
  k.enable_prefix_caching = opt_bool(c, "enable_prefix_caching", p, false);
  k.async_scheduling = opt_bool(c, "async_scheduling", p, false);
  k.priority_self_preempt_continues = opt_bool(c, "priority_self_preempt_continues", p, false);
  return k;
}

std::vector<Request> requests_from(const Value& list, const std::string& name, const Config& cfg) {
  if (list.type != Value::Type::Arr) bad(name, "must be a list");
  if (list.arr.size() > kMaxRequests) bad(name, "too many requests");
  std::vector<Request> out;
  out.reserve(list.arr.size());
  for (size_t k = 0; k < list.arr.size(); ++k)
    out.push_back(request_from_value(list.arr[k], name + "[" + std::to_string(k) + "]", cfg));
  return out;
}

// The table in stable form (`pool_table`: rows of block id, ticket, key, stamp; contract.md §2).
void pool_from(const Value& v, Snapshot& s) {
  const Value* t = v.get("pool_table");
  if (t == nullptr || t->type == Value::Type::Nil) return;
  if (t->type != Value::Type::Arr || t->arr.size() % 4 != 0)
    bad("pool_table", "must be a list of [block, ticket, key, stamp] rows");
  if (!s.tracked_blocks.empty()) bad("pool_table", "not with tracked_blocks");
  if (!t->arr.empty() && !s.config.enable_prefix_caching) bad("pool_table", "needs config.enable_prefix_caching");
  if (static_cast<int64_t>(t->arr.size() / 4) > s.config.num_gpu_blocks) bad("pool_table", "more blocks than the pool has");
  s.pool.reserve(t->arr.size() / 4);
  for (size_t k = 0; k < t->arr.size(); k += 4) {
    const std::string f = "pool_table[" + std::to_string(k) + "]";
    const int64_t id = as_int(t->arr[k], f, 0, s.config.num_gpu_blocks - 1);
    PoolEntry e;
    e.ticket = as_int(t->arr[k + 1], f, -1, INT64_MAX);
    e.key = as_int(t->arr[k + 2], f, -1, INT64_MAX);
    e.stamp = as_int(t->arr[k + 3], f, -1, INT64_MAX);
    if (!s.pool.emplace(id, e).second) bad(f, "a block given twice");
    s.pool_free += e.ticket >= 0;
  }
  if (s.pool_free > s.free_blocks) bad("pool_table", "more free blocks than free_blocks");
  s.has_pool = true;
}

// The tracked-block table and every request's references into it (tracked_ledger.h).
void tracked_from(const Value& v, Snapshot& s) {
  const Value* t = v.get("tracked_blocks");
  if (t != nullptr && t->type != Value::Type::Nil) {
    if (t->type != Value::Type::Arr) bad("tracked_blocks", "must be a list of integers");
    if (static_cast<int64_t>(t->arr.size()) > s.config.num_gpu_blocks) bad("tracked_blocks", "more blocks than the pool has");
    if (!t->arr.empty() && !s.config.enable_prefix_caching)
      bad("tracked_blocks", "needs config.enable_prefix_caching");
    s.tracked_blocks.reserve(t->arr.size());
    for (size_t k = 0; k < t->arr.size(); ++k)
      s.tracked_blocks.push_back(as_int(t->arr[k], "tracked_blocks[" + std::to_string(k) + "]", -1, s.free_blocks - 1));
    std::vector<int64_t> pos(s.tracked_blocks);
    std::sort(pos.begin(), pos.end());
    for (size_t k = 1; k < pos.size(); ++k)
      if (pos[k] >= 0 && pos[k] == pos[k - 1]) bad("tracked_blocks", "a free-queue position given twice");
  }
  const auto n = static_cast<int64_t>(s.tracked_blocks.size());
  const Value* keys = v.get("tracked_keys");
  if (keys != nullptr && keys->type != Value::Type::Nil) {
    if (keys->type != Value::Type::Arr) bad("tracked_keys", "must be a list of integers");
    if (static_cast<int64_t>(keys->arr.size()) != n) bad("tracked_keys", "needs one key per tracked block");
    s.tracked_keys.reserve(keys->arr.size());
    for (size_t k = 0; k < keys->arr.size(); ++k)
      s.tracked_keys.push_back(as_int(keys->arr[k], "tracked_keys[" + std::to_string(k) + "]", -1, INT64_MAX));
  }
  pool_from(v, s);
  s.has_tracked = n > 0 || s.has_pool;
  for (const auto* list : {&s.running, &s.waiting})
    for (size_t k = 0; k < list->size(); ++k) {
      const Request& r = (*list)[k];
      const std::string p = (list == &s.running ? "running[" : "waiting[") + std::to_string(k) + "].";
      if (list == &s.waiting && !r.tracked.empty()) bad(p + "tracked", "a waiting request holds no blocks");
      if (list == &s.running && r.hit_blocks) bad(p + "hit_blocks", "only waiting requests have a hit chain");
      if (!r.block_keys.empty() && !s.config.enable_prefix_caching)
        bad(p + "block_keys", "needs config.enable_prefix_caching");
      if (static_cast<int64_t>(r.tracked.size()) > r.blocks) bad(p + "tracked", "more blocks than it holds");
      for (size_t j = 0; j < r.tracked.size(); ++j) {
        if (r.tracked[j] >= n) bad(p + "tracked[" + std::to_string(j) + "]", "not an index into tracked_blocks");
        if (s.tracked_blocks[static_cast<size_t>(r.tracked[j])] >= 0)
          bad(p + "tracked[" + std::to_string(j) + "]", "a block in the free queue is not held");
      }
      if (!r.tracked_ids.empty()) {
        if (list == &s.waiting) bad(p + "tracked_ids", "a waiting request holds no blocks");
        if (!s.has_pool) bad(p + "tracked_ids", "needs pool_table");
        if (static_cast<int64_t>(r.tracked_ids.size()) > r.blocks) bad(p + "tracked_ids", "more blocks than it holds");
        for (size_t j = 0; j < r.tracked_ids.size(); ++j) {
          auto it = s.pool.find(r.tracked_ids[j]);
          if (it == s.pool.end()) bad(p + "tracked_ids[" + std::to_string(j) + "]", "not a block of pool_table");
          if (it->second.ticket >= 0) bad(p + "tracked_ids[" + std::to_string(j) + "]", "a block in the free queue is not held");
        }
      }
      if (!r.block_keys.empty()) s.has_tracked = true;
      if (r.hit_blocks)
        for (size_t j = 0; j < r.hit_blocks->size(); ++j)
          if ((*r.hit_blocks)[j] >= n) bad(p + "hit_blocks[" + std::to_string(j) + "]", "not an index into tracked_blocks");
    }
}

}  // namespace

void Snapshot::set_output_lengths(const std::unordered_map<std::string, int64_t>& lengths) {
  for (auto* list : {&running, &waiting})
    for (auto& r : *list) {
      auto it = lengths.find(r.id);
      if (it != lengths.end()) r.predicted_output = it->second;
    }
}

Snapshot snapshot_from_value(const Value& v) {
  if (v.type != Value::Type::Map) bad("<root>", "snapshot must be a map");
  Snapshot s;
  const Value* schema = v.get("schema");
  if (schema == nullptr) schema = v.get("v");
  if (schema != nullptr && schema->type == Value::Type::Str && schema->s != "bear.snapshot/1")
    bad("schema", "expected bear.snapshot/1, got '" + schema->s + "'");
  s.instance = opt_str(v, "instance", "", "");
  s.model = opt_str(v, "model", "", "");
  s.generation = opt_int(v, "generation", "", 0, INT64_MAX, 0);
  s.seq = opt_int(v, "seq", "", 0, INT64_MAX, 0);
  s.time = opt_double(v, "time", "", 0.0);
  s.config = config_from(require(v, "config", ""));
  s.free_blocks = int_field(v, "free_blocks", "", 0, s.config.num_gpu_blocks);
  s.running = requests_from(require(v, "running", ""), "running", s.config);
  s.waiting = requests_from(require(v, "waiting", ""), "waiting", s.config);
  if (s.running.size() + s.waiting.size() > kMaxRequests) bad("running", "too many requests");
  std::unordered_set<std::string> seen;
  seen.reserve(s.running.size() + s.waiting.size());
  for (const auto* list : {&s.running, &s.waiting})
    for (const auto& r : *list)
      if (!seen.insert(r.id).second) bad("running/waiting", "duplicate request id '" + r.id + "'");
  tracked_from(v, s);
  const Value* inf = v.get("inflight");
  if (inf != nullptr && inf->type != Value::Type::Nil) {
    if (inf->type != Value::Type::Map) bad("inflight", "must be a map or null");
    Inflight fl;
    fl.started = opt_double(*inf, "started", "inflight.", s.time);
    const Value& items = require(*inf, "items", "inflight.");
    if (items.type != Value::Type::Arr) bad("inflight.items", "must be a list");
    if (items.arr.size() > kMaxRequests) bad("inflight.items", "too many items");
    for (size_t k = 0; k < items.arr.size(); ++k) {
      const std::string p = "inflight.items[" + std::to_string(k) + "].";
      const Value& it = items.arr[k];
      if (it.type != Value::Type::Map) bad(p, "must be a map");
      InflightItem x;
      x.id = id_field(it, p);
      x.n = int_field(it, "n", p, 1, kMaxTokens);
      x.context = int_field(it, "context", p, 0, kMaxTokens);
      fl.items.push_back(std::move(x));
    }
    s.inflight = std::move(fl);
  }
  return s;
}

std::unordered_map<std::string, int64_t> lengths_from_value(const Value& v) {
  if (v.type != Value::Type::Map) bad("output_lengths", "must be a map id -> tokens");
  std::unordered_map<std::string, int64_t> out;
  out.reserve(v.map.size());
  for (const auto& kv : v.map) out[kv.first] = as_int(kv.second, "output_lengths." + kv.first, 0, kMaxTokens);
  return out;
}

Value config_to_value(const Config& c) {
  Value d = map_value();
  d.map.reserve(14);
  d.map.emplace_back("max_num_batched_tokens", int_value(c.max_num_batched_tokens));
  d.map.emplace_back("max_num_scheduled_tokens", int_value(c.max_num_scheduled_tokens));
  d.map.emplace_back("max_num_seqs", int_value(c.max_num_seqs));
  d.map.emplace_back("long_prefill_token_threshold", int_value(c.long_prefill_token_threshold));
  d.map.emplace_back("long_prefill_token_threshold_adaptive", bool_value(c.long_prefill_token_threshold_adaptive));
  d.map.emplace_back("enable_chunked_prefill", bool_value(c.enable_chunked_prefill));
  d.map.emplace_back("policy", str_value(c.policy == Policy::Fcfs ? "fcfs" : "priority"));
  d.map.emplace_back("block_size", int_value(c.block_size));
  d.map.emplace_back("num_gpu_blocks", int_value(c.num_gpu_blocks));
  d.map.emplace_back("watermark_blocks", int_value(c.watermark_blocks));
  d.map.emplace_back("max_model_len", int_value(c.max_model_len));
  d.map.emplace_back("scheduler_reserve_full_isl", bool_value(c.scheduler_reserve_full_isl));
  d.map.emplace_back("enable_prefix_caching", bool_value(c.enable_prefix_caching));
  d.map.emplace_back("async_scheduling", bool_value(c.async_scheduling));
  return d;
}

Value snapshot_to_value(const Snapshot& s) {
  Value d = map_value();
  d.map.reserve(11);
  d.map.emplace_back("v", str_value("bear.snapshot/1"));
  d.map.emplace_back("instance", str_value(s.instance));
  d.map.emplace_back("model", str_value(s.model));
  if (s.generation != 0) d.map.emplace_back("generation", int_value(s.generation));
  d.map.emplace_back("seq", int_value(s.seq));
  d.map.emplace_back("time", real_value(s.time));
  d.map.emplace_back("config", config_to_value(s.config));
  d.map.emplace_back("free_blocks", int_value(s.free_blocks));
  for (const auto* list : {&s.running, &s.waiting}) {
    Value l = list_value();
    l.arr.reserve(list->size());
    for (const Request& r : *list) l.arr.push_back(request_to_value(r));
    d.map.emplace_back(list == &s.running ? "running" : "waiting", std::move(l));
  }
  d.map.emplace_back("inflight", Value{});  // sync scheduling: nothing in flight between steps
  if (!s.tracked_blocks.empty()) d.map.emplace_back("tracked_blocks", int_list_value(s.tracked_blocks));
  if (!s.tracked_keys.empty()) d.map.emplace_back("tracked_keys", int_list_value(s.tracked_keys));
  if (s.has_pool) {
    std::vector<int64_t> ids;
    ids.reserve(s.pool.size());
    for (const auto& kv : s.pool) ids.push_back(kv.first);
    std::sort(ids.begin(), ids.end());
    std::vector<int64_t> rows;
    rows.reserve(4 * ids.size());
    for (int64_t id : ids) {
      const PoolEntry& e = s.pool.at(id);
      rows.insert(rows.end(), {id, e.ticket, e.key, e.stamp});
    }
    d.map.emplace_back("pool_table", int_list_value(rows));
  }
  return d;
}

}  // namespace bea
