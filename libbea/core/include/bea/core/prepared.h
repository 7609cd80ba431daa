// The replay-ready form of a snapshot: its request table flattened into scheduler records once
// (with the length policy applied), then shared by every estimate against the snapshot.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bea/core/replay_options.h"
#include "bea/core/request.h"
#include "bea/core/snapshot.h"
#include "bea/core/sync_fast_path.h"
#include "bea/core/tracked_table.h"

namespace bea {

// Replay-ready form of a snapshot: the request table flattened once, reused by every estimate.
struct Prepared {
  using Req = SchedRequest;
  Config cfg;
  int64_t free_blocks = 0;
  double time = 0.0;
  std::vector<Req> reqs;            // running first, then waiting, in snapshot order
  std::vector<std::string> names;   // ids, same order
  size_t n_running = 0;
  bool has_inflight = false;
  double inflight_start = 0.0;      // relative to `time`
  struct Item { int32_t req; int64_t n, context; bool samples; };
  std::vector<Item> inflight;       // items whose request is resident; others only cost time
  std::vector<std::pair<int64_t, int64_t>> inflight_orphans;  // (n, context) of unknown ids
  DecodeGroupStart decode_start;    // sync mode: the fast path's decode group at the start
  // A draw's form (draw_form) points here at its draw's group start (Prepared::drawn_starts of
  // the state it was made from) instead of holding a copy; null: decode_start.
  const DecodeGroupStart* start_of_draw = nullptr;
  const DecodeGroupStart& group_start() const { return start_of_draw != nullptr ? *start_of_draw : decode_start; }
  // The tracked-block table and the ledger's start (tracked_table.h; null: none, the count model
  // alone), shared by copies of this form (a draw's).
  bool tracked = false;  // Snapshot::has_tracked: estimates keep a TrackedLedger
  std::shared_ptr<const TrackedTable> table;
  // The residents' lengths drawn (ReplayOptions::length_draws > 0 with length_sigma > 0; else
  // empty): draw d's target per request at [(d − 1)·n, d·n), n = reqs.size().
  int64_t length_draws = 0;
  std::vector<int64_t> drawn_targets;
  // The fewest tokens any request still has to generate before its end, point or drawn (the
  // shortcut of estimate_with_lengths); int64 max when nothing is drawn.
  int64_t draw_margin = std::numeric_limits<int64_t>::max();
  // Per draw (index d − 1), computed once per state in prepare so that no estimate rebuilds them:
  // the fast path's decode group start with that draw's lengths, and the fewest tokens any
  // resident still has to generate before its end in that draw or at its point (a draw whose
  // margin the point replay's steps do not reach runs the point replay's steps: its estimate is
  // the point's; estimate_with_lengths).
  std::vector<DecodeGroupStart> drawn_starts;
  std::vector<int64_t> drawn_margins;
};

// `table`: the state's tracked table (tracked_table()) when one was built for another form of the
// same state (another length policy), shared; null: built here. The table depends on the state
// alone (the requests' counts and the pool), never on the options.
Prepared prepare(const Snapshot& s, const ReplayOptions& opt, std::shared_ptr<const TrackedTable> table = nullptr);

// The tracked-block table of `s` and the ledger's start (tracked_table.h; null when `s` has
// none), from `p`, any prepared form of `s`: the costly part of prepare() at GPU-sized pools
// (sorting tickets, stamps and keys), paid once per state whatever the forms asked for.
std::shared_ptr<const TrackedTable> tracked_table(const Snapshot& s, const Prepared& p);

// The output length the replay lets resident `r` run to (docs/libbea.md, "Output lengths").
int64_t target_output(const Request& r, const ReplayOptions& opt);

// `d` (a copy of `p`) with the residents' lengths of draw `draw` (1 … p.length_draws) in place,
// so that one copy serves every draw: each a log-normal with mean the prediction and the
// options' σ, given that it exceeds what the resident has generated (docs/libbea.md, "Output
// lengths drawn"; drawn once per state, in prepare, the same for every estimate against it).
void use_drawn_lengths(Prepared& d, const Prepared& p, int64_t draw);

// What a draw's replay reads of `p` (everything but the names and the draws themselves), for
// use_draw: the one copy an estimate with draws makes (the names' strings and the draws' tables
// are what made copying the whole form dear).
Prepared draw_form(const Prepared& p);

// `d` (draw_form(p)) with the lengths of draw `draw` (1 … p.length_draws) in place and its group
// start taken from p.drawn_starts (no rebuild): the same replay as use_drawn_lengths gives.
// `d` must not outlive `p`.
void use_draw(Prepared& d, const Prepared& p, int64_t draw);

}  // namespace bea
