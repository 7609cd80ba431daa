#include "bea/core/snapshot_delta.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "bea/core/request_fields.h"
#include "value_fields.h"

namespace bea {
namespace {

using namespace fields;

constexpr const char* kSchema = "bear.delta/1";
constexpr size_t kSetWidth = 8;  // pos, computed, output, blocks, exclusive, preemptions, prefix hit, placeholders
constexpr int64_t kMaxPlaceholders = 1 << 16;

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument("delta: " + what); }

// An optional list of integers (absent or nil: empty).
const std::vector<Value>& int_list(const Value& v, const char* key) {
  static const std::vector<Value> none;
  const Value* l = v.get(key);
  if (l == nullptr || l->type == Value::Type::Nil) return none;
  if (l->type != Value::Type::Arr) bad(std::string("delta.") + key, "must be a list");
  if (l->arr.size() > kMaxRequests * kSetWidth) bad(std::string("delta.") + key, "too long");
  return l->arr;
}

// An element of a delta's integer list, in [lo, hi]; the field is named only on an error.
int64_t int_at(const Value& x, const char* list, size_t k, int64_t lo, int64_t hi) {
  if (x.type == Value::Type::Int && x.i >= lo && x.i <= hi) return x.i;
  return as_int(x, std::string("delta.") + list + "[" + std::to_string(k) + "]", lo, hi);
}

// Strictly ascending positions below `limit`.
std::vector<size_t> positions(const Value& v, const char* key, size_t limit) {
  const auto& l = int_list(v, key);
  std::vector<size_t> out;
  out.reserve(l.size());
  for (size_t k = 0; k < l.size(); ++k) {
    const auto p = static_cast<size_t>(int_at(l[k], key, k, 0, static_cast<int64_t>(limit) - 1));
    if (!out.empty() && p <= out.back())
      bad(std::string("delta.") + key + "[" + std::to_string(k) + "]", "positions must be strictly ascending");
    out.push_back(p);
  }
  return out;
}

// Remove the elements at sorted `pos` (relative to the vector) keeping the others' order; only
// the elements after the first removed one move.
void erase_sorted(std::vector<Request>& v, const std::vector<size_t>& pos, std::vector<Request>* out = nullptr) {
  if (pos.empty()) return;
  size_t w = pos.front(), next = 0;
  for (size_t r = pos.front(); r < v.size(); ++r) {
    if (next < pos.size() && pos[next] == r) {
      if (out != nullptr) out->push_back(std::move(v[r]));
      ++next;
      continue;
    }
    if (w != r) v[w] = std::move(v[r]);
    ++w;
  }
  v.erase(v.begin() + static_cast<std::ptrdiff_t>(w), v.end());
}

Request& at(Snapshot& s, size_t pos) { return pos < s.running.size() ? s.running[pos] : s.waiting[pos - s.running.size()]; }

// The field of a changed resident that is out of its bounds, or nullptr.
const char* bad_field(const Request& r, const Config& cfg) {
  if (r.output_tokens < 0 || r.output_tokens > kMaxTokens) return "output_tokens";
  if (r.placeholders < 0 || r.placeholders > kMaxPlaceholders) return "placeholders";
  if (r.computed_tokens < 0 || r.computed_tokens > r.prompt_tokens + r.output_tokens + r.placeholders)
    return "computed_tokens";
  if (r.blocks < 0 || r.blocks > cfg.num_gpu_blocks) return "blocks";
  if (r.exclusive_blocks < 0 || r.exclusive_blocks > r.blocks) return "exclusive_blocks";
  if (r.preemptions < 0 || r.preemptions > kMaxTokens) return "preemptions";
  if (r.prefix_hit_tokens < 0 || r.prefix_hit_tokens > kMaxTokens) return "prefix_hit_tokens";
  return nullptr;
}

void check_row(const Request& r, const Config& cfg, size_t pos) {
  if (const char* f = bad_field(r, cfg))
    refuse("resident " + std::to_string(pos) + " ('" + r.id + "') " + f + " out of range");
}

// A delta's change of the table in stable form (`pool`), read and checked against the state's
// shape before anything changes; what depends on the state after the list changes (a tracked
// prefix's start, a dropped block's presence) is checked as it is applied.
struct PoolChange {
  std::vector<std::pair<int64_t, PoolEntry>> put;
  std::vector<int64_t> drop;
  struct Tracked {
    size_t pos, start;
    std::vector<int64_t> ids;
  };
  std::vector<Tracked> tracked;
  std::vector<std::pair<size_t, std::vector<int64_t>>> keys;
};

const std::vector<Value>& pool_list(const Value& m, const char* key) {
  static const std::vector<Value> none;
  const Value* l = m.get(key);
  if (l == nullptr || l->type == Value::Type::Nil) return none;
  if (l->type != Value::Type::Arr) bad(std::string("delta.pool.") + key, "must be a list of integers");
  return l->arr;
}

int64_t pool_int(const std::vector<Value>& l, const char* key, size_t k, int64_t lo, int64_t hi) {
  if (k >= l.size()) bad(std::string("delta.pool.") + key, "a row runs past the end");
  const Value& x = l[k];
  if (x.type == Value::Type::Int && x.i >= lo && x.i <= hi) return x.i;
  return as_int(x, std::string("delta.pool.") + key + "[" + std::to_string(k) + "]", lo, hi);
}

PoolChange pool_change(const Value& m, const Config& cfg, size_t n_running, size_t n_residents) {
  if (m.type != Value::Type::Map) bad("delta.pool", "must be a map");
  PoolChange c;
  const int64_t top = cfg.num_gpu_blocks - 1;
  const auto& put = pool_list(m, "put");
  if (put.size() % 4 != 0) bad("delta.pool.put", "must hold rows of 4 integers");
  c.put.reserve(put.size() / 4);
  for (size_t k = 0; k < put.size(); k += 4) {
    PoolEntry e;
    const int64_t id = pool_int(put, "put", k, 0, top);
    e.ticket = pool_int(put, "put", k + 1, -1, INT64_MAX);
    e.key = pool_int(put, "put", k + 2, -1, INT64_MAX);
    e.stamp = pool_int(put, "put", k + 3, -1, INT64_MAX);
    c.put.emplace_back(id, e);
  }
  const auto& drop = pool_list(m, "drop");
  c.drop.reserve(drop.size());
  for (size_t k = 0; k < drop.size(); ++k) c.drop.push_back(pool_int(drop, "drop", k, 0, top));
  const auto& tr = pool_list(m, "tracked");
  for (size_t k = 0; k < tr.size();) {
    PoolChange::Tracked t;
    t.pos = static_cast<size_t>(pool_int(tr, "tracked", k, 0, static_cast<int64_t>(n_running) - 1));
    t.start = static_cast<size_t>(pool_int(tr, "tracked", k + 1, 0, cfg.num_gpu_blocks));
    const auto n = static_cast<size_t>(pool_int(tr, "tracked", k + 2, 0, cfg.num_gpu_blocks));
    if (n > tr.size() - k - 3) bad("delta.pool.tracked", "a row runs past the end");
    t.ids.reserve(n);
    for (size_t j = 0; j < n; ++j) t.ids.push_back(pool_int(tr, "tracked", k + 3 + j, 0, top));
    k += 3 + n;
    c.tracked.push_back(std::move(t));
  }
  const auto& ks = pool_list(m, "keys");
  for (size_t k = 0; k < ks.size();) {
    const auto pos = static_cast<size_t>(pool_int(ks, "keys", k, 0, static_cast<int64_t>(n_residents) - 1));
    const auto n = static_cast<size_t>(pool_int(ks, "keys", k + 1, 0, kMaxTokens));
    if (n > ks.size() - k - 2) bad("delta.pool.keys", "a row runs past the end");
    std::vector<int64_t> keys;
    keys.reserve(n);
    for (size_t j = 0; j < n; ++j) keys.push_back(pool_int(ks, "keys", k + 2 + j, 0, INT64_MAX));
    k += 2 + n;
    c.keys.emplace_back(pos, std::move(keys));
  }
  return c;
}

// Apply the table's change (the lists already changed): drops, puts, the running requests'
// tracked blocks, keys. Throws (the state is then broken) on a change that does not fit it.
void apply_pool(Snapshot& s, PoolChange& c, int64_t free_blocks) {
  for (int64_t id : c.drop) {
    auto it = s.pool.find(id);
    if (it == s.pool.end()) refuse("pool.drop: block " + std::to_string(id) + " is not in the table");
    s.pool_free -= it->second.ticket >= 0;
    s.pool.erase(it);
  }
  for (const auto& [id, e] : c.put) {
    auto [it, fresh] = s.pool.try_emplace(id, e);
    if (!fresh) {
      s.pool_free -= it->second.ticket >= 0;
      it->second = e;
    }
    s.pool_free += e.ticket >= 0;
  }
  if (s.pool_free > free_blocks) refuse("pool: more free blocks in the table than free_blocks");
  for (auto& t : c.tracked) {
    if (t.pos >= s.running.size()) refuse("pool.tracked: not a running request");
    Request& r = s.running[t.pos];
    if (t.start > r.tracked_ids.size()) refuse("pool.tracked: a prefix starts past the blocks tracked");
    r.tracked_ids.resize(t.start);
    r.tracked_ids.insert(r.tracked_ids.end(), t.ids.begin(), t.ids.end());
    if (static_cast<int64_t>(r.tracked_ids.size()) > r.blocks) refuse("pool.tracked: more blocks than it holds");
  }
  for (auto& [pos, keys] : c.keys) {
    if (pos >= s.running.size() + s.waiting.size()) refuse("pool.keys: not a resident");
    at(s, pos).block_keys = std::move(keys);
  }
}

}  // namespace

