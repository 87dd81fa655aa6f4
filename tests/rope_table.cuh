// tests/rope_table.cuh — a RoPE angle table in a pool buffer, for the GPU tests of RoPE and of the
// kernels that apply RoPE's backward in their stores (attention).
#pragma once
#include "../ops/rope.cuh"
#include "../runtime/pool.cuh"

namespace testutil {

// A table filled for positions t < T_max of head dim hd; the buffer lives as long as the table is used.
struct AngleTable {
  DeviceBuffer<float> cos_sin;  // [2, T_max, hd/2]
  RopeAngles angles;
};

inline AngleTable angle_table(int T_max, int hd, double theta) {
  AngleTable table;
  table.cos_sin = DeviceBuffer<float>(rope_angles_bytes(T_max, hd) / sizeof(float), Mem::Workspace, "test.rope.angles");
  table.angles = rope_angles_fill(table.cos_sin.ptr, T_max, hd, (float)theta, 0);
  return table;
}

}  // namespace testutil
