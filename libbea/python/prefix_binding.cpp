// Binding of vLLM's block hashing (bea/prefix/block_hash.h) for services/prefix: the block-hash
// chain of a prompt's token ids, with the hasher's memo.
//
// Token ids come as packed little-endian uint32 (bytes, as the estimate request carries them, or
// any buffer of 4-byte unsigned items: memoryview.cast("I"), array("I"), numpy uint32) without a
// copy, or as a sequence of ints (copied). GIL: released only for a call that may hash many
// blocks (kReleaseTokens or more); a short one keeps it, as re-acquiring can wait for Python's
// switch interval (see predictor_binding.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bea/prefix/block_hash.h"

namespace py = pybind11;
using bea::prefix::BlockHasher;
using bea::prefix::Digest;

namespace {

constexpr size_t kReleaseTokens = 16384;

bool little_endian() {
  const uint16_t one = 1;
  uint8_t first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

// A view of token ids as uint32; `copy` owns them when the input could not be used in place.
struct Tokens {
  const uint32_t* data = nullptr;
  size_t size = 0;
  std::vector<uint32_t> copy;
  std::optional<py::buffer_info> info;  // keeps a buffer export alive
};

void own(Tokens& t, const uint8_t* le_bytes, size_t n) {
  t.copy.resize(n);
  for (size_t k = 0; k < n; ++k) {
    const uint8_t* p = le_bytes + 4 * k;
    t.copy[k] = uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  }
  t.data = t.copy.data();
  t.size = n;
}

void in_place(Tokens& t, const void* p, size_t n, bool native) {
  if (native && reinterpret_cast<uintptr_t>(p) % alignof(uint32_t) == 0) {
    t.data = static_cast<const uint32_t*>(p);
    t.size = n;
  } else if (native && little_endian()) {
    own(t, static_cast<const uint8_t*>(p), n);  // unaligned: copy (little-endian == native here)
  } else if (!native) {
    own(t, static_cast<const uint8_t*>(p), n);
  } else {
    t.copy.resize(n);
    std::memcpy(t.copy.data(), p, 4 * n);
    t.data = t.copy.data();
    t.size = n;
  }
}

Tokens tokens_of(const py::handle& obj) {
  Tokens t;
  if (PyBytes_Check(obj.ptr())) {  // the wire form: little-endian uint32
    const size_t n = static_cast<size_t>(PyBytes_GET_SIZE(obj.ptr()));
    if (n % 4 != 0) throw py::value_error("packed token ids: length " + std::to_string(n) + " is not a multiple of 4");
    in_place(t, PyBytes_AS_STRING(obj.ptr()), n / 4, little_endian());
    return t;
  }
  if (PyObject_CheckBuffer(obj.ptr()) && !PyUnicode_Check(obj.ptr())) {
    py::buffer buf = py::reinterpret_borrow<py::buffer>(obj);
    t.info.emplace(buf.request());
    const py::buffer_info& bi = *t.info;
    std::string fmt = bi.format;
    if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')) fmt = fmt.substr(1);
    const bool u32 = bi.itemsize == 4 && (fmt == "I" || fmt == "L");
    if (!u32 || bi.ndim != 1 || bi.strides[0] != 4) {
      throw py::value_error("token ids: a buffer of contiguous 4-byte unsigned ints is expected (format " + bi.format +
                            ")");
    }
    const bool native = bi.format[0] != '<' || little_endian();
    in_place(t, bi.ptr, static_cast<size_t>(bi.shape[0]), native);
    return t;
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  const size_t n = py::len(seq);
  t.copy.resize(n);
  for (size_t k = 0; k < n; ++k) {
    const auto v = seq[k].cast<long long>();
    if (v < 0 || v > 0xffffffffLL) throw py::value_error("token id out of range: " + std::to_string(v));
    t.copy[k] = static_cast<uint32_t>(v);
  }
  t.data = t.copy.data();
  t.size = n;
  return t;
}

Digest digest_of(const py::bytes& b) {
  std::string s = b;
  if (s.size() != 32) throw py::value_error("a block digest is 32 bytes");
  Digest d;
  std::memcpy(d.data(), s.data(), 32);
  return d;
}

py::bytes as_bytes(const Digest& d) { return py::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

}  // namespace

void bind_prefix(py::module_& m) {
  py::class_<BlockHasher>(m, "BlockHasher",
                          "vLLM's block-hash chain under one (algo, block size, NONE_HASH), memoised.")
      .def(py::init([](const std::string& algo, int block_size, const py::bytes& none_hash, size_t memo) {
             return new BlockHasher(bea::prefix::algo_from_name(algo), block_size, digest_of(none_hash), memo);
           }),
           py::arg("algo"), py::arg("block_size"), py::arg("none_hash"), py::arg("memo") = 65536)
      .def(
          "chain",
          [](BlockHasher& h, const py::object& tokens, size_t first, size_t count, const py::object& parent,
             bool want_digests) -> py::tuple {
            Tokens t = tokens_of(tokens);
            const Digest p = parent.is_none() ? h.none_hash() : digest_of(parent.cast<py::bytes>());
            std::vector<uint64_t> names;
            std::vector<Digest> digests;
            const size_t b = static_cast<size_t>(h.block_size());
            const size_t work = std::min(count, t.size / b) * b;
            if (work >= kReleaseTokens) {
              py::gil_scoped_release release;
              h.chain(t.data, t.size, first, count, p, &digests, &names);
            } else {
              h.chain(t.data, t.size, first, count, p, &digests, &names);
            }
            py::list out_names(names.size());
            for (size_t k = 0; k < names.size(); ++k) out_names[k] = py::int_(names[k]);
            py::object last = digests.empty() ? py::object(py::none()) : py::object(as_bytes(digests.back()));
            if (!want_digests) return py::tuple(py::make_tuple(out_names, last));
            py::list out_digests(digests.size());
            for (size_t k = 0; k < digests.size(); ++k) out_digests[k] = as_bytes(digests[k]);
            return py::tuple(py::make_tuple(out_names, last, out_digests));
          },
          py::arg("tokens"), py::arg("first"), py::arg("count"), py::arg("parent") = py::none(),
          py::arg("digests") = false,
          "(names, last digest[, digests]) of full blocks [first, first + count) of ``tokens``, block "
          "``first``'s parent being ``parent`` (None: NONE_HASH).")
      .def_property_readonly("block_size", &BlockHasher::block_size)
      .def_property_readonly("memo_size", &BlockHasher::memo_size)
      .def_property_readonly("memo_hits", &BlockHasher::memo_hits);
  m.def(
      "prefix_held_run",
      [](BlockHasher& h, const py::object& tokens, size_t max_blocks, const py::list& holders) {
        Tokens t = tokens_of(tokens);
        std::vector<PyObject*> hs;
        for (const auto& x : holders) hs.push_back(x.ptr());
        std::vector<size_t> run(hs.size(), 0), alive(hs.size());
        for (size_t i = 0; i < alive.size(); ++i) alive[i] = i;
        bool failed = false;
        if (!hs.empty()) {
          h.walk(t.data, t.size, max_blocks, [&](uint64_t name) {
            PyObject* key = PyLong_FromUnsignedLongLong(name);
            if (key == nullptr) {
              failed = true;
              return false;
            }
            size_t kept = 0;
            for (size_t j = 0; j < alive.size() && !failed; ++j) {
              PyObject* c = hs[alive[j]];
              const int in = PyDict_CheckExact(c) ? PyDict_Contains(c, key) : PySequence_Contains(c, key);
              if (in < 0) failed = true;
              if (in > 0) {
                ++run[alive[j]];
                alive[kept++] = alive[j];
              }
            }
            Py_DECREF(key);
            alive.resize(kept);
            return !failed && !alive.empty();
          });
        }
        if (failed) throw py::error_already_set();
        return run;
      },
      py::arg("hasher"), py::arg("tokens"), py::arg("max_blocks"), py::arg("holders"),
      "How many leading blocks of `tokens` (at most `max_blocks`) each holder (a dict or set of block\n"
      "names) holds: the chain walked block by block, from a recent walk's links where the prompt repeats\n"
      "one, until no holder holds the block (one call instead of a Python loop per block).");
  m.def(
      "prefix_serialize_block",
      [](const std::string& algo, const py::bytes& parent, const py::object& tokens) {
        Tokens t = tokens_of(tokens);
        std::vector<uint8_t> out;
        bea::prefix::serialize_block(bea::prefix::algo_from_name(algo), digest_of(parent), t.data, t.size, out);
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
      },
      py::arg("algo"), py::arg("parent"), py::arg("tokens"),
      "The bytes vLLM hashes for one block (pickle or canonical CBOR of (parent, tuple(tokens), None)).");
  m.def(
      "prefix_sha256", [](const py::bytes& data) {
        std::string s = data;
        return as_bytes(bea::prefix::sha256(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
      },
      py::arg("data"), "SHA-256 of ``data`` (libbea's own implementation).");
  m.attr("PREFIX_MAX_BLOCK_SIZE") = bea::prefix::kMaxBlockSize;
}