DeltaHeader delta_header(const Value& v) {
  if (v.type != Value::Type::Map) bad("<root>", "delta must be a map");
  const Value* schema = v.get("v");
  if (schema == nullptr) schema = v.get("schema");
  if (schema == nullptr || schema->type != Value::Type::Str) bad("v", "missing (expected bear.delta/1)");
  if (schema->s != kSchema) bad("v", "expected bear.delta/1, got '" + schema->s + "'");
  DeltaHeader h;
  h.instance = opt_str(v, "instance", "", "");
  h.generation = opt_int(v, "generation", "", 0, INT64_MAX, 0);
  h.base = int_field(v, "base", "", 0, INT64_MAX - 1);
  h.seq = int_field(v, "seq", "", h.base + 1, INT64_MAX);
  if (v.get("base_time") == nullptr) bad("base_time", "missing");
  h.base_time = opt_double(v, "base_time", "", 0.0);
  h.time = opt_double(v, "time", "", 0.0);
  h.idle = opt_bool(v, "idle", "", false);
  return h;
}

ResidentIds resident_ids(const Snapshot& s) {
  ResidentIds ids;
  ids.reserve(s.running.size() + s.waiting.size());
  for (const auto* l : {&s.running, &s.waiting})
    for (const auto& r : *l) ids.insert(r.id);
  return ids;
}

