// The pybind11 module bear.libbea: one binding per domain.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_replay(py::module_& m);     // replay_binding.cpp: snapshots, estimates, ageing, analytic
void bind_engine(py::module_& m);     // engine_binding.cpp: the sim instance's engine
void bind_predictor(py::module_& m);  // predictor_binding.cpp: prompt features, LightGBM heads

PYBIND11_MODULE(libbea, m) {
  m.doc() = "BEA: replay vLLM V1 scheduling from a per-step snapshot to predict a query's TTFT.";
  bind_replay(m);
  bind_engine(m);
  bind_predictor(m);
}
