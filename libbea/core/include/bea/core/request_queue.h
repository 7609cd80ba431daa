// vLLM's waiting queue (v1/core/sched/request_queue.py): FCFS, or ordered by (priority, arrival)
// under PRIORITY. It holds request indices only; the PRIORITY order is the caller's `before`.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>

#include "bea/core/snapshot.h"

namespace bea {

class WaitingQueue {
 public:
  using const_iterator = std::deque<int32_t>::const_iterator;

  explicit WaitingQueue(Policy policy) : policy_(policy) {}

  void clear() { q_.clear(); }
  // A request in snapshot order (a snapshot lists its waiting queue in queue order).
  void push_back(int32_t k) { q_.push_back(k); }
  // A new arrival: FCFS at the back; PRIORITY after every request that does not sort after it.
  template <class Before>
  void add(int32_t k, Before before) {
    if (policy_ == Policy::Fcfs) {
      q_.push_back(k);
    } else {
      q_.insert(std::upper_bound(q_.begin(), q_.end(), k, before), k);
    }
  }
  // A preempted request comes back: FCFS at the front; PRIORITY before every request that does
  // not sort before it.
  template <class Before>
  void add_preempted(int32_t k, Before before) {
    if (policy_ == Policy::Fcfs) {
      q_.push_front(k);
    } else {
      q_.insert(std::lower_bound(q_.begin(), q_.end(), k, before), k);
    }
  }
  // Back to the head (requests an admission pass skipped, re-inserted in reverse order).
  void push_front(int32_t k) { q_.push_front(k); }
  int32_t front() const { return q_.front(); }
  void pop_front() { q_.pop_front(); }
  void remove(int32_t k) { q_.erase(std::remove(q_.begin(), q_.end(), k), q_.end()); }

  bool empty() const { return q_.empty(); }
  size_t size() const { return q_.size(); }
  const_iterator begin() const { return q_.begin(); }
  const_iterator end() const { return q_.end(); }

 private:
  Policy policy_;
  std::deque<int32_t> q_;
};

}  // namespace bea
