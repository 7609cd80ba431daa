// The Python `Snapshot` object, shared by the replay binding (which builds and estimates it) and
// the engine binding (which exports a sim engine's state as one).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "bea/core/replay.h"
#include "bea/core/snapshot.h"

namespace bea_py {

// A parsed snapshot plus its replay-ready form, cached per length policy.
class PySnapshot {
 public:
  explicit PySnapshot(bea::Snapshot s) : snap_(std::move(s)) {}

  const bea::Prepared& prepared(const bea::ReplayOptions& opt) {
    if (!prep_ || opt.default_output_tokens != prep_default_ || opt.overrun_fraction != prep_overrun_) {
      prep_ = std::make_unique<bea::Prepared>(bea::prepare(snap_, opt));
      prep_default_ = opt.default_output_tokens;
      prep_overrun_ = opt.overrun_fraction;
    }
    return *prep_;
  }
  void set_lengths(const std::unordered_map<std::string, int64_t>& l) {
    snap_.set_output_lengths(l);
    prep_.reset();
  }
  const bea::Snapshot& snap() const { return snap_; }

 private:
  bea::Snapshot snap_;
  std::unique_ptr<bea::Prepared> prep_;
  int64_t prep_default_ = -1;
  double prep_overrun_ = 0.5;
};

}  // namespace bea_py
