//! Q8_0 weights in pyserve's tile layout, and their products with rows of
//! activations: the vocabulary projection of the 8da4w layout, on the CPU.
//!
//! The numerics are ggml's Q8_0 x Q8 products: weights in blocks of 32
//! inputs, 8-bit codes and a scale per block (w = d * q), activations
//! quantized on the fly to 8 bits per block (`simd::QuantizedRows`, which
//! block_gemm's Q4_1 products share), each block's dot product integer
//! arithmetic, scaled by the two block scales and summed block after block.
//!
//! The layout is block_gemm's: a tile interleaves 8 weight rows, 4 codes
//! of each row in turn, so one byte product instruction against 4
//! activation codes broadcast to all lanes feeds 8 weight rows, and each
//! block's float work (a conversion, the scales' product, a fused
//! multiply-add) is shared by the 8: each output is one lane. A kernel
//! that reduces one weight row at a time pays that float work per row;
//! with the 7 activation rows of a speculative verify step (a token and 6
//! drafts) that float work, not reading the weights, bounds the
//! projection (bench/README.md K22). The tiles are packed once, when the layer is built (`pack`):
//! for each tile of 8 weight rows and each block of 32 inputs, 256 bytes
//! of codes (8 vectors; vector j holds codes 4j..4j+3 of each row in
//! turn), then the rows' 8 scales (f32). As many bytes as ggml's Q8_0.
//!
//! Every path computes each block's exact integer dot product and then
//! acc += dot * (weight scale * activation scale), one fused multiply-add
//! a block in block order, so a row's outputs are the same to the bit on
//! every path and whichever rows share its call: a verify step's rows get
//! what a decode step gives them.
//!
//! - AVX-512 VNNI (`vpdpbusd`, unsigned times signed bytes summed into
//!   32-bit lanes) on the codes plus 128, 8 activation rows a pass; the
//!   excess, 128 times the activation block's code sum, is taken off the
//!   integer sum.
//! - AVX2: `maddubs` on the codes' magnitudes against the activations with
//!   the codes' signs, 4 activation rows a pass.
//! - Otherwise plain loops.

#[cfg(target_arch = "x86_64")]
mod avx2;

use crate::kernels::simd::{self, QuantizedRows, BLOCK};
use crate::kernels::spin_pool::{SharedPtr, SpinPool};
use crate::kernels::tiles::{self, TileBytes, TILE_ROWS};

/// A tile's codes for one block: 8 rows of 32 codes.
const CODE_BYTES: usize = TILE_ROWS * BLOCK;
/// A tile's bytes for one block: the codes and 8 scales.
const TILE_BLOCK_BYTES: usize = CODE_BYTES + TILE_ROWS * 4;
/// Activation rows a VNNI pass over a tile multiplies: a verify step's 7
/// in one pass.
const VNNI_ROWS: usize = 8;

/// Q8_0 weights [n, k] in the tile layout (see the module's comment):
/// w[r, c] = scale[r, c / 32] * code[r, c], codes -127..127. Its `n`,
/// `k`, blocks and tiles are its bytes' (Deref).
pub struct Q8_0Tiles<'a>(TileBytes<'a>);

impl<'a> std::ops::Deref for Q8_0Tiles<'a> {
    type Target = TileBytes<'a>;

    fn deref(&self) -> &TileBytes<'a> {
        &self.0
    }
}

impl<'a> Q8_0Tiles<'a> {
    /// The bytes of weights [n, k] in the tile layout.
    pub fn size(n: usize, k: usize) -> usize {
        TileBytes::size(n, k, TILE_BLOCK_BYTES)
    }

