// Python objects ↔ libbea's value tree, shared by the bindings: one conversion, one set of checks.
// Python dicts reach the core as value trees (bea/core/request_fields.h reads their requests);
// exported maps (snapshots, configs) come back the same way.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <string>

#include "bea/core/batch_time.h"
#include "bea/core/value.h"

namespace bea_py {

namespace py = pybind11;
using bea::Coeffs;
using bea::kMaxDepth;
using bea::Value;

inline Value to_value(py::handle h, int depth) {
  if (depth > kMaxDepth) throw std::invalid_argument("input nested too deeply");
  Value v;
  if (h.is_none()) return v;
  if (py::isinstance<py::bool_>(h)) {
    v.type = Value::Type::Bool;
    v.b = h.cast<bool>();
  } else if (py::isinstance<py::int_>(h)) {
    v.type = Value::Type::Int;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow != 0) throw std::invalid_argument("integer out of range");
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    v.i = x;
  } else if (py::isinstance<py::float_>(h)) {
    v.type = Value::Type::Float;
    v.d = h.cast<double>();
  } else if (py::isinstance<py::str>(h)) {
    v.type = Value::Type::Str;
    v.s = h.cast<std::string>();
  } else if (py::isinstance<py::dict>(h)) {
    v.type = Value::Type::Map;
    auto d = py::reinterpret_borrow<py::dict>(h);
    v.map.reserve(d.size());
    for (auto kv : d) {
      if (!py::isinstance<py::str>(kv.first)) throw std::invalid_argument("map key is not a string");
      v.map.emplace_back(kv.first.cast<std::string>(), to_value(kv.second, depth + 1));
    }
  } else if (py::isinstance<py::list>(h) || py::isinstance<py::tuple>(h)) {
    v.type = Value::Type::Arr;
    auto seq = py::reinterpret_borrow<py::sequence>(h);
    v.arr.reserve(seq.size());
    for (auto item : seq) v.arr.push_back(to_value(item, depth + 1));
  } else {
    throw std::invalid_argument(std::string("unsupported value type: ") + std::string(py::str(py::type::handle_of(h))));
  }
  return v;
}

// The value tree as Python objects: maps → dict (in order), lists → list.
inline py::object from_value(const Value& v) {
  switch (v.type) {
    case Value::Type::Nil: return py::none();
    case Value::Type::Bool: return py::bool_(v.b);
    case Value::Type::Int: return py::int_(v.i);
    case Value::Type::Float: return py::float_(v.d);
    case Value::Type::Str: return py::str(v.s);
    case Value::Type::Arr: {
      py::list l;
      for (const Value& x : v.arr) l.append(from_value(x));
      return std::move(l);
    }
    case Value::Type::Map: {
      py::dict d;
      for (const auto& kv : v.map) d[py::str(kv.first)] = from_value(kv.second);
      return std::move(d);
    }
  }
  return py::none();
}

inline py::dict dict_from_value(const Value& v) { return py::reinterpret_borrow<py::dict>(from_value(v)); }

inline Coeffs coeffs_from(py::handle h) {
  Coeffs c;
  if (h.is_none()) return c;
  auto seq = py::reinterpret_borrow<py::sequence>(h);
  if (seq.size() != 4 && seq.size() != 8)
    throw std::invalid_argument("beta must have 4 coefficients (eq. 12), or 8 (a roofline of two eq. 12 lines)");
  double b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t k = 0; k < seq.size(); ++k) {
    b[k] = seq[k].cast<double>();
    if (!std::isfinite(b[k])) throw std::invalid_argument("beta must be finite");
    if (k >= 4 && b[k] < 0.0) throw std::invalid_argument("the roofline's second line must be non-negative");
  }
  c.b0 = b[0];
  c.b1 = b[1];
  c.b2 = b[2];
  c.b3 = b[3];
  c.g0 = b[4];
  c.g1 = b[5];
  c.g2 = b[6];
  c.g3 = b[7];
  return c;
}

}  // namespace bea_py
