// Binding of the predictor's native parts (bea/prompt_text.h, bea/forest.h) for
// services/predictor: prompt analysis and single-row evaluation of the LightGBM heads.
//
// GIL: released only when the work is large enough for the release to pay for itself
// (a prompt over kReleaseBytes, a forest evaluation over kReleaseNodes tree visits). A short call
// keeps it: releasing and re-acquiring costs little, but re-acquiring can wait up to Python's
// switch interval (5 ms) when another thread is running Python code, which would be the
// dominant cost of a ~20 µs call on the predictor's event loop.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bea/predictor/forest.h"
#include "bea/predictor/prompt_text.h"

namespace py = pybind11;

namespace {

constexpr size_t kReleaseBytes = 64 * 1024;
constexpr size_t kReleaseNodes = 20000;

// UTF-8 bytes of a str (the interpreter's cached UTF-8, no copy for ASCII) or of a bytes object.
// A str with lone surrogates is encoded with ``errors`` ("replace" for the pieces, as the features
// were defined; "surrogatepass" for the indicators, which see a surrogate as a code point).
struct Utf8 {
  const uint8_t* data = nullptr;
  size_t size = 0;
  py::object keep;  // owns a re-encoded copy when one was needed
};

Utf8 utf8_of(py::handle text, const char* errors = "replace") {
  Utf8 u;
  if (PyUnicode_Check(text.ptr())) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
    if (p == nullptr) {
      PyErr_Clear();
      PyObject* b = PyUnicode_AsEncodedString(text.ptr(), "utf-8", errors);
      if (b == nullptr) throw py::error_already_set();
      u.keep = py::reinterpret_steal<py::object>(b);
      p = PyBytes_AS_STRING(b);
      n = PyBytes_GET_SIZE(b);
    }
    u.data = reinterpret_cast<const uint8_t*>(p);
    u.size = static_cast<size_t>(n);
    return u;
  }
  if (PyBytes_Check(text.ptr())) {
    u.data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(text.ptr()));
    u.size = static_cast<size_t>(PyBytes_GET_SIZE(text.ptr()));
    return u;
  }
  throw py::type_error("text must be str or bytes");
}

template <typename T>
std::vector<T> vec(const py::array_t<T, py::array::c_style | py::array::forcecast>& a, const char* name) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string("forest: ") + name + " must be one-dimensional");
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

std::vector<std::string> strings(py::handle seq) {
  std::vector<std::string> out;
  for (auto item : py::reinterpret_borrow<py::iterable>(seq)) out.push_back(item.cast<std::string>());
  return out;
}

}  // namespace

