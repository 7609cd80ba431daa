// Binding of bear.delta/1 (bea/core/snapshot_delta.h): `Delta` (parsed once, header readable
// before it is applied), `Snapshot.apply_delta` and `snapshot_difference`. A delta is applied in
// C++ from its msgpack bytes: no Python object is built per resident.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bea/core/snapshot_delta.h"
#include "bea/core/value.h"
#include "snapshot_object.h"

namespace py = pybind11;

namespace {

struct PyDelta {
  bea::Value value;
  bea::DeltaHeader header;
  size_t nbytes = 0;
};

// Predicted lengths of arrivals from the estimator's dict {id: tokens} (other values: unknown).
bea::LengthLookup lookup_in(py::handle lengths) {
  if (lengths.is_none()) return {};
  if (!PyDict_Check(lengths.ptr())) throw py::type_error("lengths must be a dict {id: tokens} or None");
  PyObject* d = lengths.ptr();
  return [d](const std::string& id) -> int64_t {
    PyObject* key = PyUnicode_DecodeUTF8(id.data(), static_cast<Py_ssize_t>(id.size()), "strict");
    if (key == nullptr) {
      PyErr_Clear();
      return -1;
    }
    PyObject* val = PyDict_GetItemWithError(d, key);  // borrowed
    Py_DECREF(key);
    if (val == nullptr) {
      PyErr_Clear();
      return -1;
    }
    if (!PyLong_CheckExact(val)) return -1;
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(val, &overflow);
    if (overflow != 0 || x < 0 || x > bea::kMaxTokens) return -1;
    return static_cast<int64_t>(x);
  };
}

}  // namespace

void bind_delta(py::module_& m) {
  py::class_<PyDelta, std::shared_ptr<PyDelta>>(m, "Delta", "A parsed bear.delta/1: one step's change of an instance's state.")
      .def_static(
          "from_msgpack",
          [](py::bytes b) {
            std::string_view sv = b;
            auto d = std::make_shared<PyDelta>();
            {
              py::gil_scoped_release nogil;
              d->value = bea::parse_msgpack(reinterpret_cast<const uint8_t*>(sv.data()), sv.size());
            }
            d->header = bea::delta_header(d->value);
            d->nbytes = sv.size();
            return d;
          },
          "Parse msgpack bytes; ValueError on malformed input or a bad header (the body is checked when applied).")
      .def_property_readonly("instance", [](const PyDelta& d) { return d.header.instance; })
      .def_property_readonly("generation", [](const PyDelta& d) { return d.header.generation; })
      .def_property_readonly("base", [](const PyDelta& d) { return d.header.base; }, "seq of the state it applies to")
      .def_property_readonly("base_time", [](const PyDelta& d) { return d.header.base_time; },
                             "capture time of the state it applies to")
      .def_property_readonly("seq", [](const PyDelta& d) { return d.header.seq; }, "seq of the state it makes")
      .def_property_readonly("time", [](const PyDelta& d) { return d.header.time; })
      .def_property_readonly("idle", [](const PyDelta& d) { return d.header.idle; })
      .def_property_readonly("nbytes", [](const PyDelta& d) { return d.nbytes; });

  py::object cls = m.attr("Snapshot");
  cls.attr("apply_delta") = py::cpp_function(
      [](bea_py::PySnapshot& s, const PyDelta& d, py::handle lengths) {
        return s.apply_delta(d.value, d.header, lookup_in(lengths));
      },
      py::name("apply_delta"), py::is_method(cls), py::arg("delta"), py::arg("lengths") = py::none(),
      "Apply a Delta in place; returns the ids of the requests that arrived (their predicted lengths are\n"
      "looked up in `lengths`, a dict {id: tokens}). ValueError when the delta is for another state\n"
      "(generation, base seq or base time differ: nothing changed) or is malformed (the snapshot is then `broken`).");

  m.def(
      "snapshot_difference",
      [](const bea_py::PySnapshot& a, const bea_py::PySnapshot& b, bool compare_time) -> py::object {
        const std::string d = bea::snapshot_difference(a.snap(), b.snap(), compare_time);
        if (d.empty()) return py::none();
        return py::str(d);
      },
      py::arg("a"), py::arg("b"), py::arg("compare_time") = true,
      "None when two snapshots hold the same state (all bear.snapshot/1 fields but config), else the first\n"
      "difference as text.");
}
