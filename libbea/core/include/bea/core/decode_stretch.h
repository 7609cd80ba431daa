// Closed-form decode stretches (sync mode): when every running request decodes one token per
// step and admission is blocked (full max_num_seqs, or KV), the composition is fixed except for
// contexts growing by one per step until the first finish or block exhaustion. Those steps are
// summed in closed form: k·(β0 + β1·R + β2·ΣC) + β2·R·k(k−1)/2 (docs/libbea.md, "Speed").
#pragma once

#include <cstdint>

#include "bea/core/batch_time.h"
#include "bea/core/scheduler.h"

namespace bea {

// Folds such a stretch (at most max_steps steps) into `s`, adding its eq. 12 time to `now`;
// returns the steps folded (0: the next step must run normally).
int64_t fold_decode_stretch(Scheduler& s, double& now, const Coeffs& beta, int64_t max_steps);

}  // namespace bea