void bind_predictor(py::module_& m) {
  using bea::prompt::kHashDim;

  m.def(
      "prompt_piece_hashes",
      [](py::handle text) {
        Utf8 u = utf8_of(text);
        std::vector<uint64_t> h;
        size_t head_end = 0, tail_start = 0;
        bea::prompt::hash_ranges(u.data, u.size, &head_end, &tail_start);
        bea::prompt::hash_window(u.data, head_end, h);
        if (tail_start < u.size) bea::prompt::hash_window(u.data + tail_start, u.size - tail_start, h);
        const bea::prompt::PieceCounts c = bea::prompt::count_pieces(u.data, u.size);
        py::array_t<uint64_t> arr(static_cast<py::ssize_t>(h.size()));
        std::copy(h.begin(), h.end(), arr.mutable_data());
        return py::make_tuple(std::move(arr), c.n_pieces, c.n_sentences);
      },
      py::arg("text"), "(hashes of the pieces of the hashed window, pieces, sentences), for tests.");

  py::class_<bea::prompt::Indicators>(m, "PromptIndicators",
                                      "The keyword and length-limit indicators (features.py's tables).")
      .def(py::init([](py::list flags, py::handle leads, py::handle units, std::vector<double> factors,
                       py::handle question_words) {
             std::vector<bea::prompt::IndicatorSpec> specs;
             for (auto f : flags) {
               auto t = py::reinterpret_borrow<py::tuple>(f);
               if (t.size() != 3) throw std::invalid_argument("flag spec: (words, phrases, is_question)");
               bea::prompt::IndicatorSpec s;
               s.words = strings(t[0]);
               s.phrases = strings(t[1]);
               s.question = t[2].cast<bool>();
               specs.push_back(std::move(s));
             }
             bea::prompt::LimitSpec lim;
             lim.leads = strings(leads);
             lim.units = strings(units);
             lim.factors = std::move(factors);
             return bea::prompt::Indicators(std::move(specs), std::move(lim), strings(question_words));
           }),
           py::arg("flags"), py::arg("leads"), py::arg("units"), py::arg("factors"), py::arg("question_words"))
      .def_property_readonly("n_flags", &bea::prompt::Indicators::n_flags);

  m.def(
      "prompt_analyse",
      [](py::handle text, const bea::prompt::Indicators& ind) {
        Utf8 u = utf8_of(text);
        // The indicators read the same bytes unless a str has lone surrogates.
        Utf8 v = u.keep ? utf8_of(text, "surrogatepass") : Utf8{u.data, u.size, py::object()};
        const bool is_str = PyUnicode_Check(text.ptr());
        py::array_t<double> hashed(static_cast<py::ssize_t>(kHashDim));
        py::array_t<double> scalars(static_cast<py::ssize_t>(5 + ind.n_flags()));
        double* h = hashed.mutable_data();
        double* s = scalars.mutable_data();
        bea::prompt::PieceCounts c;
        int64_t n_chars = is_str ? static_cast<int64_t>(PyUnicode_GET_LENGTH(text.ptr())) : 0;
        auto work = [&] {
          c = bea::prompt::hashed_features(u.data, u.size, h);
          const std::string low = bea::prompt::indicator_text(v.data, v.size);
          ind.evaluate(low, s + 4);
          if (!is_str) n_chars = bea::prompt::count_code_points(v.data, v.size);
        };
        if (u.size >= kReleaseBytes) {
          py::gil_scoped_release nogil;
          work();
        } else {
          work();
        }
        s[0] = static_cast<double>(c.n_pieces);
        s[1] = static_cast<double>(n_chars);
        s[2] = static_cast<double>(c.n_sentences);
        s[3] = static_cast<double>(n_chars) / static_cast<double>(c.n_pieces > 1 ? c.n_pieces : 1);
        return py::make_tuple(std::move(hashed), std::move(scalars), c.n_pieces);
      },
      py::arg("text"), py::arg("indicators"),
      "(hashed [512], scalars [n_pieces, n_chars, n_sentences, chars/piece, limit, flags...], pieces) of a "
      "prompt (str, or UTF-8 bytes).");

  py::class_<bea::Forest>(m, "Forest", "LightGBM regression heads flattened for single-row evaluation.")
      .def(py::init<int32_t>(), py::arg("n_features"))
      .def_property_readonly("n_features", &bea::Forest::n_features)
      .def_property_readonly("n_heads", &bea::Forest::n_heads)
      .def_property_readonly("n_trees", &bea::Forest::n_trees)
      .def("add_head", &bea::Forest::add_head)
      .def(
          "add_tree",
          [](bea::Forest& f, const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& split_feature,
             const py::array_t<double, py::array::c_style | py::array::forcecast>& threshold,
             const py::array_t<int8_t, py::array::c_style | py::array::forcecast>& decision_type,
             const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& left_child,
             const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& right_child,
             const py::array_t<double, py::array::c_style | py::array::forcecast>& leaf_value,
             const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& cat_boundaries,
             const py::array_t<uint32_t, py::array::c_style | py::array::forcecast>& cat_threshold) {
            bea::TreeArrays t;
            t.split_feature = vec(split_feature, "split_feature");
            t.threshold = vec(threshold, "threshold");
            t.decision_type = vec(decision_type, "decision_type");
            t.left_child = vec(left_child, "left_child");
            t.right_child = vec(right_child, "right_child");
            t.leaf_value = vec(leaf_value, "leaf_value");
            t.cat_boundaries = vec(cat_boundaries, "cat_boundaries");
            t.cat_threshold = vec(cat_threshold, "cat_threshold");
            f.add_tree(t);
          },
          py::arg("split_feature"), py::arg("threshold"), py::arg("decision_type"), py::arg("left_child"),
          py::arg("right_child"), py::arg("leaf_value"), py::arg("cat_boundaries"), py::arg("cat_threshold"))
      .def(
          "predict",
          [](const bea::Forest& f, const py::array_t<double, py::array::c_style | py::array::forcecast>& x) {
            if (x.ndim() != 2 || x.shape(1) != f.n_features())
              throw std::invalid_argument("forest: expected rows of " + std::to_string(f.n_features()) + " features");
            const auto n_rows = static_cast<size_t>(x.shape(0));
            py::array_t<double> out({static_cast<py::ssize_t>(f.n_heads()), static_cast<py::ssize_t>(n_rows)});
            double* o = out.mutable_data();
            const double* rows = x.data();
            if (n_rows * f.n_trees() >= kReleaseNodes) {
              py::gil_scoped_release nogil;
              f.predict(rows, n_rows, o);
            } else {
              f.predict(rows, n_rows, o);
            }
            return out;
          },
          py::arg("x"), "Raw scores, shape (heads, rows).")
      .def(
          "predict_parts",
          [](const bea::Forest& f, const py::array_t<double, py::array::c_style | py::array::forcecast>& a,
             const py::array_t<double, py::array::c_style | py::array::forcecast>& b,
             const py::array_t<double, py::array::c_style | py::array::forcecast>& parts,
             const std::vector<int64_t>& ids) {
            // Row i = [a, b, parts[ids[i]]]: the shared prompt features and one model's part.
            if (a.ndim() != 1 || b.ndim() != 1 || parts.ndim() != 2)
              throw std::invalid_argument("forest: a, b must be vectors and parts a matrix");
            const auto na = static_cast<size_t>(a.shape(0));
            const auto nb = static_cast<size_t>(b.shape(0));
            const auto np_ = static_cast<size_t>(parts.shape(1));
            const auto nf = static_cast<size_t>(f.n_features());
            if (na + nb + np_ != nf)
              throw std::invalid_argument("forest: expected " + std::to_string(nf) + " features in total");
            for (int64_t id : ids) {
              if (id < 0 || id >= parts.shape(0)) throw std::invalid_argument("forest: part index out of range");
            }
            std::vector<double> x(ids.size() * nf);
            for (size_t r = 0; r < ids.size(); ++r) {
              double* row = x.data() + r * nf;
              std::copy(a.data(), a.data() + na, row);
              std::copy(b.data(), b.data() + nb, row + na);
              const double* part = parts.data() + static_cast<size_t>(ids[r]) * np_;
              std::copy(part, part + np_, row + na + nb);
            }
            py::array_t<double> out({static_cast<py::ssize_t>(f.n_heads()), static_cast<py::ssize_t>(ids.size())});
            double* o = out.mutable_data();
            if (ids.size() * f.n_trees() >= kReleaseNodes) {
              py::gil_scoped_release nogil;
              f.predict(x.data(), ids.size(), o);
            } else {
              f.predict(x.data(), ids.size(), o);
            }
            return out;
          },
          py::arg("a"), py::arg("b"), py::arg("parts"), py::arg("ids"),
          "Raw scores, shape (heads, len(ids)), of the rows [a, b, parts[id]] for id in ids.");
}
