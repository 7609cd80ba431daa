// A small self-describing value tree: the one input form that snapshot validation reads.
// Built from msgpack bytes (here, bounds-checked) or from Python objects (in the binding).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace bea {

struct Value {
  enum class Type { Nil, Bool, Int, Float, Str, Arr, Map };
  Type type = Type::Nil;
  bool b = false;
  int64_t i = 0;
  double d = 0.0;
  std::string s;
  std::vector<Value> arr;
  std::vector<std::pair<std::string, Value>> map;

  const Value* get(const char* key) const;  // nullptr when absent (maps only)
  bool is_number() const { return type == Type::Int || type == Type::Float; }
};

// Parse one msgpack object spanning exactly [data, data+len). Throws std::invalid_argument on
// malformed, truncated, trailing or over-deep input; never reads out of bounds.
Value parse_msgpack(const uint8_t* data, size_t len);

constexpr int kMaxDepth = 32;

}  // namespace bea