std::vector<std::string> apply_delta(Snapshot& s, ResidentIds& ids, const Value& v, const DeltaHeader& h,
                                     const LengthLookup& predicted) {
  if (h.generation != s.generation)
    refuse("generation " + std::to_string(h.generation) + " does not match the state's " + std::to_string(s.generation));
  if (h.base != s.seq)
    refuse("applies to seq " + std::to_string(h.base) + ", the state is at seq " + std::to_string(s.seq));
  if (h.base_time != s.time) refuse("applies to the state captured at another time");
  const Config& cfg = s.config;

  // ---- validate the body against the state's shape (nothing changes until this is done) ----
  const size_t n_run = s.running.size(), n_old = n_run + s.waiting.size();
  const std::vector<size_t> removed = positions(v, "removed", n_old);
  const size_t removed_running = static_cast<size_t>(
      std::lower_bound(removed.begin(), removed.end(), n_run) - removed.begin());
  const size_t r0 = n_run - removed_running, w0 = s.waiting.size() - (removed.size() - removed_running);
  const std::vector<size_t> preempted = positions(v, "preempted", r0);

  std::vector<Request> added;
  std::vector<std::string> added_ids;
  if (const Value* a = v.get("added"); a != nullptr && a->type != Value::Type::Nil) {
    if (a->type != Value::Type::Arr) bad("delta.added", "must be a list");
    if (n_old - removed.size() + a->arr.size() > kMaxRequests) bad("delta.added", "too many requests");
    ResidentIds gone;
    for (size_t p : removed) gone.insert(at(s, p).id);
    ResidentIds fresh;
    added.reserve(a->arr.size());
    for (size_t k = 0; k < a->arr.size(); ++k) {
      const std::string path = "delta.added[" + std::to_string(k) + "]";
      Request r = request_from_value(a->arr[k], path, cfg);
      if ((ids.count(r.id) != 0 && gone.count(r.id) == 0) || !fresh.insert(r.id).second)
        bad(path + ".id", "duplicate request id '" + r.id + "'");
      if (predicted) r.predicted_output = predicted(r.id);
      r.tracked.clear();  // the table's references come in the delta's `pool` (block_keys: its `keys`)
      r.hit_blocks.reset();
      r.block_keys.clear();
      r.tracked_ids.clear();
      added_ids.push_back(r.id);
      added.push_back(std::move(r));
    }
  }
  const size_t w1 = preempted.size() + w0 + added.size();
  // admitted: the first k of the queue (an int), or queue positions in the order they join running
  size_t admitted = 0;
  std::vector<size_t> admitted_at;
  if (const Value* a = v.get("admitted"); a != nullptr && a->type == Value::Type::Arr) {
    std::vector<char> taken(w1, 0);
    for (size_t k = 0; k < a->arr.size(); ++k) {
      const auto p = static_cast<size_t>(int_at(a->arr[k], "admitted", k, 0, static_cast<int64_t>(w1) - 1));
      if (taken[p]++) bad("delta.admitted[" + std::to_string(k) + "]", "position admitted twice");
      admitted_at.push_back(p);
    }
    admitted = admitted_at.size();
  } else {
    admitted = static_cast<size_t>(opt_int(v, "admitted", "delta.", 0, static_cast<int64_t>(w1), 0));
  }
  // waiting_order: the rest of the queue in a new order (a permutation), when not the queue's own
  std::vector<size_t> order;
  if (const Value* o = v.get("waiting_order"); o != nullptr && o->type != Value::Type::Nil) {
    if (o->type != Value::Type::Arr || o->arr.size() != w1 - admitted)
      bad("delta.waiting_order", "must be a permutation of the waiting queue");
    std::vector<char> taken(w1 - admitted, 0);
    for (size_t k = 0; k < o->arr.size(); ++k) {
      const auto p =
          static_cast<size_t>(int_at(o->arr[k], "waiting_order", k, 0, static_cast<int64_t>(w1 - admitted) - 1));
      if (taken[p]++) bad("delta.waiting_order[" + std::to_string(k) + "]", "position given twice");
      order.push_back(p);
    }
  }
  const size_t r_new = r0 - preempted.size() + admitted, n_new = n_old - removed.size() + added.size();

  int64_t adv_m = 0, adv_c = 0, adv_o = 0;
  if (const Value* a = v.get("advance"); a != nullptr && a->type != Value::Type::Nil) {
    if (a->type != Value::Type::Arr || a->arr.size() != 3) bad("delta.advance", "must be [m, computed, output]");
    adv_m = as_int(a->arr[0], "delta.advance[0]", 0, static_cast<int64_t>(r_new));
    adv_c = as_int(a->arr[1], "delta.advance[1]", 0, kMaxTokens);
    adv_o = as_int(a->arr[2], "delta.advance[2]", 0, kMaxTokens);
  }
  const auto& sets = int_list(v, "set");
  if (sets.size() % kSetWidth != 0) bad("delta.set", "must hold rows of 8 integers");
  std::vector<int64_t> set_vals(sets.size());
  for (size_t k = 0; k < sets.size(); ++k) {
    const bool is_pos = k % kSetWidth == 0;
    set_vals[k] = int_at(sets[k], "set", k, is_pos ? 0 : -kMaxTokens, is_pos ? static_cast<int64_t>(n_new) - 1 : kMaxTokens);
  }
  const int64_t free_blocks = int_field(v, "free_blocks", "delta.", 0, cfg.num_gpu_blocks);
  std::optional<PoolChange> pool;
  if (const Value* m = v.get("pool"); m != nullptr && m->type != Value::Type::Nil) {
    PoolChange c = pool_change(*m, cfg, r_new, n_new);  // checked either way
    if (s.has_pool) pool = std::move(c);  // else: the state has counts only until a full snapshot brings the table
  }

  std::optional<Inflight> inflight;
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> inflight_refs;
  if (const Value* f = v.get("inflight"); f != nullptr && f->type != Value::Type::Nil) {
    if (f->type != Value::Type::Map) bad("delta.inflight", "must be a map or null");
    Inflight fl;
    fl.started = opt_double(*f, "started", "delta.inflight.", h.time);
    std::vector<std::string> orphans;
    if (const Value* o = f->get("orphans"); o != nullptr && o->type != Value::Type::Nil) {
      if (o->type != Value::Type::Arr || o->arr.size() > kMaxRequests) bad("delta.inflight.orphans", "must be a list");
      for (size_t k = 0; k < o->arr.size(); ++k) {
        if (o->arr[k].type != Value::Type::Str || o->arr[k].s.empty())
          bad("delta.inflight.orphans[" + std::to_string(k) + "]", "must be a non-empty string");
        orphans.push_back(o->arr[k].s);
      }
    }
    const auto& items = int_list(*f, "items");
    if (items.size() % 3 != 0) bad("delta.inflight.items", "must hold rows of 3 integers");
    for (size_t k = 0; k < items.size(); k += 3) {
      const int64_t ref =
          int_at(items[k], "inflight.items", k, -static_cast<int64_t>(orphans.size()), static_cast<int64_t>(n_new) - 1);
      const int64_t n = int_at(items[k + 1], "inflight.items", k + 1, 1, kMaxTokens);
      const int64_t ctx = int_at(items[k + 2], "inflight.items", k + 2, 0, kMaxTokens);
      inflight_refs.push_back({ref, {n, ctx}});
    }
    fl.items.reserve(inflight_refs.size());
    for (const auto& [ref, nc] : inflight_refs) {
      InflightItem it;
      if (ref < 0) it.id = orphans[static_cast<size_t>(-ref - 1)];
      it.n = nc.first;
      it.context = nc.second;
      fl.items.push_back(std::move(it));
    }
    inflight = std::move(fl);
  }

  // ---- apply: removals, preemptions, arrivals, admissions (vLLM's order of list changes) ----
  for (size_t p : removed) ids.erase(at(s, p).id);
  std::vector<size_t> rm_run(removed.begin(), removed.begin() + static_cast<std::ptrdiff_t>(removed_running));
  std::vector<size_t> rm_wait;
  rm_wait.reserve(removed.size() - removed_running);
  for (size_t k = removed_running; k < removed.size(); ++k) rm_wait.push_back(removed[k] - n_run);
  erase_sorted(s.running, rm_run);
  erase_sorted(s.waiting, rm_wait);
  if (!preempted.empty()) {
    std::vector<Request> front;
    front.reserve(preempted.size());
    erase_sorted(s.running, preempted, &front);
    for (Request& r : front) r.tracked_ids.clear();  // a waiting request holds no blocks
    s.waiting.insert(s.waiting.begin(), std::make_move_iterator(front.begin()), std::make_move_iterator(front.end()));
  }
  for (auto& r : added) ids.insert(r.id);
  s.waiting.insert(s.waiting.end(), std::make_move_iterator(added.begin()), std::make_move_iterator(added.end()));
  if (!admitted_at.empty()) {
    for (size_t p : admitted_at) s.running.push_back(std::move(s.waiting[p]));
    std::sort(admitted_at.begin(), admitted_at.end());
    erase_sorted(s.waiting, admitted_at);
  } else if (admitted > 0) {
    const auto end = s.waiting.begin() + static_cast<std::ptrdiff_t>(admitted);
    s.running.insert(s.running.end(), std::make_move_iterator(s.waiting.begin()), std::make_move_iterator(end));
    s.waiting.erase(s.waiting.begin(), end);
  }
  if (!order.empty()) {
    std::vector<Request> rest;
    rest.reserve(order.size());
    for (size_t p : order) rest.push_back(std::move(s.waiting[p]));
    s.waiting = std::move(rest);
  }

  // ---- field changes: the common advance, then the explicit rows; then check what changed ----
  for (int64_t k = 0; k < adv_m; ++k) {
    Request& r = s.running[static_cast<size_t>(k)];
    r.computed_tokens += adv_c;
    r.output_tokens += adv_o;
  }
  for (size_t k = 0; k < set_vals.size(); k += kSetWidth) {
    Request& r = at(s, static_cast<size_t>(set_vals[k]));
    r.computed_tokens = set_vals[k + 1];
    r.output_tokens = set_vals[k + 2];
    r.blocks = set_vals[k + 3];
    r.exclusive_blocks = set_vals[k + 4];
    r.preemptions = set_vals[k + 5];
    r.prefix_hit_tokens = set_vals[k + 6];
    r.placeholders = set_vals[k + 7];
  }
  for (int64_t k = 0; k < adv_m; ++k) check_row(s.running[static_cast<size_t>(k)], cfg, static_cast<size_t>(k));
  for (size_t k = 0; k < set_vals.size(); k += kSetWidth) {
    const auto pos = static_cast<size_t>(set_vals[k]);
    check_row(at(s, pos), cfg, pos);
  }
  if (inflight) {
    size_t j = 0;
    for (const auto& [ref, nc] : inflight_refs) {
      if (ref >= 0) inflight->items[j].id = at(s, static_cast<size_t>(ref)).id;
      ++j;
    }
  }
  s.inflight = std::move(inflight);
  if (pool) {
    apply_pool(s, *pool, free_blocks);
  } else if (s.has_tracked) {  // the free queue moved: the table no longer describes it
    s.pool.clear();
    s.pool_free = 0;
    s.has_pool = false;
    s.tracked_blocks.clear();
    s.tracked_keys.clear();
    for (auto* list : {&s.running, &s.waiting})
      for (auto& r : *list) {
        r.tracked.clear();
        r.hit_blocks.reset();
        r.block_keys.clear();
        r.tracked_ids.clear();
      }
    s.has_tracked = false;
  }
  s.free_blocks = free_blocks;
  s.seq = h.seq;
  s.time = h.time;
  if (s.running.size() != r_new || s.running.size() + s.waiting.size() != n_new) refuse("internal: sizes disagree");
  return added_ids;
}

