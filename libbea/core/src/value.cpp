#include "bea/core/value.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace bea {

const Value* Value::get(const char* key) const {
  if (type != Type::Map) return nullptr;
  for (const auto& kv : map)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

namespace {

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }

  uint8_t u8() {
    need(1);
    return p_[pos_++];
  }
  uint64_t be(size_t bytes) {
    need(bytes);
    uint64_t v = 0;
    for (size_t k = 0; k < bytes; ++k) v = (v << 8) | p_[pos_ + k];
    pos_ += bytes;
    return v;
  }
  std::string str(size_t len) {
    need(len);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }
  void skip(size_t len) {
    need(len);
    pos_ += len;
  }

  Value value(int depth) {
    if (depth > kMaxDepth) throw std::invalid_argument("msgpack: nesting too deep");
    Value v;
    const uint8_t t = u8();
    if (t <= 0x7f) return integer(static_cast<int64_t>(t));
    if (t >= 0xe0) return integer(static_cast<int64_t>(static_cast<int8_t>(t)));
    if ((t & 0xf0) == 0x80) return map(t & 0x0f, depth);
    if ((t & 0xf0) == 0x90) return array(t & 0x0f, depth);
    if ((t & 0xe0) == 0xa0) return string(t & 0x1f);
    switch (t) {
      case 0xc0: return v;
      case 0xc2: v.type = Value::Type::Bool; v.b = false; return v;
      case 0xc3: v.type = Value::Type::Bool; v.b = true; return v;
      case 0xc4: skip(be(1)); return v;  // bin: not used by the schema, read as nil
      case 0xc5: skip(be(2)); return v;
      case 0xc6: skip(be(4)); return v;
      case 0xca: {
        uint32_t bits = static_cast<uint32_t>(be(4));
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return real(static_cast<double>(f));
      }
      case 0xcb: {
        uint64_t bits = be(8);
        double d;
        std::memcpy(&d, &bits, sizeof d);
        return real(d);
      }
      case 0xcc: return integer(static_cast<int64_t>(be(1)));
      case 0xcd: return integer(static_cast<int64_t>(be(2)));
      case 0xce: return integer(static_cast<int64_t>(be(4)));
      case 0xcf: {
        uint64_t u = be(8);
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          throw std::invalid_argument("msgpack: integer out of range");
        return integer(static_cast<int64_t>(u));
      }
      case 0xd0: return integer(static_cast<int8_t>(be(1)));
      case 0xd1: return integer(static_cast<int16_t>(be(2)));
      case 0xd2: return integer(static_cast<int32_t>(be(4)));
      case 0xd3: return integer(static_cast<int64_t>(be(8)));
      case 0xd9: return string(be(1));
      case 0xda: return string(be(2));
      case 0xdb: return string(be(4));
      case 0xdc: return array(be(2), depth);
      case 0xdd: return array(be(4), depth);
      case 0xde: return map(be(2), depth);
      case 0xdf: return map(be(4), depth);
      default: break;  // ext types and reserved bytes
    }
    throw std::invalid_argument("msgpack: unsupported type byte");
  }

 private:
  void need(size_t k) const {
    if (k > n_ - pos_) throw std::invalid_argument("msgpack: truncated input");
  }
  static Value integer(int64_t x) {
    Value v;
    v.type = Value::Type::Int;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.type = Value::Type::Float;
    v.d = x;
    return v;
  }
  Value string(uint64_t len) {
    Value v;
    v.type = Value::Type::Str;
    v.s = str(static_cast<size_t>(len));
    return v;
  }
  Value array(uint64_t count, int depth) {
    // Every element takes at least one byte: a count larger than what is left is malformed,
    // and checking first keeps a hostile count from reserving gigabytes.
    if (count > left()) throw std::invalid_argument("msgpack: array longer than input");
    Value v;
    v.type = Value::Type::Arr;
    v.arr.reserve(static_cast<size_t>(count));
    for (uint64_t k = 0; k < count; ++k) v.arr.push_back(value(depth + 1));
    return v;
  }
  Value map(uint64_t count, int depth) {
    if (count > left() / 2) throw std::invalid_argument("msgpack: map longer than input");
    Value v;
    v.type = Value::Type::Map;
    v.map.reserve(static_cast<size_t>(count));
    for (uint64_t k = 0; k < count; ++k) {
      Value key = value(depth + 1);
      if (key.type != Value::Type::Str) throw std::invalid_argument("msgpack: map key is not a string");
      v.map.emplace_back(std::move(key.s), value(depth + 1));
    }
    return v;
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace

Value parse_msgpack(const uint8_t* data, size_t len) {
  if (data == nullptr && len != 0) throw std::invalid_argument("msgpack: null buffer");
  Reader r(data, len);
  Value v = r.value(0);
  if (r.left() != 0) throw std::invalid_argument("msgpack: trailing bytes after the object");
  return v;
}

}  // namespace bea
