// vLLM V1 scheduling for one KV-cache group, as a reusable state machine: the BEA replay
// (estimate) and the simulated instance (sim engine) both drive this one implementation.
// Mirrors vllm/v1/core/sched/scheduler.py (vllm-scheduler-replay.md §3-§6, §10); KV blocks are
// counted by KvCache (kv_cache.h), the waiting queue is a WaitingQueue (request_queue.h).
#pragma once

#include <cstdint>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/block_ledger.h"
#include "bea/core/kv_cache.h"
#include "bea/core/request.h"
#include "bea/core/request_queue.h"
#include "bea/core/snapshot.h"

namespace bea {

class Scheduler {
 public:
  using Req = SchedRequest;
  struct Item {
    int32_t req;
    int64_t n, context;
    int64_t epoch;  // the request's preemption count when scheduled (stale detection)
    bool samples;   // the step reaches the end of the known sequence: a token is sampled
  };

  explicit Scheduler(const Config& cfg) : cfg_(cfg), kv_(cfg), waiting_(cfg.policy) {}

  // Residents, in snapshot order: the first n_running are running, the rest waiting.
  void load(const std::vector<Req>& reqs, size_t n_running, int64_t free_blocks);
  // A new arrival joins the waiting queue (FCFS: at the back; PRIORITY: by priority, arrival).
  int32_t add(const Req& r);

  // One schedule() call; fills `batch` (cleared first). Advances C at schedule time.
  void schedule(std::vector<Item>& batch);
  // One update_from_output() for an executed batch. Returns true when `watch` got a token.
  // Requests that stop are released and appended to `finished` when given.
  bool apply(const std::vector<Item>& batch, int32_t watch, std::vector<int32_t>* finished = nullptr);

  double batch_time(const std::vector<Item>& batch, const Coeffs& beta) const;
  // Eq. 12 terms of the batch the last schedule() produced (computed while scheduling).
  const BatchFeatures& last_features() const { return features_; }
  void add_features(const std::vector<Item>& batch, BatchFeatures& f) const;

  const Config& config() const { return cfg_; }
  const std::vector<Req>& reqs() const { return reqs_; }
  Req& req(int32_t k) { return reqs_[static_cast<size_t>(k)]; }
  const std::vector<int32_t>& running() const { return running_; }
  const WaitingQueue& waiting() const { return waiting_; }
  const KvCache& kv_cache() const { return kv_; }
  int64_t free_blocks() const { return kv_.free_blocks(); }
  // Drop a request (abort): blocks freed, removed from its queue.
  void abort(int32_t k);
  // Keep real blocks in `ledger` (the sim engine's prefix cache); nullptr: the count model alone.
  void set_ledger(BlockLedger* ledger) { ledger_ = ledger; }

 private:
  // The estimate's shortcuts work on the same state: sync_fast_path.h, decode_stretch.h.
  friend class SyncFastPath;
  friend int64_t fold_decode_stretch(Scheduler& s, double& now, const Coeffs& beta, int64_t max_steps);
  bool waiting_before(int32_t a, int32_t b) const;
  int64_t effective_lpt() const {
    return cfg_.long_prefill_token_threshold <= 0 ? 0 : adaptive_lpt();
  }
  int64_t adaptive_lpt() const;
  void finish(Req& r);
  // Running requests not counting finished ones the fast path has not removed yet.
  size_t n_running() const { return running_.size() - finished_in_running_; }
  void drop_finished_running();
  void preempt(int32_t v);
  bool admission_blocked(int64_t leftover) const;
  void admit_waiting(int64_t& budget, int64_t lpt, std::vector<Item>& batch);
  struct Admission {
    bool ok = false;
    int64_t n = 0, c0 = 0, total = 0, fresh = 0;
  };
  Admission plan_admission(int32_t wi, int64_t budget, int64_t lpt) const;
  void sync_free() {
    if (ledger_ != nullptr) kv_.set_free(ledger_->free_blocks());
  }

  Config cfg_;
  KvCache kv_;
  std::vector<Req> reqs_;
  std::vector<int32_t> running_;
  // Finished requests still in running_: the fast path removes them in bulk (drop_finished_running)
  // rather than one scan per finishing step; 0 whenever an exact step runs.
  size_t finished_in_running_ = 0;
  WaitingQueue waiting_;
  std::vector<int32_t> skipped_;
  BatchFeatures features_;
  BlockLedger* ledger_ = nullptr;
};

}  // namespace bea
