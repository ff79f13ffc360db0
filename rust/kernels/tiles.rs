//! What the tile layouts share (block_gemm's Q4_1, q8_0's Q8_0): a tile
//! interleaves TILE_ROWS weight rows so that each output is one vector
//! lane; a product is a pass over each tile for each run of activation
//! rows, the tiles split among the pool's threads.

use crate::kernels::simd::{QuantizedRows, BLOCK};
use crate::kernels::spin_pool::{SharedPtr, SpinPool};
use std::ops::Range;

/// Weight rows interleaved in a tile: one AVX2 vector's lanes.
pub const TILE_ROWS: usize = 8;

/// A weight [n, k] packed in a tile layout of `block_bytes` bytes for
/// each tile and block of 32 inputs, tile after tile, block after block:
/// what each layout's own type reads its codes and scales from.
pub struct TileBytes<'a> {
    bytes: &'a [u8],
    pub n: usize,
    pub k: usize,
    block_bytes: usize,
}

impl<'a> TileBytes<'a> {
    /// The bytes of weights [n, k] in a layout of `block_bytes` a tile and block.
    pub fn size(n: usize, k: usize, block_bytes: usize) -> usize {
        assert!(k % BLOCK == 0, "rows of a multiple of {BLOCK} values");
        n.div_ceil(TILE_ROWS) * (k / BLOCK) * block_bytes
    }

    /// `bytes` as the `format` tiles of weights [n, k], or why they cannot be.
    pub fn checked(
        bytes: &'a [u8],
        (n, k): (usize, usize),
        block_bytes: usize,
        format: &str,
    ) -> Result<TileBytes<'a>, String> {
        if k % BLOCK != 0 || bytes.len() != Self::size(n, k, block_bytes) {
            return Err(format!("{} bytes are not the {format} tiles of a [{n}, {k}] weight", bytes.len()));
        }
        Ok(TileBytes { bytes, n, k, block_bytes })
    }

    pub fn blocks(&self) -> usize {
        self.k / BLOCK
    }

    pub fn tiles(&self) -> usize {
        self.n.div_ceil(TILE_ROWS)
    }

    /// Tile t's bytes for block b.
    pub fn block(&self, t: usize, b: usize) -> &'a [u8] {
        let at = (t * self.blocks() + b) * self.block_bytes;
        &self.bytes[at..at + self.block_bytes]
    }
}

/// Calls `pass(t, rows, out, count)` for every tile t of the `n` weight
/// rows and every run `rows` of at most `rows_per_pass` of the `m`
/// activation rows, the tiles split in `parts` runs (at most the pool's
/// threads). `out` points at the outputs [m, n] of the run's first row
/// and the tile's first weight row (rows `n` apart); `count` is the
/// tile's weight rows, TILE_ROWS but in a last partial tile. Each pass
/// writes only its rows' outputs of its own tile.
pub fn run_passes(
    pool: &SpinPool,
    parts: usize,
    (m, n): (usize, usize),
    rows_per_pass: usize,
    out: &mut [f32],
    pass: &(dyn Fn(usize, Range<usize>, *mut f32, usize) + Sync),
) {
    assert_eq!(out.len(), m * n, "out is [rows of x, rows of the weights]");
    let out_ptr = SharedPtr(out.as_mut_ptr());
    let tiles = n.div_ceil(TILE_ROWS);
    let parts = parts.clamp(1, pool.threads()).min(tiles.max(1));
    pool.run(parts, &|part| {
        for t in tiles * part / parts..tiles * (part + 1) / parts {
            let first = t * TILE_ROWS;
            for row in (0..m).step_by(rows_per_pass) {
                // SAFETY: inside `out` (row < m, first < n); each task has its own tiles' columns.
                let at = unsafe { out_ptr.get().add(row * n + first) };
                pass(t, row..m.min(row + rows_per_pass), at, TILE_ROWS.min(n - first));
            }
        }
    });
}

/// A pass in plain loops (no AVX2): for activation rows `rows` of `xs`
/// and the tile t's `count` weight rows, each output folds `add_block`
/// over the blocks in order, from 0: add_block(weight row, activation
/// row, block, the block's integer dot product, acc) -> acc. `code(weight
/// row, input)` is the weight's integer code.
///
/// # Safety
/// `out` has room for `rows.len()` rows of `count` values, `n` apart.
#[allow(clippy::too_many_arguments)]
pub unsafe fn plain_pass(
    xs: &QuantizedRows,
    t: usize,
    rows: Range<usize>,
    out: *mut f32,
    n: usize,
    count: usize,
    code: impl Fn(usize, usize) -> i32,
    add_block: impl Fn(usize, usize, usize, i32, f32) -> f32,
) {
    let blocks = xs.blocks;
    for (i, r) in rows.enumerate() {
        for row in 0..count {
            let weight_row = t * TILE_ROWS + row;
            let mut acc = 0f32;
            for b in 0..blocks {
                let x_codes = &xs.codes[(r * blocks + b) * BLOCK..][..BLOCK];
                let dot = (0..BLOCK).map(|c| code(weight_row, b * BLOCK + c) * x_codes[c] as i32).sum();
                acc = add_block(weight_row, r, b, dot, acc);
            }
            *out.add(i * n + row) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::TILE_ROWS;
    use std::arch::x86_64::*;

    /// Each activation row's TILE_ROWS lanes into its `count` columns of
    /// `out` (rows `n` apart).
    ///
    /// # Safety
    /// The CPU has AVX; `out` has room for R rows of `count` values, `n` apart.
    #[inline(always)]
    pub unsafe fn store<const R: usize>(acc: &[__m256; R], out: *mut f32, n: usize, count: usize) {
        for (r, sums) in acc.iter().enumerate() {
            let row = out.add(r * n);
            if count == TILE_ROWS {
                _mm256_storeu_ps(row, *sums);
            } else {
                let mut lanes = [0f32; TILE_ROWS];
                _mm256_storeu_ps(lanes.as_mut_ptr(), *sums);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), row, count);
            }
        }
    }
}
