//! Q4_1 products for many activation rows at once: the torch layers' Q4_1
//! products (prefills, mixed steps) at any row count.
//!
//! The numerics are block_quant's (activations quantized to 8 bits per
//! block of 32, integer block dot products, each scaled by the two block
//! scales), so a prompt's rows are computed as its decode steps compute
//! theirs. The layout differs: block_quant's kernels reduce one weight row
//! at a time, paying a float conversion and two multiplies per block for
//! each weight row and activation row. Here a tile of 8 weight rows is
//! first interleaved, 4 codes of each row in turn, so one `maddubs` against
//! 4 activation codes broadcast to all lanes feeds 8 weight rows at once,
//! and the float work per block is shared by the 8: about half the
//! instructions per product of block_quant's tiles, which is what makes
//! this faster than the float32 GEMM the prefills used before.
//!
//! A block's 8 partial `maddubs` results add up in 16 bits without
//! overflow: each is at most 2 * 15 * 127 = 3,810 in magnitude (codes 0..15
//! times activations within +-127), so 8 make at most 30,480.

use crate::block_quant::{self, QuantizedRows, BLOCK, Q4_1};
use crate::spin_pool::SpinPool;

/// Weight rows interleaved together.
const TILE_ROWS: usize = 8;

/// out[m, n] = x[m, k] @ w.T for the Q4_1 weight `w` [n, k], the columns
/// split in `parts` tiles of 8 weight rows. Without AVX2, block_quant's
/// plain loops compute it.
pub fn matmul(pool: &SpinPool, parts: usize, x: &[f32], k: usize, weights: &Q4_1, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if block_quant::avx2() {
        let xs = QuantizedRows::new(x, k);
        let blocks = k / BLOCK;
        let (m, n) = (xs.len(), weights.scales.len() / blocks);
        assert_eq!(out.len(), m * n, "out is [rows of x, rows of the weights]");
        let out_ptr = block_quant::SharedPtr(out.as_mut_ptr());
        let tiles = n.div_ceil(TILE_ROWS);
        let parts = parts.clamp(1, pool.threads()).min(tiles);
        pool.run(parts, &|part| {
            let mut tile = avx2::Tile::new(blocks);
            for t in tiles * part / parts..tiles * (part + 1) / parts {
                let first = t * TILE_ROWS;
                let count = TILE_ROWS.min(n - first);
                // SAFETY: the CPU has AVX2; the tile's weight rows are inside `weights`.
                unsafe { tile.load(weights, first, count) };
                for row in (0..m).step_by(4) {
                    // SAFETY: each task writes only its own tiles' columns, inside `out`.
                    unsafe { tile.multiply(&xs, row..m.min(row + 4), out_ptr.get().add(row * n + first), n, count) };
                }
            }
        });
        return;
    }
    block_quant::matmul(pool, parts, x, k, weights, out)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q4_1, TILE_ROWS};
    use crate::block_quant::avx2::{q4_1_codes, transpose};
    use crate::block_quant::{QuantizedRows, BLOCK};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// 8 weight rows interleaved: per block, 8 vectors, the s-th holding
    /// codes 4s..4s+3 of each row in turn; and per block the rows' scales
    /// and minimums side by side.
    pub struct Tile {
        codes: Vec<__m256i>,
        scales: Vec<f32>,
        mins: Vec<f32>,
        blocks: usize,
    }

    impl Tile {
        pub fn new(blocks: usize) -> Tile {
            // SAFETY: an all-zero vector is a valid __m256i.
            let zero = unsafe { _mm256_setzero_si256() };
            Tile {
                codes: vec![zero; blocks * BLOCK / 4],
                scales: vec![0.0; blocks * TILE_ROWS],
                mins: vec![0.0; blocks * TILE_ROWS],
                blocks,
            }
        }

        /// Interleaves weight rows first..first + count (count <= 8; missing
        /// rows are zeros).
        #[target_feature(enable = "avx2")]
        pub unsafe fn load(&mut self, weights: &Q4_1, first: usize, count: usize) {
            let blocks = self.blocks;
            self.scales.fill(0.0);
            self.mins.fill(0.0);
            for i in 0..count {
                for b in 0..blocks {
                    self.scales[b * TILE_ROWS + i] = weights.scales[(first + i) * blocks + b];
                    self.mins[b * TILE_ROWS + i] = weights.mins[(first + i) * blocks + b];
                }
            }
            for b in 0..blocks {
                // Each row's 32 codes as 8 groups of 4 (32-bit lanes), transposed.
                let mut rows = [_mm256_setzero_ps(); TILE_ROWS];
                for (i, row) in rows.iter_mut().enumerate().take(count) {
                    *row = _mm256_castsi256_ps(q4_1_codes(
                        weights.nibbles.as_ptr().add(((first + i) * blocks + b) * BLOCK / 2),
                    ));
                }
                for (s, column) in transpose(rows).into_iter().enumerate() {
                    self.codes[b * 8 + s] = _mm256_castps_si256(column);
                }
            }
        }

        /// out[r, 0..count] (rows `n` apart) = activation rows `rows` (at
        /// most 4) dotted with the tile's weight rows.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn multiply(&self, xs: &QuantizedRows, rows: Range<usize>, out: *mut f32, n: usize, count: usize) {
            let blocks = self.blocks;
            assert!(xs.blocks == blocks && rows.end * blocks <= xs.scales.len());
            // The rows' codes, scales and sums, each row `blocks` blocks after the last.
            let at = (
                xs.codes.as_ptr().add(rows.start * blocks * BLOCK),
                xs.scales.as_ptr().add(rows.start * blocks),
                xs.sums.as_ptr().add(rows.start * blocks),
            );
            match rows.len() {
                4 => self.rows::<4>(at, out, n, count),
                3 => self.rows::<3>(at, out, n, count),
                2 => self.rows::<2>(at, out, n, count),
                _ => self.rows::<1>(at, out, n, count),
            }
        }

        #[target_feature(enable = "avx2,fma")]
        unsafe fn rows<const R: usize>(
            &self,
            (codes, x_scales, x_sums): (*const i8, *const f32, *const f32),
            out: *mut f32,
            n: usize,
            count: usize,
        ) {
            let (blocks, k) = (self.blocks, self.blocks * BLOCK);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let mut dots = [_mm256_setzero_si256(); R];
                for s in 0..BLOCK / 4 {
                    let w = self.codes[b * 8 + s];
                    for r in 0..R {
                        let four = (codes.add(r * k + b * BLOCK + 4 * s) as *const i32).read_unaligned();
                        dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
                    }
                }
                let scales = _mm256_loadu_ps(self.scales.as_ptr().add(b * TILE_ROWS));
                let mins = _mm256_loadu_ps(self.mins.as_ptr().add(b * TILE_ROWS));
                for r in 0..R {
                    let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r], ones));
                    let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*x_scales.add(r * blocks + b)));
                    acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
                    acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(*x_sums.add(r * blocks + b)), acc[r]);
                }
            }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_quant::tests::values;

    /// Q4_1 weights [n, k] from random codes, scales and minimums.
    fn weights(n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let nibbles = values(n * k / 2, 7).iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
        let scales = values(n * k / BLOCK, 8).iter().map(|v| 0.01 + v.abs() * 0.05).collect();
        let mins = values(n * k / BLOCK, 9).iter().map(|v| v * 0.3).collect();
        (nibbles, scales, mins)
    }

    #[test]
    fn interleaved_tiles_give_block_quants_products() {
        let pool = SpinPool::new(3);
        // 20 weight rows: two whole tiles and one of 4; 1 to 9 activation rows.
        for (n, k) in [(20, 96), (8, 1536), (3, 32)] {
            let (nibbles, scales, mins) = weights(n, k);
            let w = Q4_1 { nibbles: &nibbles, scales: &scales, mins: &mins };
            for m in [1, 4, 5, 9] {
                let mut x = values(m * k, m as u32);
                x[3] = 40.0; // an outlier block, as real activations have
                let (mut got, mut want) = (vec![0f32; m * n], vec![0f32; m * n]);
                matmul(&pool, 3, &x, k, &w, &mut got);
                block_quant::matmul(&pool, 1, &x, k, &w, &mut want);
                for (g, e) in got.iter().zip(&want) {
                    // The same integer block products, summed in another order.
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "n {n} k {k} m {m}: {g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn largest_codes_and_activations_do_not_overflow() {
        // Every code 15 and every activation at full scale: 8 maddubs
        // results of 3,810 each share a 16-bit lane.
        let (n, k) = (8, 64);
        let nibbles = vec![0xFFu8; n * k / 2];
        let (scales, mins) = (vec![1.0f32; n * k / BLOCK], vec![0.0f32; n * k / BLOCK]);
        let w = Q4_1 { nibbles: &nibbles, scales: &scales, mins: &mins };
        let pool = SpinPool::new(1);
        for sign in [1.0f32, -1.0] {
            let x = vec![sign; k];
            let mut out = vec![0f32; n];
            matmul(&pool, 1, &x, k, &w, &mut out);
            assert!(out.iter().all(|v| (v - sign * 15.0 * k as f32).abs() < 1e-2), "{out:?}");
        }
    }
}
