// ulysses.cuh — Ulysses' all-to-all (notes/design.md §5, notes/sequence_parallel.md): the D ranks of a
// sequence group trade sequence shards for head shards around attention, and back. Twin of
// ref/ulysses.hpp.
//
// Shapes on rank r of the group `seq` (D = seq.size ranks; config.hpp's sequence_split says which world
// ranks form it): B sequences of T tokens; a token's row holds G = parts tensors side by side (3: the
// model's q, k, v; 1: one tensor), each of nh heads of hd; nh/D = hl heads, T/D = Tl tokens per rank.
//   sequence shard  x [B, Tl, G, nh, hd]   the tokens [r·Tl, (r+1)·Tl) of each sequence, every head
//   head shard      y [B, T, G, hl, hd]    every token, the heads [r·hl, (r+1)·hl)
// With G = 3 the head shard is the qkv [B·T, 3·hl·hd] that attention_forward takes for hl heads.
//   ulysses_to_heads     y (=) ← the group's x:  y[b, s·Tl + i, g, j, e] = x of rank s [b, i, g, r·hl + j, e]
//   ulysses_to_sequence  x (=) ← the group's y:  x[b, i, g, p·hl + j, e] = y of rank p [b, r·Tl + i, g, j, e]
// Each is a permutation of the group's elements and the other's inverse, so the gradient of each is the
// other applied to its output's gradient: dx (=) = ulysses_to_sequence(dy), dy (=) = ulysses_to_heads(dx),
// bit for bit (nothing is added or rounded).
//
// Schedule of one direction, on the caller's stream: a pack kernel copies the input into a send buffer
// laid out [D (peer), B, Tl, G, hl, hd], so that the message for each peer is contiguous (to_heads
// sends peer p the heads of p of this rank's tokens; to_sequence sends peer p the tokens of p of this
// rank's heads); one all-to-all of equal messages (runtime/comm.cuh's all_to_all_v: one NCCL group of
// ncclSend/ncclRecv) fills a receive buffer of the same layout, [D (source), B, Tl, G, hl, hd]; an unpack
// kernel copies it into the output. The kernels move rows of hd elements, in 16-byte pieces where hd
// and the buffers allow (ops/common.cuh's row_pieces), one element at a time otherwise. Every rank of
// the group takes part, with the same B, T, G, nh and hd.
//
// Live set (b = bytes per floatX): the send and receive buffers (Mem::CommStaging), each the size of a
// shard, B·Tl·G·nh·hd elements, both live during the exchange and freed before return (ordered on
// `stream`):
//   peak  2·B·(T/D)·G·nh·hd·b   (ulysses_staging_bytes)
// the same in both directions: 2/D of the group's whole tensor, twice the input it replaces.
#pragma once
#include <algorithm>
#include <string>
#include <vector>
#include "common.cuh"
#include "../runtime/comm.cuh"
#include "../runtime/pool.cuh"

// The bytes of CommStaging that either direction holds at its peak, for B sequences of T tokens, G
// tensors of nh heads of hd per token, over D ranks, b bytes per element (header: the live set).
inline size_t ulysses_staging_bytes(int B, int T, int parts, int heads, int head_dim, int D, size_t b) {
  return 2 * (size_t)B * (T / D) * parts * heads * head_dim * b;
}

// The rows of hd elements of one rank's exchange, in the staging layout [D, B, Tl, G, hl]: staged row
// q = (((p·B + b)·Tl + i)·G + g)·hl + j (p: the peer) is
//   row ((b·Tl + i)·G + g)·nh + p·hl + j   of a sequence shard (token i of this rank, head p·hl + j)
//   row ((b·T + p·Tl + i)·G + g)·hl + j    of a head shard (token p·Tl + i, head j of this rank)
struct UlyssesRows {
  int B, T_local, parts, heads_local, D;
  int row_pieces;  // pieces of NV elements per row: hd / NV
};

// dst ← src, one thread per piece of NV elements: into the staging layout (to_staged: src is a shard)
// or out of it (dst is a shard); the shard is a sequence shard or a head shard.
template <int NV>
__global__ void ulysses_move_rows_kernel(floatX* dst, const floatX* src, UlyssesRows m, bool sequence_shard,
                                         bool to_staged) {
  using P = Pack<floatX, NV>;
  const size_t pieces = (size_t)m.row_pieces;
  const size_t total = (size_t)m.D * m.B * m.T_local * m.parts * m.heads_local * pieces;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    const size_t q = idx / pieces, c = idx % pieces;
    size_t rest = q;
    const size_t j = rest % m.heads_local;
    rest /= m.heads_local;
    const size_t g = rest % m.parts;
    rest /= m.parts;
    const size_t i = rest % m.T_local;
    rest /= m.T_local;
    const size_t b = rest % m.B, p = rest / m.B;
    const size_t shard_row =
        sequence_shard ? ((b * m.T_local + i) * m.parts + g) * ((size_t)m.heads_local * m.D) + p * m.heads_local + j
                       : ((b * m.D * m.T_local + p * m.T_local + i) * m.parts + g) * m.heads_local + j;
    const size_t staged = q * pieces + c, shard = shard_row * pieces + c;
    if (to_staged) reinterpret_cast<P*>(dst)[staged] = reinterpret_cast<const P*>(src)[shard];
    else reinterpret_cast<P*>(dst)[shard] = reinterpret_cast<const P*>(src)[staged];
  }
}

