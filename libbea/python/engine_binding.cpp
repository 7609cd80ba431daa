// Binding of the simulated-instance engine (filled in by the sim-engine work).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_engine(py::module_& m) { (void)m; }
