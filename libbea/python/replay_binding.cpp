// Binding of the replay core: parse a snapshot once, estimate many queries against it, several
// instances per call (the GIL is released inside every replay); snapshot ageing; eq. 12
// features; the analytic estimators.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bea/core/ageing.h"
#include "bea/core/analytic.h"
#include "bea/core/replay.h"
#include "bea/core/request_fields.h"
#include "bea/core/snapshot.h"
#include "bea/core/value.h"
#include "convert.h"
#include "snapshot_object.h"

namespace py = pybind11;
using namespace bea;

using bea_py::coeffs_from;
using bea_py::PySnapshot;
using bea_py::to_value;

namespace {

const char* status_name(Status s) {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::Unschedulable: return "unschedulable";
    case Status::StepLimit: return "step_limit";
  }
  return "unknown";
}

ReplayOptions options(py::handle beta, bool trace, bool collapse, int64_t default_out, double overrun,
                      int64_t max_steps, double arrival_tokens_per_s = 0.0, double arrival_prompt_tokens = 0.0,
                      double length_sigma = 0.0, int64_t length_draws = 0) {
  ReplayOptions o;
  if (length_draws < 0 || length_draws > 1025) throw std::invalid_argument("length_draws must be in [0, 1025]");
  o.length_draws = length_draws;
  if (!std::isfinite(length_sigma) || length_sigma < 0.0 || length_sigma > 8.0)
    throw std::invalid_argument("length_sigma must be finite and in [0, 8]");
  o.length_sigma = length_sigma;
  if (!std::isfinite(arrival_tokens_per_s) || arrival_tokens_per_s < 0.0)
    throw std::invalid_argument("arrival_tokens_per_s must be finite and >= 0");
  if (!std::isfinite(arrival_prompt_tokens) || arrival_prompt_tokens < 0.0 || arrival_prompt_tokens > 1e12)
    throw std::invalid_argument("arrival_prompt_tokens must be finite and in [0, 1e12]");
  o.arrival_tokens_per_s = arrival_tokens_per_s;
  o.arrival_prompt_tokens = arrival_prompt_tokens;
  o.beta = coeffs_from(beta);
  o.trace = trace;
  o.collapse = collapse;
  o.default_output_tokens = default_out;
  if (!std::isfinite(overrun) || overrun < 0.0) throw std::invalid_argument("overrun_fraction must be >= 0");
  o.overrun_fraction = overrun;
  if (max_steps < 1) throw std::invalid_argument("max_steps must be >= 1");
  o.max_steps = max_steps;
  return o;
}

Query query_from(py::handle h) {
  if (py::isinstance<Query>(h)) return h.cast<Query>();
  return query_from_value(to_value(h, 0));
}

std::vector<ReplayOptions::Later> later_from(py::handle h) {
  std::vector<ReplayOptions::Later> out;
  if (h.is_none()) return out;
  for (auto item : py::reinterpret_borrow<py::sequence>(h)) {
    if (!py::isinstance<py::dict>(item)) throw std::invalid_argument("later: a list of request dicts with after_s");
    py::dict d = py::reinterpret_borrow<py::dict>(item).attr("copy")();
    if (!d.contains("after_s")) throw std::invalid_argument("later.after_s is required");
    const double after = d["after_s"].cast<double>();
    PyDict_DelItemString(d.ptr(), "after_s");
    out.push_back({after, query_from_value(to_value(d, 0))});
  }
  return out;
}

std::vector<Query> queries_from(py::handle h) {
  std::vector<Query> out;
  if (h.is_none()) return out;
  for (auto item : py::reinterpret_borrow<py::sequence>(h)) out.push_back(query_from(item));
  return out;
}