    /// `bytes`, as `pack` wrote them for weights [n, k], or why they cannot be.
    pub fn checked(bytes: &'a [u8], n: usize, k: usize) -> Result<Q8_0Tiles<'a>, String> {
        TileBytes::checked(bytes, (n, k), TILE_BLOCK_BYTES, "Q8_0").map(Q8_0Tiles)
    }

    /// Weight row r's code for input c, and its block's scale.
    fn weight(&self, r: usize, c: usize) -> (i8, f32) {
        let block = self.block(r / TILE_ROWS, c / BLOCK);
        let row = r % TILE_ROWS;
        let scale = &block[CODE_BYTES + 4 * row..][..4];
        (block[code_byte(row, c % BLOCK)] as i8, f32::from_le_bytes(scale.try_into().unwrap()))
    }
}

/// Where, in a tile's block, row `row`'s code `i` lies.
fn code_byte(row: usize, i: usize) -> usize {
    (i / 4) * TILE_ROWS * 4 + row * 4 + i % 4
}

/// Packs weights [n, k] into `out` (`Q8_0Tiles::size(n, k)` bytes): codes
/// [n, k], scales [n, k / 32]. Rows past `n` in the last tile are zeros.
pub fn pack(codes: &[i8], scales: &[f32], n: usize, k: usize, out: &mut [u8]) {
    let blocks = k / BLOCK;
    assert!(codes.len() == n * k && scales.len() == n * blocks);
    assert_eq!(out.len(), Q8_0Tiles::size(n, k));
    out.fill(0);
    for r in 0..n {
        let (t, row) = (r / TILE_ROWS, r % TILE_ROWS);
        for b in 0..blocks {
            let block = &mut out[(t * blocks + b) * TILE_BLOCK_BYTES..][..TILE_BLOCK_BYTES];
            for i in 0..BLOCK {
                block[code_byte(row, i)] = codes[r * k + b * BLOCK + i] as u8;
            }
            block[CODE_BYTES + 4 * row..][..4].copy_from_slice(&scales[r * blocks + b].to_le_bytes());
        }
    }
}

/// out[m, n] = x[m, k] @ w.T, the columns split in `parts` runs of tiles
/// (at most the pool's threads).
pub fn matmul(pool: &SpinPool, parts: usize, x: &[f32], weights: &Q8_0Tiles, out: &mut [f32]) {
    let xs = QuantizedRows::new(x, weights.k);
    let blocks = weights.blocks();
    #[cfg(target_arch = "x86_64")]
    let vnni = simd::vnni();
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    // Activation rows per pass over a tile: each pass reads the tile's codes once.
    let rows_per_pass = if vnni { VNNI_ROWS } else { 4 };
    tiles::run_passes(pool, parts, (xs.len(), weights.n), rows_per_pass, out, &|t, rows, out, count| {
        let (n, operands) = (weights.n, Operands { tile: weights.block(t, 0).as_ptr(), blocks, xs: &xs });
        #[cfg(target_arch = "x86_64")]
        if vnni {
            // SAFETY: the CPU has AVX2, FMA and AVX-512 VNNI; the tile and rows lie inside their buffers.
            return unsafe { avx2::multiply_vnni(&operands, rows, out, n, count) };
        }
        #[cfg(target_arch = "x86_64")]
        if simd::avx2() {
            // SAFETY: the CPU has AVX2 and FMA; as above.
            return unsafe { avx2::multiply(&operands, rows, out, n, count) };
        }
        // SAFETY: as above.
        unsafe { plain_multiply(weights, t, &xs, rows, out, n, count) };
    });
}

/// What a pass over one tile reads: the tile's first block, the blocks per
/// row and the activation rows.
struct Operands<'a> {
    tile: *const u8,
    blocks: usize,
    xs: &'a QuantizedRows,
}

/// The paths' products in plain loops: per block the integer dot product,
/// then acc += dot * (weight scale * activation scale).
unsafe fn plain_multiply(
    weights: &Q8_0Tiles,
    t: usize,
    xs: &QuantizedRows,
    rows: std::ops::Range<usize>,
    out: *mut f32,
    n: usize,
    count: usize,
) {
    let blocks = weights.blocks();
    let code = |row, c| weights.weight(row, c).0 as i32;
    tiles::plain_pass(xs, t, rows, out, n, count, code, |row, r, b, dot, acc| {
        (dot as f32).mul_add(weights.weight(row, b * BLOCK).1 * xs.scales[r * blocks + b], acc)
    });
}

