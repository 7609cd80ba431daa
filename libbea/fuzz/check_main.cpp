// Standalone driver for sanitizer builds: feeds files (or stdin) as msgpack snapshots through the
// parser, validator and a replay — or, for a msgpack list [snapshot, delta, ...], applies the
// bear.delta/1 messages to the snapshot first. A snapshot map may carry the query (`query`: a
// request map, e.g. with a hit chain). Any input must end in a clean error or an estimate.
#include <cstdio>
#include <string>
#include <vector>

#include "driver.h"
#include "bea/core/replay.h"
#include "bea/core/request_fields.h"
#include "bea/core/snapshot.h"
#include "bea/core/snapshot_delta.h"
#include "bea/core/value.h"

static int run_one(const std::vector<uint8_t>& buf) {
  try {
    bea::Value v = bea::parse_msgpack(buf.data(), buf.size());
    const bool chain = v.type == bea::Value::Type::Arr && !v.arr.empty();
    bea::Snapshot s = bea::snapshot_from_value(chain ? v.arr[0] : v);
    if (chain) {
      bea::ResidentIds ids = bea::resident_ids(s);
      for (size_t k = 1; k < v.arr.size(); ++k) {
        const bea::DeltaHeader h = bea::delta_header(v.arr[k]);
        bea::apply_delta(s, ids, v.arr[k], h, [](const std::string& id) { return static_cast<int64_t>(id.size()); });
      }
    }
    bea::ReplayOptions opt;
    opt.beta = {0.001, 1e-5, 1e-7, 1e-9};
    opt.max_steps = 100000;
    opt.length_sigma = buf.size() % 2 ? 0.8 : 0.0;  // half the inputs with conditioned lengths,
    opt.length_draws = buf.size() % 4 == 1 ? 3 : 0;  // a quarter of them also with lengths drawn
    bea::Prepared p = bea::prepare(s, opt);
    bea::Query q;
    q.prompt_tokens = 100;
    q.max_tokens = 16;
    const bea::Value* query = chain ? nullptr : v.get("query");  // a test's query (hit chain, keys)
    if (query != nullptr) q = bea::query_from_value(*query);
    if (q.prompt_tokens < s.config.max_model_len) (void)bea::estimate_with_lengths(p, q, opt, 0.0);
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
