// Standalone driver for sanitizer builds: feeds files (or stdin) as msgpack snapshots through the
// parser, validator and a replay. Any input must end in a clean error or an estimate.
#include <cstdio>
#include <string>
#include <vector>

#include "driver.h"
#include "bea/core/replay.h"
#include "bea/core/snapshot.h"
#include "bea/core/value.h"

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

BEA_FUZZ_ENTRY(run_one)

#ifndef BEA_LIBFUZZER
int main(int argc, char** argv) {
  const int n = bea_fuzz::run_inputs(argc, argv, run_one);
  std::printf("checked %d inputs\n", n);
  return 0;
}
#endif