namespace {

template <typename T>
bool differ(std::ostringstream& out, const std::string& what, const T& a, const T& b) {
  if (a == b) return false;
  out << what << ": " << a << " != " << b;
  return true;
}

bool request_differs(std::ostringstream& o, const std::string& p, const Request& a, const Request& b) {
  return differ(o, p + ".id", a.id, b.id) || differ(o, p + ".prompt_tokens", a.prompt_tokens, b.prompt_tokens) ||
         differ(o, p + ".computed_tokens", a.computed_tokens, b.computed_tokens) ||
         differ(o, p + ".output_tokens", a.output_tokens, b.output_tokens) ||
         differ(o, p + ".max_tokens", a.max_tokens, b.max_tokens) || differ(o, p + ".blocks", a.blocks, b.blocks) ||
         differ(o, p + ".exclusive_blocks", a.exclusive_blocks, b.exclusive_blocks) ||
         differ(o, p + ".preemptions", a.preemptions, b.preemptions) ||
         differ(o, p + ".placeholders", a.placeholders, b.placeholders) ||
         differ(o, p + ".prefix_hit_tokens", a.prefix_hit_tokens, b.prefix_hit_tokens) ||
         differ(o, p + ".priority", a.priority, b.priority) || differ(o, p + ".arrival", a.arrival, b.arrival);
}

}  // namespace