/// The weights as floats, `out` [n, k], rows split in `parts`: what a
/// long prefill multiplies densely (a float GEMM's cost grows slower with
/// the rows than the block kernels').
pub fn dequantize(pool: &SpinPool, parts: usize, weights: &Q8_0Tiles, out: &mut [f32]) {
    let (n, k) = (weights.n, weights.k);
    assert_eq!(out.len(), n * k, "out is [rows of the weights, k]");
    let out_ptr = SharedPtr(out.as_mut_ptr());
    let parts = parts.clamp(1, pool.threads());
    pool.run(parts, &|part| {
        for r in n * part / parts..n * (part + 1) / parts {
            // SAFETY: each task writes its own rows, inside `out`.
            let row = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(r * k), k) };
            for (c, w) in row.iter_mut().enumerate() {
                let (code, scale) = weights.weight(r, c);
                *w = scale * code as f32;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::test_values as values;

    /// Weights [n, k]: codes -127..127 (the extremes among them) and scales.
    fn weights(n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
        let mut codes: Vec<i8> = values(n * k, 5).iter().map(|v| (v * 127.0) as i8).collect();
        codes[0] = -127;
        codes[1] = 127;
        let scales = values(n * k / BLOCK, 6).iter().map(|v| v.abs() * 0.01 + 0.001).collect();
        (codes, scales)
    }

    fn packed(codes: &[i8], scales: &[f32], n: usize, k: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; Q8_0Tiles::size(n, k)];
        pack(codes, scales, n, k, &mut bytes);
        bytes
    }

    /// Each output as the module's comment gives it, in plain arithmetic
    /// on the unpacked weights: the bits every path must give.
    fn reference(x: &[f32], codes: &[i8], scales: &[f32], k: usize) -> Vec<f32> {
        let xs = QuantizedRows::new(x, k);
        let (blocks, n) = (k / BLOCK, scales.len() / (k / BLOCK));
        let mut out = vec![];
        for r in 0..xs.len() {
            for c in 0..n {
                let mut acc = 0f32;
                for b in 0..blocks {
                    let w = &codes[c * k + b * BLOCK..][..BLOCK];
                    let a = &xs.codes[(r * blocks + b) * BLOCK..][..BLOCK];
                    let dot: i32 = w.iter().zip(a).map(|(&w, &a)| w as i32 * a as i32).sum();
                    acc = (dot as f32).mul_add(scales[c * blocks + b] * xs.scales[r * blocks + b], acc);
                }
                out.push(acc);
            }
        }
        out
    }

    #[test]
    fn packed_tiles_dequantize_to_their_weights() {
        // 20 rows: two whole tiles and one of 4.
        let (n, k) = (20, 96);
        let (codes, scales) = weights(n, k);
        let bytes = packed(&codes, &scales, n, k);
        let mut dense = vec![0f32; n * k];
        dequantize(&SpinPool::new(3), 3, &Q8_0Tiles::checked(&bytes, n, k).unwrap(), &mut dense);
        let want: Vec<f32> = (0..n * k).map(|i| scales[i / BLOCK] * codes[i] as f32).collect();
        assert_eq!(dense, want);
    }

    /// Every row count from 1 to 17 (VNNI's passes of 8 and AVX2's of 4,
    /// whole and partial) against 21 weight rows (a partial last tile):
    /// the reference's bits, on this CPU's path. Without AVX2 that is the
    /// plain loops.
    #[test]
    fn products_are_the_block_sums_to_the_bit_at_every_row_count() {
        let (n, k) = (21, 160);
        let (codes, scales) = weights(n, k);
        let bytes = packed(&codes, &scales, n, k);
        let tiles = Q8_0Tiles::checked(&bytes, n, k).unwrap();
        for m in 1..=17 {
            let x = values(m * k, 7 + m as u32);
            let mut out = vec![0f32; m * n];
            matmul(&SpinPool::new(3), 3, &x, &tiles, &mut out);
            assert_eq!(out, reference(&x, &codes, &scales, k), "{m} rows");
        }
    }

    /// The AVX2 path on its own, where the CPU would take VNNI's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_products_are_the_block_sums_to_the_bit() {
        simd::require_avx2();
        let (n, k) = (16, 96);
        let (codes, scales) = weights(n, k);
        let bytes = packed(&codes, &scales, n, k);
        let tiles = Q8_0Tiles::checked(&bytes, n, k).unwrap();
        let x = values(5 * k, 3);
        let xs = QuantizedRows::new(&x, k);
        let mut out = vec![0f32; 5 * n];
        for t in 0..2 {
            for rows in [0..4, 4..5] {
                let operands = Operands { tile: tiles.block(t, 0).as_ptr(), blocks: k / BLOCK, xs: &xs };
                // SAFETY: the CPU has AVX2 and FMA; the tile and rows are inside their buffers.
                unsafe { avx2::multiply(&operands, rows.clone(), out.as_mut_ptr().add(rows.start * n + t * 8), n, 8) };
            }
        }
        assert_eq!(out, reference(&x, &codes, &scales, k));
    }

    /// The plain loops, which a CPU without AVX2 takes.
    #[test]
    fn plain_loops_are_the_block_sums_to_the_bit() {
        let (n, k) = (12, 96);
        let (codes, scales) = weights(n, k);
        let bytes = packed(&codes, &scales, n, k);
        let tiles = Q8_0Tiles::checked(&bytes, n, k).unwrap();
        let x = values(3 * k, 4);
        let xs = QuantizedRows::new(&x, k);
        let mut out = vec![0f32; 3 * n];
        for t in 0..2 {
            // SAFETY: the tile's rows and the activation rows are inside their buffers.
            unsafe { plain_multiply(&tiles, t, &xs, 0..3, out.as_mut_ptr().add(t * 8), n, 8.min(n - t * 8)) };
        }
        assert_eq!(out, reference(&x, &codes, &scales, k));
    }

    #[test]
    fn tiles_of_the_wrong_size_are_refused() {
        let misfit = Q8_0Tiles::checked(&[0u8; 10], 8, 32).err().unwrap();
        assert!(misfit.contains("not the Q8_0 tiles of a [8, 32] weight"), "{misfit}");
    }

    #[test]
    fn zero_activations_give_zero() {
        let (codes, scales) = weights(8, BLOCK);
        let bytes = packed(&codes, &scales, 8, BLOCK);
        let mut out = vec![1.0; 8];
        matmul(&SpinPool::new(2), 2, &[0.0; BLOCK], &Q8_0Tiles::checked(&bytes, 8, BLOCK).unwrap(), &mut out);
        assert_eq!(out, vec![0.0; 8]);
    }
}
