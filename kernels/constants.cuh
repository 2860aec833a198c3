// constants.cuh — the numbers the kernels and their Rust launchers must agree on, written once.
// crates/cuda/build.rs turns each `#define NAME <integer>` into `pub const NAME: usize` and each
// enumerator into `pub const NAME: i32` (C's int) in `ferrolm_cuda::consts`, so a launcher never
// repeats a tile shape, a block size or an op code. Only such definitions belong here: build.rs
// rejects anything else. Included by common.cuh.
#pragma once

// Rank limit of the `Strided` view descriptor (common.cuh): views collapse to at most this many dims.
#define FERRO_MAX_RANK 6

// Op codes of unary_* / binary_* (elementwise.cu), in the order of `UnaryOp` / `BinaryOp`.
enum { U_NEG, U_EXP, U_LOG, U_SQRT, U_RSQRT, U_RECIP, U_SQR, U_SILU, U_SILU_GRAD, U_POWF, U_AFFINE };
enum { B_ADD, B_SUB, B_MUL, B_DIV, B_EQ };

// Embedding backward (embedding.cu): a block owns EMB_ROWS vocab rows and EMB_COLS columns (one
// thread each), and stages EMB_CHUNK token ids per shared-memory pass.
#define EMB_ROWS 64
#define EMB_COLS 128
#define EMB_CHUNK 1024

// Flash attention (attention.cu, bf16 tensor cores): a block of W warps (32 W threads, 16 rows a
// warp) owns 16 W rows: query rows in the forward and dQ, kv rows in dK/dV. W is FLASH_WARPS; the
// `_w4` kernels are the same code with FLASH_WARPS_SMALL, so one GPU run can time both (the
// launcher takes FERROLM_FLASH_WARPS). Per step a block stages (cp.async, double-buffered) a tile
// of kv rows in the forward (FLASH_FWD_TILE_D64 / _D128 by head dim) and of FLASH_BWD_TILE_D64 /
// _D128 rows in the backward (query rows for dK/dV, kv rows for dQ). Shared-memory rows are padded
// by FLASH_PAD bf16 elements (16 bytes), so the 8 rows of an ldmatrix fall in distinct banks.
#define FLASH_WARPS 8
#define FLASH_WARPS_SMALL 4
#define FLASH_WARP_ROWS 16
#define FLASH_FWD_TILE_D64 128
#define FLASH_FWD_TILE_D128 64
#define FLASH_BWD_TILE_D64 64
#define FLASH_BWD_TILE_D128 32
#define FLASH_PAD 8
// Head layouts of a (b, heads, t, d) tensor (attention.cu, rope.cu). HEAD_MAJOR: (b, heads, t, d)
// contiguous, a head's rows adjacent. TIME_MAJOR: (b, t, heads, d) contiguous, the layout the q, k
// and v projections write (a head's rows heads * d elements apart), seen through
// permute(0, 2, 1, 3): attention and RoPE read and write it in place, so no head permute is copied.
enum { HEAD_MAJOR, TIME_MAJOR };
// SIMT attention (one warp per row): each lane holds ATTN_SIMT_PER_LANE elements of a row, so
// the head dim is at most 32 * ATTN_SIMT_PER_LANE.
#define ATTN_SIMT_PER_LANE 8

// Multi-tensor optimizer kernels (optim.cu): one block per OPT_CHUNK elements of a tensor.
#define OPT_CHUNK 4096

// Element-wise, cast, fill and copy launches (elementwise.cu): grids of at most
// EW_WAVES * (SM count) blocks of EW_BLOCK threads (EW_WAVES blocks of 256 fill an SM's 2048
// threads once), grid-stride past that.
#define EW_BLOCK 256
#define EW_WAVES 8
// Tiled transpose (elementwise.cu): TP_TILE x TP_TILE tiles, a block of TP_TILE * TP_ROWS threads.
#define TP_TILE 32
#define TP_ROWS 8
// Reductions (reduce.cu): the launcher aims at RED_WAVES * (SM count) blocks. A reduced row is
// split over blocks of at least RED_ROW_CHUNK elements each; the column (thread-per-output)
// kernel splits the reduced range into chunks of at least RED_COL_CHUNK elements. Rows shorter
// than RED_ROW_MIN go to the column kernel (a block per output would leave most threads idle).
#define RED_BLOCK 256
#define RED_WAVES 4
#define RED_ROW_CHUNK 1024
#define RED_COL_CHUNK 16
#define RED_ROW_MIN 64

// Sorted embedding backward (embedding.cu, `embedding_bwd_sorted_*`): at most EMB_SORT_THREADS
// threads per block, each moving 16 bytes of a dy row at a time.
#define EMB_SORT_THREADS 128

// The fused head's loss (head_loss.cu): hl_loss_partial sums HL_LOSS_ROWS row losses a block
// (a fixed partition, whatever the device), hl_finish the partials in one block; both blocks of
// HL_LOSS_BLOCK threads.
#define HL_LOSS_ROWS 1024
#define HL_LOSS_BLOCK 256
