// The fast path's finish queue: requests of the decode group keyed by the step of their last
// token, for a step clock that only moves forward and never passes a pending finish.
//
// Three sources, each O(1) per event: the snapshot's own group as one presorted list (a cursor),
// a calendar of the next kWindow steps (one intrusive list per step) for requests that join the
// group later, and a heap for the rare finish further away than that. Requests leave the queue
// only by finishing (pop) or all at once (clear), so no entry is ever stale.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace bea {

class FinishQueue {
 public:
  using Entry = std::pair<int64_t, int32_t>;  // (step, request)
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

  // Empty, clock at `now`; `sorted` (ascending, every step >= now) are the first entries; it is
  // read in place and must outlive the queue's use of it.
  void reset(size_t n_requests, int64_t now, const std::vector<Entry>* sorted = nullptr) {
    clear();
    now_ = now;
    sorted_ = sorted;
    cursor_ = 0;
    if (sorted_ != nullptr && !sorted_->empty()) next_step_ = sorted_->front().first;
    if (next_.size() < n_requests) next_.resize(n_requests, -1);
  }
  // Forget every entry (the group dissolved).
  void clear() {
    sorted_ = nullptr;
    if (in_ring_ > 0)
      for (uint64_t& w : occupied_) w = 0;
    in_ring_ = 0;
    ring_min_ = kNone;
    far_.clear();
    next_step_ = kNone;
  }
  void grow(size_t n_requests) {
    if (next_.size() < n_requests) next_.resize(n_requests, -1);
  }

  void push(int64_t step, int32_t k) {
    next_step_ = std::min(next_step_, step);
    if (step - now_ >= kWindow) {
      far_.emplace_back(step, k);
      std::push_heap(far_.begin(), far_.end(), later);
      return;
    }
    ring_insert(step, k);
  }

  // The earliest pending step (kNone when empty).
  int64_t next_step() const { return next_step_; }

  // Removes every entry of `step` (the earliest pending one), calling f(request) for each.
  template <class F>
  void pop_step(int64_t step, F&& f) {
    if (sorted_ != nullptr)
      while (cursor_ < sorted_->size() && (*sorted_)[cursor_].first == step) f((*sorted_)[cursor_++].second);
    if (ring_min_ == step) {
      const size_t slot = static_cast<size_t>(step & kMask);
      int32_t k = head_[slot];
      occupied_[slot / 64] &= ~(uint64_t{1} << (slot % 64));
      while (k >= 0) {
        const int32_t nx = next_[static_cast<size_t>(k)];
        --in_ring_;
        f(k);
        k = nx;
      }
      ring_min_ = in_ring_ > 0 ? scan_from(step + 1) : kNone;
    }
    const int64_t from_sorted = sorted_ != nullptr && cursor_ < sorted_->size() ? (*sorted_)[cursor_].first : kNone;
    const int64_t from_far = far_.empty() ? kNone : far_.front().first;
    next_step_ = std::min(from_sorted, std::min(ring_min_, from_far));
  }

  // The clock moved forward to `now` (never past next_step()).
  void advance(int64_t now) {
    now_ = now;
    if (!far_.empty()) enter_window();
  }

 private:
  static constexpr int64_t kWindow = 1024;  // steps the calendar covers: [now, now + kWindow)
  static constexpr int64_t kMask = kWindow - 1;
  static constexpr size_t kWords = static_cast<size_t>(kWindow / 64);

  static bool later(const Entry& a, const Entry& b) { return a.first > b.first; }

  void enter_window() {  // far entries that the window now covers move into the calendar
    while (!far_.empty() && far_.front().first - now_ < kWindow) {
      const Entry e = far_.front();
      std::pop_heap(far_.begin(), far_.end(), later);
      far_.pop_back();
      ring_insert(e.first, e.second);
    }
  }

  void ring_insert(int64_t step, int32_t k) {
    const size_t slot = static_cast<size_t>(step & kMask);
    const uint64_t bit = uint64_t{1} << (slot % 64);
    next_[static_cast<size_t>(k)] = (occupied_[slot / 64] & bit) != 0 ? head_[slot] : -1;
    head_[slot] = k;
    occupied_[slot / 64] |= bit;
    ++in_ring_;
    ring_min_ = std::min(ring_min_, step);
  }

  // The first occupied step in [from, now + kWindow) (the ring is not empty).
  int64_t scan_from(int64_t from) const {
    for (int64_t s = from; s < now_ + kWindow;) {
      const size_t slot = static_cast<size_t>(s & kMask);
      const uint64_t bits = occupied_[slot / 64] >> (slot % 64);
      if (bits != 0) return s + __builtin_ctzll(bits);
      s += 64 - static_cast<int64_t>(slot % 64);
    }
    return kNone;
  }

  int64_t now_ = 0;
  const std::vector<Entry>* sorted_ = nullptr;
  size_t cursor_ = 0;
  int32_t head_[kWindow];  // per calendar slot: its first request, where `occupied_` says so
  std::vector<int32_t> next_;  // per request: the next one in its slot's list
  uint64_t occupied_[kWords] = {};  // calendar slots with a list
  int64_t in_ring_ = 0;
  int64_t ring_min_ = kNone;
  int64_t next_step_ = kNone;  // min over the three sources
  std::vector<Entry> far_;  // min-heap of entries kWindow or more steps ahead
};

}  // namespace bea
