// Typed, validated reads of value-tree map fields (private to the core's converters): every
// error is a std::invalid_argument that names the field, e.g. "snapshot field 'running[3].blocks'".
#pragma once

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <optional>
#include <utility>
#include <vector>

#include "bea/core/value.h"

namespace bea {
namespace fields {

[[noreturn]] inline void bad(const std::string& field, const std::string& why) {
  throw std::invalid_argument("snapshot field '" + field + "': " + why);
}

inline const Value& require(const Value& m, const char* key, const std::string& path) {
  const Value* v = m.get(key);
  if (v == nullptr) bad(path + key, "missing");
  return *v;
}

inline int64_t as_int(const Value& v, const std::string& field, int64_t lo, int64_t hi) {
  int64_t x = 0;
  if (v.type == Value::Type::Int) {
    x = v.i;
  } else if (v.type == Value::Type::Float && std::isfinite(v.d) && v.d == std::floor(v.d) &&
             std::fabs(v.d) < 9.0e15) {
    x = static_cast<int64_t>(v.d);
  } else {
    bad(field, "must be an integer");
  }
  if (x < lo || x > hi) bad(field, "out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

inline int64_t int_field(const Value& m, const char* key, const std::string& path, int64_t lo, int64_t hi) {
  return as_int(require(m, key, path), path + key, lo, hi);
}

inline int64_t opt_int(const Value& m, const char* key, const std::string& path, int64_t lo, int64_t hi,
                       int64_t dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  return as_int(*v, path + key, lo, hi);
}

inline double opt_double(const Value& m, const char* key, const std::string& path, double dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  double x = v->type == Value::Type::Int ? static_cast<double>(v->i)
             : v->type == Value::Type::Float ? v->d
                                             : (bad(path + key, "must be a number"), 0.0);
  if (!std::isfinite(x)) bad(path + key, "must be finite");
  return x;
}

inline bool opt_bool(const Value& m, const char* key, const std::string& path, bool dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  if (v->type == Value::Type::Bool) return v->b;
  if (v->type == Value::Type::Int && (v->i == 0 || v->i == 1)) return v->i == 1;
  bad(path + key, "must be a boolean");
}

inline std::string opt_str(const Value& m, const char* key, const std::string& path, const std::string& dflt) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return dflt;
  if (v->type != Value::Type::Str) bad(path + key, "must be a string");
  return v->s;
}

inline std::string id_field(const Value& m, const std::string& path) {
  const Value& v = require(m, "id", path);
  if (v.type != Value::Type::Str) bad(path + "id", "must be a string");
  if (v.s.empty()) bad(path + "id", "must not be empty");
  return v.s;
}

// A list of distinct block indices in [0, hi) (tracked-block references).
inline std::vector<int32_t> index_list(const Value& v, const std::string& field, int64_t hi) {
  if (v.type != Value::Type::Arr) bad(field, "must be a list of integers");
  std::vector<int32_t> out;
  out.reserve(v.arr.size());
  for (size_t k = 0; k < v.arr.size(); ++k)
    out.push_back(static_cast<int32_t>(as_int(v.arr[k], field + "[" + std::to_string(k) + "]", 0, hi - 1)));
  std::vector<int32_t> sorted(out);
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) bad(field, "lists a block twice");
  return out;
}
inline std::optional<std::vector<int32_t>> opt_index_list(const Value& m, const char* key, const std::string& path,
                                                          int64_t hi) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return std::nullopt;
  return index_list(*v, path + key, hi);
}

// A list of integers in [0, INT64_MAX] (block keys).
inline std::vector<int64_t> opt_key_list(const Value& m, const char* key, const std::string& path) {
  const Value* v = m.get(key);
  if (v == nullptr || v->type == Value::Type::Nil) return {};
  if (v->type != Value::Type::Arr) bad(path + key, "must be a list of integers");
  std::vector<int64_t> out;
  out.reserve(v->arr.size());
  for (size_t k = 0; k < v->arr.size(); ++k)
    out.push_back(as_int(v->arr[k], path + key + "[" + std::to_string(k) + "]", 0, INT64_MAX));
  return out;
}

// Builders for the export direction.
inline Value int_value(int64_t x) {
  Value v;
  v.type = Value::Type::Int;
  v.i = x;
  return v;
}
inline Value real_value(double x) {
  Value v;
  v.type = Value::Type::Float;
  v.d = x;
  return v;
}
inline Value bool_value(bool x) {
  Value v;
  v.type = Value::Type::Bool;
  v.b = x;
  return v;
}
inline Value str_value(std::string x) {
  Value v;
  v.type = Value::Type::Str;
  v.s = std::move(x);
  return v;
}
inline Value map_value() {
  Value v;
  v.type = Value::Type::Map;
  return v;
}
inline Value list_value() {
  Value v;
  v.type = Value::Type::Arr;
  return v;
}
template <typename T>
inline Value int_list_value(const std::vector<T>& xs) {
  Value v = list_value();
  v.arr.reserve(xs.size());
  for (T x : xs) v.arr.push_back(int_value(static_cast<int64_t>(x)));
  return v;
}

}  // namespace fields
}  // namespace bea
