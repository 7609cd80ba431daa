// Standalone driver for sanitizer builds: feeds files (or stdin) as msgpack snapshots through the
// parser, validator and a replay. Any input must end in a clean error or an estimate.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "bea/replay.h"
#include "bea/snapshot.h"
#include "bea/value.h"

static int run_one(const std::vector<uint8_t>& buf) {
  try {
    bea::Value v = bea::parse_msgpack(buf.data(), buf.size());
    bea::Snapshot s = bea::snapshot_from_value(v);
    bea::ReplayOptions opt;
    opt.beta = {0.001, 1e-5, 1e-7, 1e-9};
    opt.max_steps = 100000;
    bea::Prepared p = bea::prepare(s, opt);
    bea::Query q;
    q.prompt_tokens = 100;
    q.max_tokens = 16;
    if (q.prompt_tokens < s.config.max_model_len) (void)bea::estimate(p, q, opt);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  return 0;
}

#ifdef BEA_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> buf(data, data + size);
  return run_one(buf);
}
#else
int main(int argc, char** argv) {
  int n = 0;
  for (int k = 1; k < argc; ++k) {
    std::ifstream f(argv[k], std::ios::binary);
    std::vector<uint8_t> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    run_one(buf);
    ++n;
  }
  if (argc == 1) {
    std::vector<uint8_t> buf((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    run_one(buf);
    ++n;
  }
  std::printf("checked %d inputs\n", n);
  return 0;
}
#endif
