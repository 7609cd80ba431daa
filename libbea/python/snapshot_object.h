// The Python `Snapshot` object, shared by the replay binding (which builds and estimates it) and
// the engine binding (which exports a sim engine's state as one).
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bea/core/replay.h"
#include "bea/core/snapshot.h"
#include "bea/core/snapshot_delta.h"
#include "convert.h"

namespace bea_py {

// A parsed snapshot plus its replay-ready form, cached per length policy.
class PySnapshot {
 public:
  explicit PySnapshot(bea::Snapshot s) : snap_(std::move(s)) {}
  PySnapshot(const PySnapshot&) = delete;  // ids_ views point into this object's snapshot
  PySnapshot& operator=(const PySnapshot&) = delete;

  const bea::Prepared& prepared(const bea::ReplayOptions& opt) { return *prepared_ptr(opt); }
  // Shared, so that a replay running without the GIL keeps its prepared form alive while the
  // event loop applies the next delta (which replaces it). Two forms are kept per state, the two
  // length policies last asked for: the estimate's (lengths drawn) and the load counters' and the
  // step in flight's (point lengths) alternate on every estimate, and one slot rebuilt both each time.
  // Both share the state's tracked table (`table_`, built by the first form): at a GPU-sized pool
  // it is most of a form's cost (tracked_table()). Under the snapshot's lock, so callable without
  // the GIL (the replay bindings prepare there); the methods that change the state lock too.
  std::shared_ptr<const bea::Prepared> prepared_ptr(const bea::ReplayOptions& opt) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (broken_) throw std::invalid_argument("snapshot: a delta failed to apply to it; its state is unknown");
    for (const auto& slot : prep_)
      if (slot.matches(opt)) return slot.prep;
    PrepSlot& slot = prep_[prep_next_];
    prep_next_ ^= 1;
    slot.prep = std::make_shared<const bea::Prepared>(bea::prepare(snap_, opt, table_));
    if (!table_ && slot.prep->table) {
      table_ = slot.prep->table;
      ++table_builds_;
    }
    slot.default_out = opt.default_output_tokens;
    slot.overrun = opt.overrun_fraction;
    slot.sigma = opt.length_sigma;
    slot.draws = opt.length_draws;
    return slot.prep;
  }
  // How many times this object built a tracked table (once per state it was estimated in).
  int64_t table_builds() const { return table_builds_; }
  // Whether the current state's tracked table is built (its next estimate does not pay for it).
  // Never waits: while another thread prepares the state, the table is not ready for the caller
  // either (the worker's event loop asks, and must not stand still until the build is done).
  bool table_ready() {
    const std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    return lock.owns_lock() && table_ != nullptr;
  }
  // The blocks of the state's tracked table (0: none): what building it costs, O(n log n).
  size_t table_blocks() const { return snap_.has_pool ? snap_.pool.size() : snap_.tracked_blocks.size(); }
  // Apply a bear.delta/1 in place (bea/core/snapshot_delta.h): the arrivals' ids. A delta for
  // another state (generation, seq, time) throws and changes nothing; a malformed one throws and leaves the snapshot
  // broken (never estimated again).
  std::vector<std::string> apply_delta(const bea::Value& v, const bea::DeltaHeader& h, const bea::LengthLookup& lookup) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (broken_) throw std::invalid_argument("snapshot: a delta failed to apply to it; its state is unknown");
    if (h.generation != snap_.generation || h.base != snap_.seq || h.base_time != snap_.time)
      return bea::apply_delta(snap_, resident_ids_, v, h);  // throws before changing anything
    if (!have_ids_) {
      resident_ids_ = bea::resident_ids(snap_);
      have_ids_ = true;
    }
    ids_.clear();  // views into requests that move
    clear_prepared(true);
    try {
      return bea::apply_delta(snap_, resident_ids_, v, h, lookup);
    } catch (...) {
      broken_ = true;
      throw;
    }
  }
  bool broken() const { return broken_; }
  void set_lengths(const std::unordered_map<std::string, int64_t>& l) {
    const std::lock_guard<std::mutex> lock(mu_);
    set_lengths_locked(l);
  }
  // Predicted lengths from a Python dict {id: tokens}. The usual dict (str ids, int tokens in
  // range) is applied through an index of the residents' ids, without an intermediate map; any
  // other input takes the validating path (and its errors). The prepared form is rebuilt only
  // when a resident's prediction changed (the tracked table is kept: lengths do not change it).
  void set_lengths_from(pybind11::handle d) {
    const std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<int32_t, int64_t>> updates;
    if (!usual_lengths(d, updates)) {
      set_lengths_locked(bea::lengths_from_value(to_value(d, 0)));
      return;
    }
    bool changed = false;
    for (const auto& [k, tokens] : updates) {
      bea::Request& r = request(k);
      changed |= r.predicted_output != tokens;
      r.predicted_output = tokens;
    }
    if (changed) clear_prepared(false);
  }
  const bea::Snapshot& snap() const { return snap_; }

 private:
  void set_lengths_locked(const std::unordered_map<std::string, int64_t>& l) {
    snap_.set_output_lengths(l);
    clear_prepared(false);
  }
  bea::Request& request(int32_t k) {
    const auto u = static_cast<size_t>(k);
    return u < snap_.running.size() ? snap_.running[u] : snap_.waiting[u - snap_.running.size()];
  }
  // (resident, tokens) for every known id of a dict of str -> int in [0, kMaxTokens]; false
  // when the dict is anything else (nothing is applied then).
  bool usual_lengths(pybind11::handle d, std::vector<std::pair<int32_t, int64_t>>& updates) {
    if (!PyDict_Check(d.ptr())) return false;
    if (ids_.empty()) {  // index the residents' ids once (again after a delta)
      ids_.reserve(snap_.running.size() + snap_.waiting.size());
      int32_t k = 0;
      for (const auto* list : {&snap_.running, &snap_.waiting})
        for (const auto& r : *list) ids_.emplace(std::string_view(r.id), k++);
    }
    updates.reserve(static_cast<size_t>(PyDict_Size(d.ptr())));
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d.ptr(), &pos, &key, &value)) {
      if (!PyUnicode_Check(key) || !PyLong_CheckExact(value)) return false;
      int overflow = 0;
      const long long tokens = PyLong_AsLongLongAndOverflow(value, &overflow);
      if (overflow != 0 || tokens < 0 || tokens > bea::kMaxTokens) return false;
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(key, &n);
      if (s == nullptr) {
        PyErr_Clear();
        return false;
      }
      const auto it = ids_.find(std::string_view(s, static_cast<size_t>(n)));
      if (it != ids_.end()) updates.emplace_back(it->second, static_cast<int64_t>(tokens));
    }
    return true;
  }

  bea::Snapshot snap_;
  // A prepared form and the length policy it was prepared with.
  struct PrepSlot {
    std::shared_ptr<const bea::Prepared> prep;
    int64_t default_out = -1;
    double overrun = 0.5;
    double sigma = 0.0;
    int64_t draws = 0;
    bool matches(const bea::ReplayOptions& o) const {
      return prep && o.default_output_tokens == default_out && o.overrun_fraction == overrun &&
             o.length_sigma == sigma && o.length_draws == draws;
    }
  };
  // `state`: the state itself changed (a delta), not only the lengths: the table goes too.
  void clear_prepared(bool state) {
    for (auto& slot : prep_) slot.prep.reset();
    if (state) table_.reset();
  }
  std::array<PrepSlot, 2> prep_;
  std::shared_ptr<const bea::TrackedTable> table_;  // the state's, shared by its forms (null: none yet)
  int64_t table_builds_ = 0;
  std::mutex mu_;  // prepared_ptr (possibly without the GIL) against the methods that change the state
  size_t prep_next_ = 0;
  std::unordered_map<std::string_view, int32_t> ids_;  // views of snap_'s own ids (cleared when a delta moves them)
  bea::ResidentIds resident_ids_;  // the residents' ids while deltas apply (built on the first)
  bool have_ids_ = false;
  bool broken_ = false;
};

}  // namespace bea_py
