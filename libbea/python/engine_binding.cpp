// Binding of the simulated-instance engine (bea::Engine): a live vLLM V1 scheduler the sim
// instance drives step by step. Scheduling work runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "bea/sim/engine.h"
#include "bea/core/ageing.h"
#include "bea/core/replay.h"
#include "bea/core/snapshot.h"
#include "bea/core/scheduler.h"
#include "bea/core/value.h"
#include "convert.h"

namespace py = pybind11;
using bea::Engine;
using bea::Scheduler;

namespace {


py::dict config_dict(const bea::Config& c) {
  py::dict d;
  d["max_num_batched_tokens"] = c.max_num_batched_tokens;
  d["max_num_scheduled_tokens"] = c.max_num_scheduled_tokens;
  d["max_num_seqs"] = c.max_num_seqs;
  d["long_prefill_token_threshold"] = c.long_prefill_token_threshold;
  d["long_prefill_token_threshold_adaptive"] = c.long_prefill_token_threshold_adaptive;
  d["enable_chunked_prefill"] = c.enable_chunked_prefill;
  d["policy"] = c.policy == bea::Policy::Fcfs ? "fcfs" : "priority";
  d["block_size"] = c.block_size;
  d["num_gpu_blocks"] = c.num_gpu_blocks;
  d["watermark_blocks"] = c.watermark_blocks;
  d["max_model_len"] = c.max_model_len;
  d["scheduler_reserve_full_isl"] = c.scheduler_reserve_full_isl;
  d["enable_prefix_caching"] = c.enable_prefix_caching;
  d["async_scheduling"] = c.async_scheduling;
  return d;
}

py::dict request_dict(const Scheduler& sched, const std::string& id, int32_t k) {
  const Scheduler::Req& r = sched.reqs()[static_cast<size_t>(k)];
  py::dict d;
  d["id"] = id;
  d["prompt_tokens"] = r.P;
  d["computed_tokens"] = r.C;
  d["output_tokens"] = r.O;
  d["max_tokens"] = r.max_tokens;
  d["blocks"] = r.kv.held;
  d["exclusive_blocks"] = r.kv.exclusive;
  d["preemptions"] = r.preemptions;
  d["arrival"] = r.arrival;
  d["priority"] = r.prio;
  if (r.C == 0 && r.hit > 0) d["prefix_hit_tokens"] = r.hit;
  return d;
}

template <class NameOf>
py::dict snapshot_dict(const Scheduler& sched, NameOf name_of, const std::string& instance, const std::string& model,
                       int64_t seq, double time) {
  py::dict d;
  d["v"] = "bear.snapshot/1";
  d["instance"] = instance;
  d["model"] = model;
  d["seq"] = seq;
  d["time"] = time;
  d["config"] = config_dict(sched.config());
  d["free_blocks"] = sched.free_blocks();
  py::list running;
  for (int32_t k : sched.running()) running.append(request_dict(sched, name_of(k), k));
  py::list waiting;
  for (int32_t k : sched.waiting()) waiting.append(request_dict(sched, name_of(k), k));
  d["running"] = running;
  d["waiting"] = waiting;
  d["inflight"] = py::none();
  return d;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine",
                     "A live vLLM V1 engine core (sync scheduling) over libbea's Scheduler, for the sim instance.")
      .def(py::init([](py::handle config) { return new Engine(bea_py::to_value(config, 0)); }), py::arg("config"),
           "Build from a bear.snapshot/1 `config` map (ValueError names a bad field).")
      .def(
          "add",
          [](Engine& e, const std::string& id, int64_t prompt_tokens, int64_t max_tokens, int64_t true_output_tokens,
             double arrival, int64_t priority) {
            e.add(id, prompt_tokens, max_tokens, true_output_tokens, arrival, priority);
          },
          py::arg("id"), py::arg("prompt_tokens"), py::arg("max_tokens"), py::arg("true_output_tokens"),
          py::arg("arrival") = 0.0, py::arg("priority") = 0,
          "Queue a request that will stop after true_output_tokens (capped by max_tokens/max_model_len).")
      .def("abort", &Engine::abort, py::arg("id"), "Drop a request; False when unknown or finished.")
      .def(
          "step",
          [](Engine& e) {
            const std::vector<Scheduler::Item>* batch = nullptr;
            {
              py::gil_scoped_release nogil;
              batch = &e.step();
            }
            py::list out;
            for (const auto& it : *batch) {
              const int64_t P = e.scheduler().reqs()[static_cast<size_t>(it.req)].P;
              out.append(py::make_tuple(e.name(it.req), it.n, it.context, bea::is_decode(it.n, it.context, P)));
            }
            return out;
          },
          "schedule(): [(id, n, context, decode), ...] for the batch to execute now (empty: idle).")
      .def(
          "finish_step",
          [](Engine& e) {
            std::vector<Engine::Output> res;
            {
              py::gil_scoped_release nogil;
              res = e.finish_step();
            }
            py::list out;
            for (const auto& o : res) out.append(py::make_tuple(e.name(o.req), o.output_tokens, o.finished));
            return out;
          },
          "update_from_output(): [(id, output_tokens, finished), ...] for requests that got a token.")
      .def(
          "snapshot",
          [](const Engine& e, const std::string& instance, const std::string& model, double time) {
            return snapshot_dict(
                e.scheduler(), [&e](int32_t k) -> const std::string& { return e.name(k); }, instance, model, e.seq(),
                time);
          },
          py::arg("instance"), py::arg("model"), py::arg("time"),
          "The scheduler state as a bear.snapshot/1 map (call between steps).")
      .def_property_readonly("seq", &Engine::seq)
      .def_property_readonly("in_step", &Engine::in_step)
      .def_property_readonly("has_work", &Engine::has_work)
      .def_property_readonly("live", &Engine::live)
      .def_property_readonly("table_size", &Engine::table_size)
      .def_property_readonly("n_running", [](const Engine& e) { return e.scheduler().running().size(); })
      .def_property_readonly("n_waiting", [](const Engine& e) { return e.scheduler().waiting().size(); })
      .def_property_readonly("free_blocks", [](const Engine& e) { return e.scheduler().free_blocks(); })
      .def_property_readonly("config", [](const Engine& e) { return config_dict(e.scheduler().config()); });

