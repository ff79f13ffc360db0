//! Q8_0 products: the vocabulary projection of the 8da4w layout, on the CPU.
//!
//! Weights come in ggml's blocks of 32 inputs. Q8_0 holds 8-bit codes and
//! a scale per block: w = d * q. The activations are quantized on the fly
//! to 8 bits per block of 32 (`simd::QuantizedRows`, which block_gemm's
//! Q4_1 products share), so that one block's dot product is integer
//! arithmetic: AVX2's `maddubs` multiplies 32 byte pairs in one
//! instruction, where a kernel that widens the codes to floats first does
//! four times the work. That is what makes a small model's decode step on
//! a CPU without AVX-512 fast; torch's CPU kernels widen to floats.
//!
//! Without AVX2 and FMA a plain loop computes the same sums.

#[cfg(target_arch = "x86_64")]
mod avx2;

use crate::kernels::simd::{self, ActivationRow, QuantizedRows, BLOCK};
use crate::kernels::spin_pool::{SharedPtr, SpinPool};

/// Q8_0 weights [n, k]: per block, 32 signed codes and a scale.
pub struct Q8_0<'a> {
    pub codes: &'a [i8],
    pub scales: &'a [f32],
}

impl Q8_0<'_> {
    fn row(&self, n: usize, blocks: usize) -> (&[i8], &[f32]) {
        let b = n * blocks;
        (&self.codes[b * BLOCK..(b + blocks) * BLOCK], &self.scales[b..b + blocks])
    }

    /// Output features; each row has `blocks` blocks.
    fn rows(&self, blocks: usize) -> usize {
        self.scales.len() / blocks
    }

    /// Row `n` as floats, `blocks * BLOCK` of them.
    fn dequantize_row(&self, n: usize, blocks: usize, out: &mut [f32]) {
        let (codes, scales) = self.row(n, blocks);
        for ((block, codes), d) in out.chunks_exact_mut(BLOCK).zip(codes.chunks_exact(BLOCK)).zip(scales) {
            for (w, q) in block.iter_mut().zip(codes) {
                *w = d * *q as f32;
            }
        }
    }

    /// Rows `n` and `n + 1` dotted with each of `xs` (at most 4 rows).
    fn dot_pair(&self, n: usize, blocks: usize, xs: &[ActivationRow], out: &mut [[f32; 4]; 2]) {
        #[cfg(target_arch = "x86_64")]
        if simd::avx2() {
            // SAFETY: the CPU has AVX2 and FMA; both weight rows are
            // slices of `blocks` blocks, and so is each activation row
            // (QuantizedRows of the same k).
            return unsafe { avx2::dot_pair([self.row(n, blocks), self.row(n + 1, blocks)], xs, out) };
        }
        self.dot(n, blocks, xs, &mut out[0]);
        self.dot(n + 1, blocks, xs, &mut out[1]);
    }

    /// Row `n` of the weights dotted with each of `xs` (at most 4 rows).
    fn dot(&self, n: usize, blocks: usize, xs: &[ActivationRow], out: &mut [f32; 4]) {
        let (codes, scales) = self.row(n, blocks);
        out.fill(0.0);
        #[cfg(target_arch = "x86_64")]
        if simd::avx2() {
            // SAFETY: as in `dot_pair`, for one weight row.
            return unsafe { avx2::dot(codes, scales, xs, out) };
        }
        for (x, o) in xs.iter().zip(out.iter_mut()) {
            for b in 0..blocks {
                let range = b * BLOCK..(b + 1) * BLOCK;
                let total: i32 = codes[range.clone()].iter().zip(&x.0[range]).map(|(w, v)| *w as i32 * *v as i32).sum();
                *o += scales[b] * x.1[b] * total as f32;
            }
        }
    }
}

/// out[m, n] = sum_k x[m, k] * w[n, k] for `x` of rows of `k` values; the
/// columns are split in `parts` (at most the pool's threads).
pub fn matmul(pool: &SpinPool, parts: usize, x: &[f32], k: usize, weights: &Q8_0, out: &mut [f32]) {
    let xs = QuantizedRows::new(x, k);
    let (m, blocks) = (xs.len(), xs.blocks);
    let n = weights.rows(blocks);
    assert_eq!(out.len(), m * n, "out is [rows of x, rows of the weights]");
    let rows: Vec<_> = (0..m).map(|r| xs.row(r)).collect();
    let out_ptr = SharedPtr(out.as_mut_ptr());
    let parts = parts.clamp(1, pool.threads());
    // SAFETY: each task writes its own columns, inside `out`.
    let write = |row: usize, col: usize, value: f32| unsafe { *out_ptr.get().add(row * n + col) = value };
    pool.run(parts, &|part| {
        let mut cols = n * part / parts..n * (part + 1) / parts;
        // Weight rows in pairs and activation rows in fours: each weight
        // block is decoded once for four rows, each activation block
        // loaded once for two weight rows.
        let mut pair = [[0f32; 4]; 2];
        while cols.len() >= 2 {
            for (tile, group) in rows.chunks(4).enumerate() {
                weights.dot_pair(cols.start, blocks, group, &mut pair);
                for (c, sums) in pair.iter().enumerate() {
                    for (i, s) in sums.iter().take(group.len()).enumerate() {
                        write(tile * 4 + i, cols.start + c, *s);
                    }
                }
            }
            cols.start += 2;
        }
        let mut sums = [0f32; 4];
        for col in cols {
            for (tile, group) in rows.chunks(4).enumerate() {
                weights.dot(col, blocks, group, &mut sums);
                for (i, s) in sums.iter().take(group.len()).enumerate() {
                    write(tile * 4 + i, col, *s);
                }
            }
        }
    });
}

