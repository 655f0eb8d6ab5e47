// The manifest fields the trainer writes into a checkpoint (train/checkpointing.cpp) and reads
// back: rng, lr_schedule, precision and layout. The checkpoint format keeps them as JSON objects
// (ckpt/format.h); here each is checked against the values the trainer documents
// (docs/checkpoint-format.md) before a resume or a conversion believes it.
#pragma once

#include <string>

#include "ckpt/format.h"
#include "core/status.h"

namespace strata {

// Corruption naming `manifest_path` and the field when one holds a value the trainer never
// writes: rng.data_order_seed not an integer from 0 to 2^64-1; lr_schedule.step not the
// checkpoint's step; precision.recipe not fp32, bf16 or fp8 (optionally followed by its moment
// format, as the trainer spells it), precision.moments not fp32, bf16 or int8,
// precision.moments_rounding not nearest or stochastic; layout.kind not "flat fp32 per tensor",
// layout.tensors not a count, layout.sharding without a world size from 1 or with a group
// owner outside it; any other key in these objects. Fields a checkpoint lacks (ones written
// before they existed) are not required.
Status check_trainer_fields(const ckpt::Manifest& manifest, const std::string& manifest_path);

}  // namespace strata