template <int NV>
inline void ulysses_move_rows_launch(floatX* dst, const floatX* src, UlyssesRows m, bool sequence_shard, bool to_staged,
                                     cudaStream_t stream) {
  const size_t total = (size_t)m.D * m.B * m.T_local * m.parts * m.heads_local * m.row_pieces;
  const int threads = 256, blocks = (int)std::min<size_t>((total + threads - 1) / threads, (size_t)1 << 20);
  ulysses_move_rows_kernel<NV><<<blocks, threads, 0, stream>>>(dst, src, m, sequence_shard, to_staged);
}

// A pack (to_staged) or an unpack of one rank's rows of hd elements.
inline void ulysses_move_rows(floatX* dst, const floatX* src, UlyssesRows m, int head_dim, bool sequence_shard,
                              bool to_staged, const char* op, cudaStream_t stream) {
  if (row_pieces(head_dim, {dst, src})) {
    m.row_pieces = head_dim / ROW_PIECE;
    ulysses_move_rows_launch<ROW_PIECE>(dst, src, m, sequence_shard, to_staged, stream);
  } else {
    m.row_pieces = head_dim;
    ulysses_move_rows_launch<1>(dst, src, m, sequence_shard, to_staged, stream);
  }
  launchCheck(op, "%s B=%d Tl=%d G=%d hl=%d hd=%d D=%d", to_staged ? "pack" : "unpack", m.B, m.T_local, m.parts,
              m.heads_local, head_dim, m.D);
}

// One direction (header): `in` is a sequence shard (from_sequence) or a head shard, `out` the other.
inline void ulysses_exchange(floatX* out, const floatX* in, bool from_sequence, int B, int T, int parts, int heads,
                             int head_dim, const Comm& seq, const char* op, cudaStream_t stream) {
  const int D = seq.size;
  if (B < 0 || T < 1 || parts < 1 || heads < 1 || head_dim < 1 || D < 1 || T % D != 0 || heads % D != 0)
    fm_fail(op, "need B >= 0, T, G, nh, hd >= 1, and the group's size D dividing T and nh",
            "B=%d T=%d G=%d nh=%d hd=%d D=%d group=%s", B, T, parts, heads, head_dim, D, seq.name.c_str());
  const UlyssesRows m{B, T / D, parts, heads / D, D, 0};
  const size_t rows_per_peer = (size_t)B * m.T_local * parts * m.heads_local;
  if (rows_per_peer == 0) return;  // B = 0 on every rank of the group
  const size_t elems = rows_per_peer * D * head_dim;
  const std::string name(op);
  floatX* sent = pool().alloc_t<floatX>(elems, Mem::CommStaging, (name + ".sent").c_str());
  floatX* received = pool().alloc_t<floatX>(elems, Mem::CommStaging, (name + ".received").c_str());
  ulysses_move_rows(sent, in, m, head_dim, from_sequence, true, op, stream);
  const std::vector<long long> rows(D, (long long)rows_per_peer);
  all_to_all_v(seq, sent, rows, received, rows, (size_t)head_dim, stream);
  ulysses_move_rows(out, received, m, head_dim, !from_sequence, false, op, stream);
  pool().free(sent);
  pool().free(received);
}

// y [B, T, G, nh/D, hd] (=), this rank's head shard, from x [B, T/D, G, nh, hd], its sequence shard, and
// the other ranks' of `seq`. Collective over `seq`; enqueued on `stream`, no host synchronisation. y must
// not overlap x. Its backward: dx = ulysses_to_sequence(dy).
inline void ulysses_to_heads(floatX* y, const floatX* x, int B, int T, int parts, int heads, int head_dim,
                             const Comm& seq, cudaStream_t stream) {
  ulysses_exchange(y, x, true, B, T, parts, heads, head_dim, seq, "ulysses_to_heads", stream);
}

// x [B, T/D, G, nh, hd] (=), this rank's sequence shard, from y [B, T, G, nh/D, hd], its head shard, and
// the other ranks' of `seq`. Collective over `seq`; enqueued on `stream`, no host synchronisation. x must
// not overlap y. Its backward: dy = ulysses_to_heads(dx).
inline void ulysses_to_sequence(floatX* x, const floatX* y, int B, int T, int parts, int heads, int head_dim,
                                const Comm& seq, cudaStream_t stream) {
  ulysses_exchange(x, y, false, B, T, parts, heads, head_dim, seq, "ulysses_to_sequence", stream);
}
