// The bear.snapshot/1 model (design.md §3): one vLLM instance's scheduler state right after an
// engine step, validated once and then replayed many times.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/core/value.h"

namespace bea {

enum class Policy : uint8_t { Fcfs, Priority };

struct Config {
  int64_t max_num_batched_tokens = 0;
  int64_t max_num_scheduled_tokens = 0;  // defaults to max_num_batched_tokens
  int64_t max_num_seqs = 0;
  int64_t max_num_active_seqs = 0;  // defaults to max_num_seqs
  int64_t long_prefill_token_threshold = 0;
  bool long_prefill_token_threshold_adaptive = false;
  bool enable_chunked_prefill = true;
  Policy policy = Policy::Fcfs;
  int64_t block_size = 16;
  int64_t num_gpu_blocks = 0;
  int64_t watermark_blocks = 0;
  int64_t max_model_len = 0;
  bool scheduler_reserve_full_isl = true;
  bool enable_prefix_caching = false;
  bool async_scheduling = false;
  // vLLM >= 0.33: under PRIORITY a request that preempts itself lets phase 1 continue (0.32 breaks).
  bool priority_self_preempt_continues = false;
};

// One resident request. Token counts are bounded (validation) so that int64 arithmetic on them,
// including n * context products, cannot overflow.
struct Request {
  std::string id;
  int64_t prompt_tokens = 0;      // P
  int64_t computed_tokens = 0;    // C
  int64_t output_tokens = 0;      // O
  int64_t max_tokens = 0;
  int64_t blocks = 0;             // KV blocks held
  int64_t exclusive_blocks = 0;   // blocks whose ref count is 1 (returned on finish/preempt)
  int64_t preemptions = 0;
  int64_t placeholders = 0;       // async: sampled on device, not yet delivered
  int64_t prefix_hit_tokens = 0;  // waiting requests: expected prefix-cache hit at admission
  int64_t priority = 0;
  double arrival = 0.0;
  int64_t predicted_output = -1;  // predicted total output tokens; -1: unknown
  // With a snapshot's tracked-block table (Snapshot::tracked_blocks, tracked_ledger.h): a running
  // request's `tracked` blocks (indices into the table: its leading blocks, in block order); a
  // waiting request's `hit_blocks` (its hit chain, in order; absent: `prefix_hit_tokens` held
  // by running requests, the count model's rule).
  std::vector<int32_t> tracked;
  std::optional<std::vector<int32_t>> hit_blocks;
  // The content of its leading full blocks (any request, with the table): equal keys at the same
  // place name the same tokens (vLLM's block hashes, renamed), so that blocks it computes during
  // the replay are cached under them and a later hit finds them.
  std::vector<int64_t> block_keys;
  // With the table in stable form (Snapshot::pool): a running request's tracked blocks by block id.
  std::vector<int64_t> tracked_ids;
};

// One block of the tracked-block table in stable form (contract.md §2, `pool_table`): its ticket
// when free (sorting the free blocks by ticket gives the free queue's order; -1: held), the key of
// its content (-1: none, not cached), and for a cached block its stamp (cached blocks are listed
// in stamp order: the order a lookup of a key prefers; -1 otherwise).
struct PoolEntry {
  int64_t ticket = -1;
  int64_t key = -1;
  int64_t stamp = -1;
  bool operator==(const PoolEntry& o) const { return ticket == o.ticket && key == o.key && stamp == o.stamp; }
};

struct InflightItem {
  std::string id;
  int64_t n = 0;
  int64_t context = 0;
};

struct Inflight {
  double started = 0.0;
  std::vector<InflightItem> items;
};

struct Snapshot {
  std::string instance;
  std::string model;
  int64_t generation = 0;  // the engine process (seq restarts with it); 0: not given
  int64_t seq = 0;
  double time = 0.0;
  Config config;
  int64_t free_blocks = 0;
  std::vector<Request> running;
  std::vector<Request> waiting;
  std::optional<Inflight> inflight;
  // Tracked KV blocks (optional; tracked_ledger.h): each one's position in the free queue
  // (0 = popped next) or -1 (held). Empty: the replay counts blocks only (kv_cache.h).
  std::vector<int64_t> tracked_blocks;
  // Optional, one per tracked block: the key of its content (as Request::block_keys), or -1. A
  // block with a key is found by any hit that names the key (the query and waiting requests then
  // need only their block_keys, no hit_blocks); without, only through the requests that list it.
  std::vector<int64_t> tracked_keys;
  bool has_tracked = false;  // a table or some request's hit_blocks / block_keys: the replay keeps a ledger
  // The table in stable form (`pool_table`; instead of tracked_blocks / tracked_keys): block id ->
  // entry, every cached or free block and every block a running request tracks. A delta changes
  // it in place (`pool`); prepare() derives the indexed form (positions, indices) once per state.
  std::unordered_map<int64_t, PoolEntry> pool;
  int64_t pool_free = 0;  // entries with a ticket (at most free_blocks)
  bool has_pool = false;

  // Attach predicted total output lengths (id -> tokens); unknown ids keep their previous value.
  void set_output_lengths(const std::unordered_map<std::string, int64_t>& lengths);
};

// The new query the estimate is for.
struct Query {
  std::string id = "__query__";
  int64_t prompt_tokens = 0;
  int64_t max_tokens = 1;
  int64_t prefix_hit_tokens = 0;
  int64_t priority = 0;
  double arrival = 0.0;  // only used under PRIORITY ordering; 0 = "now" (after everyone resident)
  int64_t predicted_output = -1;  // for requests queued ahead of the query (see estimate's `ahead`)
  // vLLM runs n > 1 as n child requests queued together ("<k>_<id>"); children after the first
  // hit the first one's blocks (replay.cpp's enqueue).
  int64_t sequences = 1;
  // vLLM's SamplingParams.skip_reading_prefix_cache (on for prompt logprobs): no prefix hit.
  bool skip_reading_prefix_cache = false;
  // Its hit chain: indices into the snapshot's tracked_blocks (absent: prefix_hit_tokens, the
  // count model's rule).
  std::optional<std::vector<int32_t>> hit_blocks;
  std::vector<int64_t> block_keys;  // as Request::block_keys
};

constexpr int64_t kMaxTokens = int64_t{1} << 31;   // bound on any token count
constexpr int64_t kMaxBlocks = int64_t{1} << 31;   // bound on any block count
constexpr size_t kMaxRequests = 1u << 20;          // bound on resident requests
constexpr int64_t kMaxSequences = 1024;            // bound on a query's n

// Validation: throws std::invalid_argument naming the offending field. (Requests and the query
// are read by request_fields.h.)
Snapshot snapshot_from_value(const Value& v);
std::unordered_map<std::string, int64_t> lengths_from_value(const Value& v);

// Export: the bear.snapshot/1 map of a snapshot without an in-flight batch, and of a config
// (the fields a config map round-trips through).
Value snapshot_to_value(const Snapshot& s);
Value config_to_value(const Config& c);

}  // namespace bea