/// The weights as floats, `out` [n, k], rows split in `parts`: what a
/// long prefill multiplies densely (a float GEMM's cost grows slower with
/// the rows than the block kernels').
pub fn dequantize(pool: &SpinPool, parts: usize, weights: &Q8_0, k: usize, out: &mut [f32]) {
    assert!(k % BLOCK == 0, "rows of a multiple of {BLOCK} values");
    let blocks = k / BLOCK;
    let n = weights.rows(blocks);
    assert_eq!(out.len(), n * k, "out is [rows of the weights, k]");
    let out_ptr = SharedPtr(out.as_mut_ptr());
    let parts = parts.clamp(1, pool.threads());
    pool.run(parts, &|part| {
        for row in n * part / parts..n * (part + 1) / parts {
            // SAFETY: each task writes its own rows, inside `out`.
            let out = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(row * k), k) };
            weights.dequantize_row(row, blocks, out);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::test_values as values;

    fn reference(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
        let n = w.len() / k;
        x.chunks(k)
            .flat_map(|row| {
                (0..n).map(move |c| row.iter().zip(&w[c * k..(c + 1) * k]).map(|(a, b)| a * b).sum::<f32>())
            })
            .collect()
    }

    fn close(got: &[f32], want: &[f32], tolerance: f32) {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= tolerance * scale, "{g} vs {w}");
        }
    }

    fn pair_is_two_dots(weights: &Q8_0, k: usize) {
        let xs = QuantizedRows::new(&values(4 * k, 10), k);
        for count in 1..=4 {
            let rows: Vec<_> = (0..count).map(|r| xs.row(r)).collect();
            let mut pair = [[0f32; 4]; 2];
            weights.dot_pair(0, k / BLOCK, &rows, &mut pair);
            for (n, got) in pair.iter().enumerate() {
                let mut one = [0f32; 4];
                weights.dot(n, k / BLOCK, &rows, &mut one);
                assert_eq!(got[..count], one[..count], "{count} rows");
            }
        }
    }

    /// 5 blocks a row: the pairs of blocks and the odd one. Without AVX2
    /// `dot_pair` is two `dot`s.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_weight_rows_in_pairs_give_each_rows_own_dot_product() {
        simd::require_avx2();
        let k = 160;
        let scales = values(2 * k / BLOCK, 8);
        let codes: Vec<i8> = values(2 * k, 11).iter().map(|v| (v * 127.0) as i8).collect();
        pair_is_two_dots(&Q8_0 { codes: &codes, scales: &scales }, k);
    }

    #[test]
    fn q8_0_matches_the_dequantized_product() {
        let (k, n) = (64, 33);
        let codes: Vec<i8> = values(n * k, 5).iter().map(|v| (v * 127.0) as i8).collect();
        let scales = values(n * k / BLOCK, 6).iter().map(|v| v.abs() * 0.01 + 0.001).collect::<Vec<_>>();
        let dense: Vec<f32> = (0..n * k).map(|i| scales[i / BLOCK] * codes[i] as f32).collect();
        let weights = Q8_0 { codes: &codes, scales: &scales };
        for m in [1, 5] {
            let x = values(m * k, 7 + m as u32);
            let mut out = vec![0.0; m * n];
            matmul(&SpinPool::new(3), 3, &x, k, &weights, &mut out);
            close(&out, &reference(&x, &dense, k), 0.02);
        }
        let mut floats = vec![0.0; n * k];
        dequantize(&SpinPool::new(3), 3, &weights, k, &mut floats);
        assert_eq!(floats, dense);
    }

    #[test]
    fn zero_activations_give_zero() {
        let mut out = vec![1.0; 2];
        let codes = vec![3i8; 2 * BLOCK];
        matmul(&SpinPool::new(2), 2, &vec![0.0; BLOCK], BLOCK, &Q8_0 { codes: &codes, scales: &[1.0, 1.0] }, &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
    }
}
