// A live, stateful vLLM V1 engine core (sync scheduling) for the simulated instance: the same
// bea::Scheduler the BEA replay uses, driven step by step by a wall-clock loop outside.
// schedule() happens in step(); update_from_output() in finish_step() once the caller has spent
// the batch's (ground-truth) execution time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/core/scheduler.h"
#include "bea/core/snapshot.h"
#include "bea/core/value.h"
#include "bea/sim/prefix_cache.h"

namespace bea {

class Engine {
 public:
  struct Output {
    int32_t req;            // index into reqs()/name()
    int64_t output_tokens;  // O after the step
    bool finished;
  };

  // `config_value`: a bear.snapshot/1 `config` map (validated with the snapshot's own rules).
  explicit Engine(const Value& config_value);

  // A new request joins the waiting queue; `true_output_tokens` is when it stops (the workload's
  // drawn length; capped by max_tokens and max_model_len). Throws on a duplicate id or bad sizes.
  // With prefix caching on, `block_hashes` names its full blocks (prompt, then answer tokens) as
  // vLLM hashes them: admission finds its hit in the engine's block-level cache (prefix_cache.h).
  void add(const std::string& id, int64_t prompt_tokens, int64_t max_tokens, int64_t true_output_tokens,
           double arrival, int64_t priority, std::vector<uint64_t> block_hashes = {});
  // Drop a request (client went away); false when unknown or already finished.
  bool abort(const std::string& id);

  // schedule(): the batch to execute now (empty when nothing can run). Throws while a step is open.
  const std::vector<Scheduler::Item>& step();
  // update_from_output() for the open step: which requests received a token, which finished.
  std::vector<Output> finish_step();

  bool in_step() const { return in_step_; }
  bool has_work() const { return !sched_.running().empty() || !sched_.waiting().empty(); }
  int64_t seq() const { return seq_; }
  const Scheduler& scheduler() const { return sched_; }
  const std::string& name(int32_t k) const { return names_[static_cast<size_t>(k)]; }
  size_t live() const { return index_.size(); }
  size_t table_size() const { return names_.size(); }  // live + finished not yet compacted
  const std::vector<std::string>& names() const { return names_; }  // by request index
  // The prefix cache's KV events since the last call (stored / removed), in the engine's order.
  std::vector<KvEvent> take_kv_events();
  // Every cached block's hash; the hit request `id` had at its first admission (-1: none yet).
  std::vector<uint64_t> cached_hashes() const;
  int64_t prefix_hit_tokens(const std::string& id) const;
  bool has_prefix_cache() const { return cache_ != nullptr; }
  // The state as a snapshot model with its tracked-block table for a query whose full blocks
  // hash to `query_hashes` (prefix caching on): each waiting request's hit chain and current hit
  // (prefix_hit_tokens); `query_chain` / `query_hit_tokens` receive the query's.
  Snapshot tracked_state(const std::vector<uint64_t>& query_hashes, Query& query) const;

 private:
  void compact();

  std::unique_ptr<PrefixCache> cache_;  // with prefix caching: the real blocks (the scheduler points here)
  Scheduler sched_;
  std::unordered_map<std::string, int32_t> all_index_;  // every request ever added (prefix-hit lookup)
  std::vector<std::string> names_;
  std::unordered_map<std::string, int32_t> index_;  // live (unfinished) requests only
  std::vector<Scheduler::Item> batch_;
  std::vector<int64_t> out_before_;
  std::vector<int32_t> finished_;
  bool in_step_ = false;
  int64_t seq_ = 0;
};

}  // namespace bea
