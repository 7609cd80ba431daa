#include "bea/sim/engine.h"

#include "bea/core/request_fields.h"

#include <algorithm>
#include <stdexcept>

namespace bea {
namespace {

Config validated_config(const Value& config_value) {
  // Reuse the snapshot validator: an empty instance with this config.
  Value root;
  root.type = Value::Type::Map;
  root.map.emplace_back("config", config_value);
  Value zero;
  zero.type = Value::Type::Int;
  root.map.emplace_back("free_blocks", zero);
  Value empty;
  empty.type = Value::Type::Arr;
  root.map.emplace_back("running", empty);
  root.map.emplace_back("waiting", empty);
  Config cfg = snapshot_from_value(root).config;
  if (cfg.async_scheduling) throw std::invalid_argument("config.async_scheduling: the engine runs sync scheduling only");
  return cfg;
}

}  // namespace

Engine::Engine(const Value& config_value) : sched_(validated_config(config_value)) {
  const Config& cfg = sched_.config();
  if (cfg.enable_prefix_caching) {
    cache_ = std::make_unique<PrefixCache>(cfg.num_gpu_blocks, cfg.block_size);
    sched_.set_ledger(cache_.get());
  }
  sched_.load({}, 0, cfg.num_gpu_blocks);
}

void Engine::add(const std::string& id, int64_t prompt_tokens, int64_t max_tokens, int64_t true_output_tokens,
                 double arrival, int64_t priority, std::vector<uint64_t> block_hashes) {
  const Config& cfg = sched_.config();
  if (id.empty()) throw std::invalid_argument("request id must not be empty");
  if (prompt_tokens < 1 || prompt_tokens >= cfg.max_model_len)
    throw std::invalid_argument("prompt_tokens must be in [1, max_model_len)");
  if (max_tokens < 1 || max_tokens > kMaxTokens) throw std::invalid_argument("max_tokens must be >= 1");
  if (true_output_tokens < 1 || true_output_tokens > kMaxTokens)
    throw std::invalid_argument("true_output_tokens must be >= 1");
  if (priority < -kMaxTokens || priority > kMaxTokens) throw std::invalid_argument("priority out of range");
  if (index_.count(id) != 0) throw std::invalid_argument("duplicate request id '" + id + "'");
  const int32_t k = sched_.add(sched_arrival(prompt_tokens, max_tokens, true_output_tokens, 0, priority, arrival));
  if (static_cast<size_t>(k) != names_.size()) throw std::logic_error("engine: request index out of sync");
  names_.push_back(id);
  index_.emplace(id, k);
  if (cache_ != nullptr) {
    cache_->add(k, std::move(block_hashes));
    all_index_[id] = k;
  }
}

std::vector<KvEvent> Engine::take_kv_events() {
  return cache_ != nullptr ? cache_->take_events() : std::vector<KvEvent>{};
}

std::vector<uint64_t> Engine::cached_hashes() const {
  return cache_ != nullptr ? cache_->cached_hashes() : std::vector<uint64_t>{};
}

int64_t Engine::prefix_hit_tokens(const std::string& id) const {
  if (cache_ == nullptr) return -1;
  auto it = all_index_.find(id);
  return it == all_index_.end() ? -1 : cache_->first_hit_tokens(it->second);
}

Snapshot Engine::tracked_state(const std::vector<uint64_t>& query_hashes, Query& query) const {
  if (cache_ == nullptr) throw std::invalid_argument("tracked blocks need prefix caching");
  Snapshot snap = capture(sched_, names_);
  std::vector<int32_t> running(sched_.running().begin(), sched_.running().end());
  std::vector<int32_t> waiting(sched_.waiting().begin(), sched_.waiting().end());
  BlockTable t = cache_->table(running, waiting, query_hashes);
  snap.tracked_blocks = std::move(t.positions);
  for (size_t k = 0; k < running.size(); ++k) {
    snap.running[k].tracked = std::move(t.tracked[running[k]]);
    snap.running[k].block_keys = std::move(t.keys[running[k]]);
  }
  for (size_t k = 0; k < waiting.size(); ++k) {
    snap.waiting[k].hit_blocks = std::move(t.chains[waiting[k]]);
    snap.waiting[k].prefix_hit_tokens = t.hit_tokens[waiting[k]];
    snap.waiting[k].block_keys = std::move(t.keys[waiting[k]]);
  }
  snap.has_tracked = true;
  query.hit_blocks = std::move(t.query_chain);
  query.prefix_hit_tokens = t.query_hit_tokens;
  query.block_keys = std::move(t.query_keys);
  return snap;
}

bool Engine::abort(const std::string& id) {
  auto it = index_.find(id);
  if (it == index_.end()) return false;
  sched_.abort(it->second);
  if (cache_ != nullptr) cache_->forget(it->second);
  index_.erase(it);
  return true;
}

const std::vector<Scheduler::Item>& Engine::step() {
  if (in_step_) throw std::logic_error("engine: step() called while a step is open");
  // Keep memory bounded on a long-running instance: drop finished requests once they dominate.
  // Done here, between steps, so that no index handed out (batch, outputs) outlives the table.
  // (With prefix caching the cache model keeps allocation marks, so it is not compacted.)
  const size_t dead = names_.size() - index_.size();
  if (!sched_.config().enable_prefix_caching && dead > 4096 && dead > 2 * index_.size()) compact();
  sched_.schedule(batch_);
  out_before_.clear();
  for (const auto& it : batch_) out_before_.push_back(sched_.reqs()[static_cast<size_t>(it.req)].O);
  in_step_ = !batch_.empty();
  if (in_step_) ++seq_;
  return batch_;
}

std::vector<Engine::Output> Engine::finish_step() {
  std::vector<Output> out;
  if (!in_step_) return out;
  finished_.clear();
  sched_.apply(batch_, -1, &finished_);
  out.reserve(batch_.size());
  for (size_t k = 0; k < batch_.size(); ++k) {
    const int32_t ri = batch_[k].req;
    const Scheduler::Req& r = sched_.reqs()[static_cast<size_t>(ri)];
    if (r.O > out_before_[k]) out.push_back({ri, r.O, r.finished});
  }
  for (int32_t f : finished_) {
    index_.erase(names_[static_cast<size_t>(f)]);
    if (cache_ != nullptr) cache_->forget(f);
  }
  in_step_ = false;
  return out;
}

void Engine::compact() {
  std::vector<Scheduler::Req> keep;
  std::vector<std::string> names;
  keep.reserve(index_.size());
  names.reserve(index_.size());
  for (int32_t k : sched_.running()) {
    keep.push_back(sched_.reqs()[static_cast<size_t>(k)]);
    names.push_back(names_[static_cast<size_t>(k)]);
  }
  const size_t n_running = keep.size();
  for (int32_t k : sched_.waiting()) {
    keep.push_back(sched_.reqs()[static_cast<size_t>(k)]);
    names.push_back(names_[static_cast<size_t>(k)]);
  }
  sched_.load(keep, n_running, sched_.free_blocks());
  names_ = std::move(names);
  index_.clear();
  for (size_t k = 0; k < names_.size(); ++k) index_.emplace(names_[k], static_cast<int32_t>(k));
}

}  // namespace bea
