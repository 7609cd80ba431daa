// bear.delta/1: one instance's state change between two published bear.snapshot/1 states, applied
// in place to the snapshot model (docs/contract.md, "bear.delta/1"). The applier is the one
// definition of the schema's meaning; the encoder (bear.instance.delta) writes what it reads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "bea/core/snapshot.h"
#include "bea/core/value.h"

namespace bea {

// The header of a delta: which state it applies to and which it makes. Read (and checked) before
// the body, so that a consumer can tell "applies", "already have it" and "gap" apart cheaply.
struct DeltaHeader {
  std::string instance;
  int64_t generation = 0;
  int64_t base = 0;        // seq of the state it applies to
  double base_time = 0.0;  // and that state's capture time: (generation, seq, time) names one state
  int64_t seq = 0;         // seq of the state it makes (> base)
  double time = 0.0;
  bool idle = false;
};

// Throws std::invalid_argument (naming the field) unless `v` is a bear.delta/1 map with a valid
// header; the body is validated by apply_delta.
DeltaHeader delta_header(const Value& v);

// The ids of a snapshot's residents, kept by the caller between deltas so that an arrival's id is
// checked for uniqueness without scanning the residents.
using ResidentIds = std::unordered_set<std::string>;
ResidentIds resident_ids(const Snapshot& s);

// The predicted total output tokens of an arriving id (-1: unknown).
using LengthLookup = std::function<int64_t(const std::string&)>;

// Apply delta `v` (header `h`, from delta_header(v)) to `s`, whose resident ids are `ids`; returns
// the ids of the arrivals. Throws std::invalid_argument when the delta does not apply to `s`
// (generation, base seq or base time differ: `s` is untouched) or when its body is malformed or inconsistent
// with `s`; in the latter case `s` and `ids` may be partly updated (still memory-safe) and must be
// discarded: the state is unknown, exactly as if the delta had been lost.
std::vector<std::string> apply_delta(Snapshot& s, ResidentIds& ids, const Value& v, const DeltaHeader& h,
                                     const LengthLookup& predicted = {});

// "" when `a` and `b` hold the same state (every bear.snapshot/1 field but config; `time` only
// when `compare_time`), else the first difference, e.g. "running[3].computed_tokens: 17 != 18".
std::string snapshot_difference(const Snapshot& a, const Snapshot& b, bool compare_time = true);

}  // namespace bea