py::dict result_dict(const Estimate& e, const Prepared& p, const Query& q, bool trace,
                     const std::vector<Query>& ahead = {}) {
  py::dict d;
  d["ttft_s"] = e.ttft_s;
  d["n_batches"] = e.n_batches;
  d["status"] = status_name(e.status);
  if (trace) {
    py::list steps;
    const std::vector<std::string> arrivals = arrival_names(ahead, q);
    for (const auto& st : e.trace) {
      py::dict m;
      for (const auto& it : st) {
        // residents, then the requests queued ahead (in order), then the query (replay.cpp's enqueue)
        const auto k = static_cast<size_t>(it.req);
        const std::string& id = k < p.names.size() ? p.names[k] : arrivals.at(k - p.names.size());
        m[py::str(id)] = it.n;
      }
      steps.append(m);
    }
    d["batches"] = steps;
    py::list states;
    for (const auto& st : e.steps) {
      py::dict m;
      m["running"] = st.running;
      m["free_blocks"] = st.free_blocks;
      m["tokens"] = st.tokens;
      states.append(m);
    }
    d["steps"] = states;
  }
  return d;
}

}  // namespace

void bind_replay(py::module_& m) {
  py::class_<Query>(m, "Query", "A new query to place: prompt length, max_tokens, prefix-cache hit.")
      .def(py::init([](int64_t prompt_tokens, int64_t max_tokens, int64_t prefix_hit_tokens, std::string id,
                       int64_t priority, double arrival) {
             py::dict d;
             d["id"] = id;
             d["prompt_tokens"] = prompt_tokens;
             d["max_tokens"] = max_tokens;
             d["prefix_hit_tokens"] = prefix_hit_tokens;
             d["priority"] = priority;
             d["arrival"] = arrival;
             return query_from_value(to_value(d, 0));
           }),
           py::arg("prompt_tokens"), py::arg("max_tokens") = 1, py::arg("prefix_hit_tokens") = 0,
           py::arg("id") = "__query__", py::arg("priority") = 0, py::arg("arrival") = 0.0)
      .def_static("from_dict", [](py::handle d) { return query_from_value(to_value(d, 0)); })
      .def_readonly("id", &Query::id)
      .def_readonly("prompt_tokens", &Query::prompt_tokens)
      .def_readonly("max_tokens", &Query::max_tokens)
      .def_readonly("prefix_hit_tokens", &Query::prefix_hit_tokens)
      .def_readonly("hit_blocks", &Query::hit_blocks);

  py::class_<PySnapshot, std::shared_ptr<PySnapshot>>(m, "Snapshot",
                                                      "A validated bear.snapshot/1, parsed once and replayed many times.")
      .def_static(
          "from_dict", [](py::handle d) { return std::make_shared<PySnapshot>(snapshot_from_value(to_value(d, 0))); },
          "Build from a dict (e.g. decoded JSON); ValueError names the bad field.")
      .def_static(
          "from_msgpack",
          [](py::bytes b) {
            std::string_view sv = b;
            Value v;
            {
              py::gil_scoped_release nogil;
              v = parse_msgpack(reinterpret_cast<const uint8_t*>(sv.data()), sv.size());
            }
            return std::make_shared<PySnapshot>(snapshot_from_value(v));
          },
          "Build from msgpack bytes; ValueError on malformed input.")
      .def("set_output_lengths",
           [](PySnapshot& s, py::handle d) { s.set_lengths_from(d); },
           "Predicted total output tokens per resident request id.")
      .def_property_readonly("instance", [](const PySnapshot& s) { return s.snap().instance; })
      .def_property_readonly("model", [](const PySnapshot& s) { return s.snap().model; })
      .def_property_readonly("seq", [](const PySnapshot& s) { return s.snap().seq; })
      .def_property_readonly("generation", [](const PySnapshot& s) { return s.snap().generation; })
      .def_property_readonly("broken", &PySnapshot::broken, "A delta failed to apply: the state is unknown.")
      .def_property_readonly("time", [](const PySnapshot& s) { return s.snap().time; })
      .def_property_readonly("free_blocks", [](const PySnapshot& s) { return s.snap().free_blocks; })
      .def_property_readonly("tracked_blocks",
                             [](const PySnapshot& s) {
                               return s.snap().has_pool ? s.snap().pool.size() : s.snap().tracked_blocks.size();
                             },
                             "Entries of its tracked-block table, in either form (0: the replay counts blocks; a delta\n"
                             "without the table's change drops it).")
      .def_property_readonly("table_builds", &PySnapshot::table_builds,
                             "How many times this object built its tracked table: once per state estimated in, "
                             "shared by the state's prepared forms (point and drawn lengths).")
      .def_property_readonly("table_ready", &PySnapshot::table_ready,
                             "Whether the state's tracked table is built (False: the next estimate builds it).")
      .def_property_readonly("table_blocks", &PySnapshot::table_blocks,
                             "Blocks in the state's tracked table (0: none): building it is O(n log n), "
                             "milliseconds at GPU-sized pools.")
      .def_property_readonly("n_running", [](const PySnapshot& s) { return s.snap().running.size(); })
      .def_property_readonly("n_waiting", [](const PySnapshot& s) { return s.snap().waiting.size(); })
      .def_property_readonly("async_scheduling", [](const PySnapshot& s) { return s.snap().config.async_scheduling; })
      .def_property_readonly("max_num_seqs", [](const PySnapshot& s) { return s.snap().config.max_num_seqs; })
      .def_property_readonly("request_ids",
                             [](const PySnapshot& s) {
                               std::vector<std::string> ids;
                               for (const auto* l : {&s.snap().running, &s.snap().waiting})
                                 for (const auto& r : *l) ids.push_back(r.id);
                               return ids;
                             })
      .def("pending_prefill_tokens", [](const PySnapshot& s) { return pending_prefill_tokens(s.snap()); })
      .def(
          "pending_decode_tokens",
          [](PySnapshot& s, int64_t default_output_tokens) {
            ReplayOptions o;
            o.default_output_tokens = default_output_tokens;
            if (s.broken()) throw std::invalid_argument("snapshot: a delta failed to apply to it; its state is unknown");
            int64_t total = 0;  // from the requests alone: no prepared form (nor table) is built for it
            for (const auto* list : {&s.snap().running, &s.snap().waiting})
              for (const auto& r : *list) total += std::max<int64_t>(0, target_output(r, o) - r.output_tokens);
            return total;
          },
          py::arg("default_output_tokens") = -1,
          "Output tokens residents still have to generate, by their predicted lengths.");

  m.def(
      "estimate",
      [](PySnapshot& s, py::handle request, py::handle beta, py::handle lengths, bool trace, bool collapse,
         int64_t default_output_tokens, double overrun_fraction, int64_t max_steps, double age_s, py::handle ahead,
         double arrival_tokens_per_s, double arrival_prompt_tokens, double length_sigma, int64_t length_draws,
         bool draw_shortcut) {
        if (!lengths.is_none()) s.set_lengths_from(lengths);
        const Query q = query_from(request);
        const ReplayOptions opt = options(beta, trace, collapse, default_output_tokens, overrun_fraction, max_steps,
                                          arrival_tokens_per_s, arrival_prompt_tokens, length_sigma, length_draws);
        if (!std::isfinite(age_s) || age_s < 0.0) throw std::invalid_argument("age_s must be finite and >= 0");
        if (age_s > 0.0 && trace) throw std::invalid_argument("trace is not available with age_s > 0");
        const std::vector<Query> before = queries_from(ahead);
        std::shared_ptr<const Prepared> held;  // kept alive while the GIL is released
        Estimate e;
        {
          py::gil_scoped_release nogil;  // preparing a GPU-sized pool's state takes milliseconds
          held = s.prepared_ptr(opt);
          e = estimate_with_lengths(*held, q, opt, age_s, before, draw_shortcut);
        }
        return result_dict(e, *held, q, trace, before);
      },
      py::arg("snapshot"), py::arg("request"), py::arg("beta") = py::none(), py::arg("lengths") = py::none(),
      py::arg("trace") = false, py::arg("collapse") = true, py::arg("default_output_tokens") = -1,
      py::arg("overrun_fraction") = 0.5, py::arg("max_steps") = 2'000'000, py::arg("age_s") = 0.0,
      py::arg("ahead") = py::none(), py::arg("arrival_tokens_per_s") = 0.0, py::arg("arrival_prompt_tokens") = 0.0,
      py::arg("length_sigma") = 0.0, py::arg("length_draws") = 0, py::arg("draw_shortcut") = true,
      "Replay the snapshot with the new request; returns {ttft_s, n_batches, status[, batches]}.\n"
      "`length_sigma` > 0: residents already generating run to their median length given what they\n"
      "generated (σ of log(actual / predicted) of the instance's answers); with `length_draws` > 0 the\n"
      "estimate is instead the median over that many replays with every resident's length drawn\n"
      "(`draw_shortcut` false: every draw replayed even where none can differ from the point replay).\n"
      "`ahead`: requests dispatched to the instance after the capture (dicts like the request, with\n"
      "`predicted_output`); they queue in front of the new request. `arrival_tokens_per_s`: expected\n"
      "prompt tokens/s that others will send after it (they fill the leftover budget of its steps);\n"
      "`arrival_prompt_tokens` > 0: their mean prompt, charging the median count of whole prompts.\n"
      "With age_s > 0 (sync mode) the query arrives that long after the capture: residents first run\n"
      "through the steps that start before it (staleness compensation) and ttft_s counts from arrival.");

  m.def(
      "estimate_many",
      [](std::vector<std::shared_ptr<PySnapshot>> snaps, py::handle request, std::vector<py::object> betas,
         int64_t default_output_tokens, double overrun_fraction, std::vector<double> ages, py::handle aheads,
         std::vector<double> arrival_rates, py::handle laters, std::vector<double> arrival_prompts,
         std::vector<double> length_sigmas, int64_t length_draws) {
        if (!arrival_rates.empty() && arrival_rates.size() != snaps.size())
          throw std::invalid_argument("one arrival rate per snapshot");
        if (!length_sigmas.empty() && length_sigmas.size() != snaps.size())
          throw std::invalid_argument("one length sigma per snapshot");
        if (!arrival_prompts.empty() && arrival_prompts.size() != snaps.size())
          throw std::invalid_argument("one arrival prompt size per snapshot");
        if (betas.size() != snaps.size()) throw std::invalid_argument("one beta per snapshot");
        if (!ages.empty() && ages.size() != snaps.size()) throw std::invalid_argument("one age per snapshot");
        for (double a : ages)
          if (!std::isfinite(a) || a < 0.0) throw std::invalid_argument("ages must be finite and >= 0");
        std::vector<Query> qs;  // one for all, or one per snapshot (each its own prompt and hit)
        if (py::isinstance<py::list>(request) || py::isinstance<py::tuple>(request)) {
          qs = queries_from(request);
          if (qs.size() != snaps.size()) throw std::invalid_argument("one request per snapshot");
        } else {
          qs.assign(snaps.size(), query_from(request));
        }
        std::vector<ReplayOptions> opts;
        std::vector<std::shared_ptr<const Prepared>> preps;  // kept alive while the GIL is released
        opts.reserve(snaps.size());
        for (size_t k = 0; k < snaps.size(); ++k) {
          if (!snaps[k]) throw std::invalid_argument("snapshot is None");
          opts.push_back(options(betas[k], false, true, default_output_tokens, overrun_fraction, 2'000'000,
                                 arrival_rates.empty() ? 0.0 : arrival_rates[k],
                                 arrival_prompts.empty() ? 0.0 : arrival_prompts[k],
                                 length_sigmas.empty() ? 0.0 : length_sigmas[k], length_draws));
        }
        if (!laters.is_none()) {
          auto seq = py::reinterpret_borrow<py::sequence>(laters);
          if (seq.size() != snaps.size()) throw std::invalid_argument("one later list per snapshot");
          for (size_t k = 0; k < snaps.size(); ++k) opts[k].later = later_from(seq[k]);
        }
        preps.resize(snaps.size());
        std::vector<std::vector<Query>> before(snaps.size());
        if (!aheads.is_none()) {
          auto seq = py::reinterpret_borrow<py::sequence>(aheads);
          if (seq.size() != snaps.size()) throw std::invalid_argument("one ahead list per snapshot");
          for (size_t k = 0; k < snaps.size(); ++k) before[k] = queries_from(seq[k]);
        }
        std::vector<Estimate> out(snaps.size());
        std::vector<std::string> errors(snaps.size());
        {
          py::gil_scoped_release nogil;
          for (size_t k = 0; k < snaps.size(); ++k) {
            try {
              const double age = ages.empty() ? 0.0 : ages[k];
              preps[k] = snaps[k]->prepared_ptr(opts[k]);  // without the GIL: milliseconds at GPU-sized pools
              out[k] = estimate_with_lengths(*preps[k], qs[k], opts[k], age, before[k]);
            } catch (const std::exception& ex) {
              errors[k] = ex.what();
            }
          }
        }
        py::list res;
        for (size_t k = 0; k < snaps.size(); ++k) {
          if (!errors[k].empty()) throw std::invalid_argument(errors[k]);
          res.append(py::make_tuple(out[k].ttft_s, out[k].n_batches, status_name(out[k].status)));
        }
        return res;
      },
      py::arg("snapshots"), py::arg("request"), py::arg("betas"), py::arg("default_output_tokens") = -1,
      py::arg("overrun_fraction") = 0.5, py::arg("ages") = std::vector<double>{}, py::arg("aheads") = py::none(),
      py::arg("arrival_rates") = std::vector<double>{}, py::arg("laters") = py::none(),
      py::arg("arrival_prompts") = std::vector<double>{}, py::arg("length_sigmas") = std::vector<double>{},
      py::arg("length_draws") = 0,
      "Estimate one request against several instances in one call: [(ttft_s, n_batches, status), ...].\n"
      "`length_sigmas`: per snapshot, σ of log(actual / predicted) of its answers (0: residents run to\n"
      "their predictions; > 0: a resident k tokens in runs to its conditional median length, or, with\n"
      "`length_draws` > 0, the estimate is the median over that many replays with lengths drawn).\n"
      "`laters` (the error decomposition's oracle): per snapshot, the later arrivals known exactly, as\n"
      "request dicts with `after_s` (seconds after the query's arrival, ordered).\n"
      "`request`: one request for every snapshot, or a list with one per snapshot (a prompt length and\n"
      "prefix hit of its own at each instance).");

  m.def(
      "next_step_s",
      [](PySnapshot& s, py::handle beta, int64_t default_output_tokens, double overrun_fraction) {
        if (s.snap().config.async_scheduling) return 0.0;  // nothing to prepare for
        const ReplayOptions opt = options(beta, false, true, default_output_tokens, overrun_fraction, 1);
        py::gil_scoped_release nogil;
        return next_step_s(*s.prepared_ptr(opt), opt.beta);
      },
      py::arg("snapshot"), py::arg("beta"), py::arg("default_output_tokens") = -1, py::arg("overrun_fraction") = 0.5,
      "Eq. 12 seconds of the step the engine runs next from this state (sync mode; 0 when idle or\n"
      "async): how long the snapshot stays current while that step runs.");
  m.def(
      "batch_features",
      [](py::handle items) {
        BatchFeatures f;
        for (auto it : py::reinterpret_borrow<py::sequence>(items)) {
          auto d = py::reinterpret_borrow<py::dict>(it);
          const int64_t n = d["n"].cast<int64_t>();
          const int64_t ctx = d["context"].cast<int64_t>();
          if (n < 0 || ctx < 0 || n > kMaxTokens || ctx > kMaxTokens) throw std::invalid_argument("n/context out of range");
          f.add(n, ctx, d["decode"].cast<bool>());
        }
        return py::make_tuple(f.tokens, f.decode_ctx, f.prefill_work);
      },
      py::arg("items"), "Eq. 12 workload terms (Σn, Σ decode context, Σ prefill attention) of a bear.batch/1 item list.");
  m.def("is_decode", &is_decode, py::arg("n"), py::arg("context"), py::arg("prompt_tokens"),
        "Whether a step item counts as a decode in bear.batch/1 (n == 1 once the prompt is done).");
  m.def("pending_prefill_tokens", [](PySnapshot& s) { return pending_prefill_tokens(s.snap()); });
  m.def("prefill_throughput_ttft", &prefill_throughput_ttft, py::arg("pending_tokens"), py::arg("query_tokens"),
        py::arg("theta"), "Paper eq. 8.");
  m.def("lps_wait", &lps_wait, py::arg("alpha"), py::arg("mu"), py::arg("k"), "Paper eq. 13 (inf when rho >= 1).");
  m.def("lps_ttft", &lps_ttft, py::arg("alpha"), py::arg("mu"), py::arg("k"), py::arg("query_tokens"),
        py::arg("theta"), "Paper eq. 14.");
  m.def("lps_wait_corrected", &lps_wait_corrected, py::arg("alpha"), py::arg("mean_service"), py::arg("k"),
        py::arg("ca2"), py::arg("cs2"), "Paper eq. 15.");
  m.def(
      "time_estimates",
      [](PySnapshot& s, py::handle request, py::handle beta, int64_t reps, bool per_call, double length_sigma,
         int64_t length_draws, bool fresh) {
        if (reps < 1) throw std::invalid_argument("reps must be >= 1");
        const Query q = query_from(request);
        const ReplayOptions opt = options(beta, false, true, -1, 0.5, 2'000'000, 0.0, 0.0, length_sigma, length_draws);
        const auto held = s.prepared_ptr(opt);
        const Prepared& p = *held;
        const Snapshot& snap = s.snap();
        // one estimate as the worker makes it: against the prepared state, or (fresh) preparing it
        // first, as the first estimate after each engine step does
        auto one = [&]() {
          if (!fresh) return estimate_with_lengths(p, q, opt, 0.0);
          const Prepared pp = prepare(snap, opt);
          return estimate_with_lengths(pp, q, opt, 0.0);
        };
        std::vector<double> out;
        {
          py::gil_scoped_release nogil;
          using clock = std::chrono::steady_clock;
          volatile double sink = 0.0;
          if (per_call) {
            out.reserve(static_cast<size_t>(reps));
            for (int64_t k = 0; k < reps; ++k) {
              const auto t0 = clock::now();
              const Estimate e = one();
              const auto t1 = clock::now();
              sink = sink + e.ttft_s;
              out.push_back(std::chrono::duration<double>(t1 - t0).count());
            }
          } else {
            const auto t0 = clock::now();
            for (int64_t k = 0; k < reps; ++k) sink = sink + one().ttft_s;
            out.push_back(std::chrono::duration<double>(clock::now() - t0).count());
          }
        }
        return out;
      },
      py::arg("snapshot"), py::arg("request"), py::arg("beta"), py::arg("reps"), py::arg("per_call") = true,
      py::arg("length_sigma") = 0.0, py::arg("length_draws") = 0, py::arg("fresh") = false,
      "Benchmark helper: run the same estimate `reps` times in C++ (GIL released); per-call seconds, or [total].\n"
      "`length_sigma`, `length_draws`: as estimate's; `fresh`: prepare the state before each estimate (the\n"
      "first estimate after an engine step does; else the prepared state is shared).");

  m.def(
      "parse_msgpack_check",
      [](py::bytes b) {
        std::string_view sv = b;
        parse_msgpack(reinterpret_cast<const uint8_t*>(sv.data()), sv.size());
      },
      "Validate that bytes are one well-formed msgpack object (ValueError otherwise).");

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
        bea::Snapshot aged;
        bea::AgeWindow w;
        {
          py::gil_scoped_release nogil;
          bea::Snapshot snap = bea::snapshot_from_value(
              bea::parse_msgpack(reinterpret_cast<const uint8_t*>(sv.data()), sv.size()));
          snap.set_output_lengths(known);
          const bea::Prepared p = bea::prepare(snap, opt);
          const bea::Advanced a = bea::advance(p, opt.beta, age_s);
          w = a;
          aged = bea::capture(a.sched, p.names);  // request indices as in Prepared
          aged.instance = snap.instance;
          aged.model = snap.model;
          aged.seq = snap.seq;
          aged.time = snap.time + a.join_s;
        }
        return py::make_tuple(bea_py::dict_from_value(bea::snapshot_to_value(aged)), w.join_s, w.valid_from_s,
                              w.valid_to_s, w.steps);
      },
      py::arg("snapshot"), py::arg("lengths"), py::arg("age_s"), py::arg("beta"), py::arg("default_output_tokens") = -1,
      py::arg("overrun_fraction") = 0.5,
      "Staleness compensation: run a sync-mode snapshot's residents alone (eq. 12 times, predicted lengths)\n"
      "through the steps that start before age_s. Returns (snapshot dict at the join time, join_s,\n"
      "valid_from_s, valid_to_s, steps); any age in (valid_from_s, valid_to_s] gives the same state.");
}
