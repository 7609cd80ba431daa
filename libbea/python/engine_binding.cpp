// Binding of the simulated-instance engine (bea::Engine): a live vLLM V1 scheduler the sim
// instance drives step by step. Scheduling work runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/request_fields.h"
#include "bea/core/snapshot.h"
#include "bea/sim/engine.h"
#include "convert.h"
#include "snapshot_object.h"

namespace py = pybind11;
using bea::BatchFeatures;
using bea::Engine;
using bea::Scheduler;

namespace {

// The engine's state (between steps) as a snapshot model.
bea::Snapshot engine_state(const Engine& e, const std::string& instance, const std::string& model, double time) {
  bea::Snapshot snap = bea::capture(e.scheduler(), e.names());  // the true output lengths stay inside the engine
  snap.instance = instance;
  snap.model = model;
  snap.seq = e.seq();
  snap.time = time;
  return snap;
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
             double arrival, int64_t priority, std::vector<uint64_t> block_hashes) {
            e.add(id, prompt_tokens, max_tokens, true_output_tokens, arrival, priority, std::move(block_hashes));
          },
          py::arg("id"), py::arg("prompt_tokens"), py::arg("max_tokens"), py::arg("true_output_tokens"),
          py::arg("arrival") = 0.0, py::arg("priority") = 0, py::arg("block_hashes") = std::vector<uint64_t>{},
          "Queue a request that will stop after true_output_tokens (capped by max_tokens/max_model_len).\n"
          "block_hashes (prefix caching on): vLLM's hashes of its full blocks, prompt then answer tokens.")
      .def(
          "take_kv_events",
          [](Engine& e) {
            py::list out;
            for (const auto& ev : e.take_kv_events()) {
              const char* kind = ev.kind == bea::KvEvent::Stored ? "stored"
                                 : ev.kind == bea::KvEvent::Removed ? "removed"
                                                                    : "cleared";
              out.append(py::make_tuple(kind, py::cast(ev.hashes)));
            }
            return out;
          },
          "The prefix cache's KV events since the last call: [(stored|removed, [hash, ...]), ...] in order.")
      .def("cached_blocks", &Engine::cached_hashes, "The hash of every cached block (one entry per block).")
      .def("prefix_hit_tokens", &Engine::prefix_hit_tokens, py::arg("id"),
           "The prefix-cache hit a request had at its first admission (vLLM's num_cached_tokens; -1: not yet).")
      .def_property_readonly("prefix_caching", &Engine::has_prefix_cache)
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
            return bea_py::dict_from_value(bea::snapshot_to_value(engine_state(e, instance, model, time)));
          },
          py::arg("instance"), py::arg("model"), py::arg("time"),
          "The scheduler state as a bear.snapshot/1 map (call between steps).")
      .def(
          "tracked_snapshot",
          [](const Engine& e, const std::string& instance, const std::string& model, double time,
             std::vector<uint64_t> query_hashes) {
            bea::Query query;
            bea::Snapshot snap = e.tracked_state(query_hashes, query);
            snap.instance = instance;
            snap.model = model;
            snap.seq = e.seq();
            snap.time = time;
            py::dict q;
            q["hit_blocks"] = *query.hit_blocks;
            q["prefix_hit_tokens"] = query.prefix_hit_tokens;
            q["block_keys"] = query.block_keys;
            return py::make_tuple(bea_py::dict_from_value(bea::snapshot_to_value(snap)), q);
          },
          py::arg("instance"), py::arg("model"), py::arg("time"), py::arg("query_hashes") = std::vector<uint64_t>{},
          "The state as a bear.snapshot/1 map with its tracked-block table (prefix caching on), and the\n"
          "query's {hit_blocks, prefix_hit_tokens, block_keys} for a query whose full blocks hash to\n"
          "query_hashes. Waiting requests carry hit_blocks and their current hit as prefix_hit_tokens.")
      .def_property_readonly("seq", &Engine::seq)
      .def_property_readonly("in_step", &Engine::in_step)
      .def_property_readonly("has_work", &Engine::has_work)
      .def_property_readonly("live", &Engine::live)
      .def_property_readonly("table_size", &Engine::table_size)
      .def_property_readonly("n_running", [](const Engine& e) { return e.scheduler().running().size(); })
      .def_property_readonly("n_waiting", [](const Engine& e) { return e.scheduler().waiting().size(); })
      .def_property_readonly("free_blocks", [](const Engine& e) { return e.scheduler().free_blocks(); })
      .def_property_readonly("config",
                             [](const Engine& e) { return bea_py::dict_from_value(bea::config_to_value(e.scheduler().config())); });

  m.def(
      "engine_snapshot",
      [](const Engine& e, const std::string& instance, const std::string& model, double time) {
        return std::make_shared<bea_py::PySnapshot>(engine_state(e, instance, model, time));
      },
      py::arg("engine"), py::arg("instance"), py::arg("model"), py::arg("time"),
      "The engine's state (between steps) as a replay-ready Snapshot, without a dict round trip.");

  m.def(
      "engine_step_stats",
      [](Engine& e) -> py::object {
        int64_t items = 0, tokens = 0, ctx = 0, prefill = 0;
        double attn = 0.0;
        BatchFeatures f;
        {
          py::gil_scoped_release nogil;
          const auto& batch = e.step();
          for (const auto& it : batch) {
            ++items;
            tokens += it.n;
            ctx += it.context;
            const auto n = static_cast<double>(it.n);
            attn += n * static_cast<double>(it.context) + n * (n + 1.0) * 0.5;
            if (!bea::is_decode(it.n, it.context, e.scheduler().reqs()[static_cast<size_t>(it.req)].P)) prefill += it.n;
          }
          e.scheduler().add_features(batch, f);
        }
        if (items == 0) return py::none();
        return py::make_tuple(items, tokens, ctx, attn, f.decode_ctx, f.prefill_work, prefill);
      },
      py::arg("engine"),
      "schedule() one step and return its aggregate (requests, tokens, Σ context, Σ attention work over\n"
      "all items, eq. 12's Σ decode context and Σ prefill work, prefill tokens), or None when idle: what\n"
      "batch-time models and the calibrator's θ need, without per-request Python objects.");

  m.def(
      "engine_finish_events",
      [](Engine& e) {
        std::vector<Engine::Output> res;
        {
          py::gil_scoped_release nogil;
          res = e.finish_step();
        }
        py::list first, done;
        for (const auto& o : res) {
          if (o.output_tokens == 1) first.append(py::str(e.name(o.req)));
          if (o.finished) done.append(py::str(e.name(o.req)));
        }
        return py::make_tuple(first, done);
      },
      py::arg("engine"), "update_from_output(): (ids that got their first token, ids that finished).");

}
