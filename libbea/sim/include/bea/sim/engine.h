// A live, stateful vLLM V1 engine core (sync scheduling) for the simulated instance: the same
// bea::Scheduler the BEA replay uses, driven step by step by a wall-clock loop outside.
// schedule() happens in step(); update_from_output() in finish_step() once the caller has spent
// the batch's (ground-truth) execution time.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/core/scheduler.h"
#include "bea/core/snapshot.h"
#include "bea/core/value.h"

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
  void add(const std::string& id, int64_t prompt_tokens, int64_t max_tokens, int64_t true_output_tokens,
           double arrival, int64_t priority);
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

 private:
  void compact();

  Scheduler sched_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int32_t> index_;  // live (unfinished) requests only
  std::vector<Scheduler::Item> batch_;
  std::vector<int64_t> out_before_;
  std::vector<int32_t> finished_;
  bool in_step_ = false;
  int64_t seq_ = 0;
};

}  // namespace bea
