// A snapshot's tracked-block table as the replay's ledger reads it (tracked_ledger.h): what
// prepare() derives from the snapshot once per state, and the ledger's start built from it —
// every block's place, holders and key, the running requests' holdings, the index by key, the
// free queue's order. Shared read-only by every replay against the state; each replay keeps
// only what it changes, so that an estimate costs what the replay touches, not the pool's size.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace bea {

// One block the ledger follows.
struct TrackedBlock {
  int64_t abs = 0;      // ordinal in the free queue (when queued; tracked_ledger.h)
  int64_t key = -1;     // its content (block keys), -1: unknown
  int32_t ref = 0;      // holders
  bool queued = false;  // in the free queue
  bool cached = false;  // its content is hashed (a hit can use it)
  bool alive = true;    // not evicted
};

// One request's blocks, in block order: `phantom` leading hit blocks held by others (the count
// model's reported hit), its `tracked` blocks, then `own` untracked blocks only it holds.
struct TrackedHolder {
  std::vector<int32_t> chain;  // waiting: its hit chain (tracked blocks, after the phantom ones)
  bool has_chain = false;      // chain or keys given: the ledger finds its hit (else: reported)
  int64_t reported = 0;        // reported hit tokens (requests without a chain)
  std::vector<int64_t> keys;
  std::vector<int32_t> tracked;
  int64_t phantom = 0, own = 0;
  int64_t held = 0;            // phantom + tracked + own
  int64_t full = 0;            // leading blocks cached (full, computed)
};

struct TrackedTable {
  // From the snapshot: per tracked block its free-queue position (-1: held) and its content's key
  // (-1: none; empty: none given); per request (Prepared's order) its tracked blocks (running) or
  // hit chain (waiting, when has_chain), and its block keys.
  std::vector<int64_t> pos;
  std::vector<int64_t> keys;
  std::vector<std::vector<int32_t>> chains;
  std::vector<uint8_t> has_chain;
  std::vector<std::vector<int64_t>> req_keys;

  // The ledger at the snapshot (TrackedLedger::start; empty until then).
  bool started = false;
  std::vector<TrackedBlock> blocks;     // the table's, then the blocks its running requests computed
  std::vector<TrackedHolder> holders;   // per request
  std::vector<int64_t> computed;        // per running request: the tokens the start counted computed
  std::vector<std::pair<int64_t, int32_t>> by_key;  // (key, block) of the keyed cached blocks, by key, first cached first
  std::vector<std::pair<int64_t, int32_t>> queue;   // (ordinal, block) of the queued blocks, front first
  int64_t free = 0, end = 0;            // free blocks; the ordinal after the queue's back
};

}  // namespace bea
