#pragma once

#include "fastdp/clip.h"

namespace fastdp {

// y = the clipped rows of x (fastdp/clip.h). x, y: contiguous [rows, channels, positions] of `kind`.
// Parallel over rows, or over row chunks when there are fewer rows than threads.
void clip_rows_cpu(const void* x, void* y, const ClipShape& shape, float bound, ScalarKind kind);

// dx = the gradient of the clip w.r.t. x for the upstream gradient `grad` (fastdp/clip.h); all three
// contiguous [rows, channels, positions] of `kind`.
void clip_rows_backward_cpu(const void* grad, const void* x, void* dx, const ClipShape& shape, float bound,
                            ScalarKind kind);

}  // namespace fastdp