  m.def(
      "advance_snapshot",
      [](py::bytes data, py::handle lengths, double age_s, py::handle beta, int64_t default_output_tokens,
         double overrun_fraction) {
        bea::ReplayOptions opt;
        opt.beta = bea_py::coeffs_from(beta);
        opt.default_output_tokens = default_output_tokens;
        if (!std::isfinite(overrun_fraction) || overrun_fraction < 0.0)
          throw std::invalid_argument("overrun_fraction must be >= 0");
        opt.overrun_fraction = overrun_fraction;
        std::unordered_map<std::string, int64_t> known;
        if (!lengths.is_none()) known = bea::lengths_from_value(bea_py::to_value(lengths, 0));
        std::string_view sv = data;
        std::unique_ptr<bea::Advanced> adv;
        std::string instance, model;
        int64_t seq = 0;
        double time = 0.0;
        {
          py::gil_scoped_release nogil;
          bea::Snapshot snap = bea::snapshot_from_value(
              bea::parse_msgpack(reinterpret_cast<const uint8_t*>(sv.data()), sv.size()));
          snap.set_output_lengths(known);
          instance = snap.instance;
          model = snap.model;
          seq = snap.seq;
          time = snap.time;
          const bea::Prepared p = bea::prepare(snap, opt);
          adv = std::make_unique<bea::Advanced>(bea::advance(p, opt.beta, age_s));
        }
        const bea::Advanced& a = *adv;
        py::dict snap = snapshot_dict(
            a.sched, [&a](int32_t k) -> const std::string& { return a.names[static_cast<size_t>(k)]; }, instance, model,
            seq, time + a.join_s);
        return py::make_tuple(snap, a.join_s, a.valid_from_s, a.valid_to_s, a.steps);
      },
      py::arg("snapshot"), py::arg("lengths"), py::arg("age_s"), py::arg("beta"), py::arg("default_output_tokens") = -1,
      py::arg("overrun_fraction") = 0.5,
      "Staleness compensation: run a sync-mode snapshot's residents alone (eq. 12 times, predicted lengths)\n"
      "through the steps that start before age_s. Returns (snapshot dict at the join time, join_s,\n"
      "valid_from_s, valid_to_s, steps); any age in (valid_from_s, valid_to_s] gives the same state.");
}
