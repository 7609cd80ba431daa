#include "bea/core/snapshot.h"

#include <cmath>
#include <stdexcept>
#include <unordered_set>

namespace bea {
namespace {

[[noreturn]] void bad(const std::string& field, const std::string& why) {
  throw std::invalid_argument("snapshot field '" + field + "': " + why);
}

const Value& require(const Value& m, const char* key, const std::string& path) {
  const Value* v = m.get(key);
  if (v == nullptr) bad(path + key, "missing");
  return *v;
}

int64_t as_int(const Value& v, const std::string& field, int64_t lo, int64_t hi) {
  int64_t x = 0;
  if (v.type == Value::Type::Int) {
    x = v.i;
  } else if (v.type == Value::Type::Float && std::isfinite(v.d) && v.d == std::floor(v.d) &&
             std::fabs(v.d) < 9.0e15) {
    x = static_cast<int64_t>(v.d);
  } else {
    bad(field, "must be an integer");
  }
  if (x < lo || x > hi) bad(field, "out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

int64_t int_field(const Value& m, const char* key, const std::string& path, int64_t lo, int64_t hi) {
  return as_int(require(m, key, path), path + key, lo, hi);
}

int64_t opt_int(const Value& m, const char* key, const std::string& path, int64_t lo, int64_t hi,
                int64_t dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  return as_int(*v, path + key, lo, hi);
}

double opt_double(const Value& m, const char* key, const std::string& path, double dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  double x = v->type == Value::Type::Int ? static_cast<double>(v->i)
             : v->type == Value::Type::Float ? v->d
                                             : (bad(path + key, "must be a number"), 0.0);
  if (!std::isfinite(x)) bad(path + key, "must be finite");
  return x;
}

bool opt_bool(const Value& m, const char* key, const std::string& path, bool dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  if (v->type == Value::Type::Bool) return v->b;
  if (v->type == Value::Type::Int && (v->i == 0 || v->i == 1)) return v->i == 1;
  bad(path + key, "must be a boolean");
}

std::string opt_str(const Value& m, const char* key, const std::string& path, const std::string& dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  if (v->type != Value::Type::Str) bad(path + key, "must be a string");
  return v->s;
}

std::string id_field(const Value& m, const std::string& path) {
  const Value& v = require(m, "id", path);
  if (v.type != Value::Type::Str) bad(path + "id", "must be a string");
  if (v.s.empty()) bad(path + "id", "must not be empty");
  return v.s;
}

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

Request request_from(const Value& r, const std::string& path, const Config& cfg) {
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
  return q;
}

std::vector<Request> requests_from(const Value& list, const std::string& name, const Config& cfg) {
  if (list.type != Value::Type::Arr) bad(name, "must be a list");
  if (list.arr.size() > kMaxRequests) bad(name, "too many requests");
  std::vector<Request> out;
  out.reserve(list.arr.size());
  for (size_t k = 0; k < list.arr.size(); ++k)
    out.push_back(request_from(list.arr[k], name + "[" + std::to_string(k) + "]", cfg));
  return out;
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
  return q;
}

std::unordered_map<std::string, int64_t> lengths_from_value(const Value& v) {
  if (v.type != Value::Type::Map) bad("output_lengths", "must be a map id -> tokens");
  std::unordered_map<std::string, int64_t> out;
  out.reserve(v.map.size());
  for (const auto& kv : v.map) out[kv.first] = as_int(kv.second, "output_lengths." + kv.first, 0, kMaxTokens);
  return out;
}

}  // namespace bea