std::string snapshot_difference(const Snapshot& a, const Snapshot& b, bool compare_time) {
  std::ostringstream o;
  o.precision(17);
  if (differ(o, "generation", a.generation, b.generation) || differ(o, "seq", a.seq, b.seq) ||
      (compare_time && differ(o, "time", a.time, b.time)) || differ(o, "free_blocks", a.free_blocks, b.free_blocks))
    return o.str();
  for (const auto& [name, la, lb] : {std::tuple{"running", &a.running, &b.running},
                                     std::tuple{"waiting", &a.waiting, &b.waiting}}) {
    if (differ(o, std::string(name) + " length", la->size(), lb->size())) return o.str();
    for (size_t k = 0; k < la->size(); ++k)
      if (request_differs(o, std::string(name) + "[" + std::to_string(k) + "]", (*la)[k], (*lb)[k])) return o.str();
  }
  if (a.has_pool || b.has_pool) {
    if (differ(o, "pool_table given", a.has_pool, b.has_pool) || differ(o, "pool_table length", a.pool.size(), b.pool.size()))
      return o.str();
    for (const auto& [id, e] : a.pool) {
      auto it = b.pool.find(id);
      const std::string p = "pool_table block " + std::to_string(id);
      if (it == b.pool.end()) return p + ": only in the first";
      if (differ(o, p + " ticket", e.ticket, it->second.ticket) || differ(o, p + " key", e.key, it->second.key) ||
          differ(o, p + " stamp", e.stamp, it->second.stamp))
        return o.str();
    }
    for (const auto& [name, la, lb] : {std::tuple{"running", &a.running, &b.running},
                                       std::tuple{"waiting", &a.waiting, &b.waiting}})
      for (size_t k = 0; k < la->size(); ++k) {
        const std::string p = std::string(name) + "[" + std::to_string(k) + "]";
        if ((*la)[k].tracked_ids != (*lb)[k].tracked_ids) return p + ".tracked_ids differ";
        if ((*la)[k].block_keys != (*lb)[k].block_keys) return p + ".block_keys differ";
      }
  }
  if (differ(o, "inflight", a.inflight.has_value(), b.inflight.has_value())) return o.str();
  if (a.inflight) {
    const Inflight &x = *a.inflight, &y = *b.inflight;
    if (differ(o, "inflight.started", x.started, y.started) ||
        differ(o, "inflight.items length", x.items.size(), y.items.size()))
      return o.str();
    for (size_t k = 0; k < x.items.size(); ++k) {
      const std::string p = "inflight.items[" + std::to_string(k) + "]";
      if (differ(o, p + ".id", x.items[k].id, y.items[k].id) || differ(o, p + ".n", x.items[k].n, y.items[k].n) ||
          differ(o, p + ".context", x.items[k].context, y.items[k].context))
        return o.str();
    }
  }
  return "";
}

}  // namespace bea
