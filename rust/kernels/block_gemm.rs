//! Q4_1 weights in pyserve's tile layout, and their products with rows of
//! activations: every Q4_1 product of the 8da4w layers, decode steps
//! (decode_layer) and prefills alike.
//!
//! The numerics are ggml's Q4_1 x Q8 products (activations quantized to 8
//! bits per block of 32, integer block dot products, each scaled by the two
//! block scales), so the weights multiply as llama.cpp's would. The layout
//! is pyserve's: a tile interleaves 8 weight rows, 4 codes of each row in
//! turn, so one `maddubs` against 4 activation codes broadcast to all lanes
//! feeds 8 weight rows at once, and the float work per block (a conversion,
//! the scales' products, the minimum's share) is shared by the 8. A kernel
//! that reduces one weight row at a time pays that float work per row, and
//! a horizontal sum per row at the end; here each output is one lane.
//!
//! The tiles are packed once, when a layer is built (`pack`), into the
//! bytes the products read in order: for each tile of 8 weight rows and
//! each block of 32 inputs, 128 bytes of codes, then the rows' 8 scales and
//! their 8 minimums (f32). The 128 bytes are 4 vectors; vector j holds, for
//! each row in turn, its codes 4j..4j+3 in the low nibbles and codes
//! 4j+16..4j+19 in the high ones. The same 4 bits a code as ggml's file,
//! so a step reads as many weight bytes as llama.cpp's.
//!
//! A block's 8 partial `maddubs` results add up in 16 bits without
//! overflow: each is at most 2 * 15 * 127 = 3,810 in magnitude (codes 0..15
//! times activations within +-127), so 8 make at most 30,480.
//!
//! Where the CPU has AVX-512 VNNI, `vpdpbusd` does a maddubs, its 16-bit
//! add and the widening to 32 bits in one instruction, and a pass over a
//! tile takes up to 8 activation rows (a speculative verify step's token
//! and drafts at once) instead of 4: the same integer sums, so the same
//! outputs, in less time (bench/README.md, "CPU: NGRAM verify steps in
//! the 4-bit mode").

use crate::kernels::simd::{self, QuantizedRows, BLOCK};
use crate::kernels::spin_pool::SpinPool;
use crate::kernels::tiles::{self, TileBytes, TILE_ROWS};

/// A tile's codes for one block: 8 rows of 32 codes, two to a byte.
const CODE_BYTES: usize = TILE_ROWS * BLOCK / 2;
/// A tile's bytes for one block: the codes, 8 scales and 8 minimums.
const TILE_BLOCK_BYTES: usize = CODE_BYTES + 2 * TILE_ROWS * 4;
/// Activation rows the VNNI path multiplies per pass over a tile: a
/// speculative verify step's 7 (a token and 6 drafts) in one pass, their
/// accumulators in AVX-512's 32 vector registers.
const VNNI_ROWS: usize = 8;

/// Q4_1 weights [n, k] in the tile layout (see the module's comment):
/// w[r, c] = scale[r, c / 32] * code[r, c] + min[r, c / 32], codes 0..15.
/// Its `n`, `k`, blocks and tiles are its bytes' (Deref).
pub struct Q4_1Tiles<'a>(TileBytes<'a>);

impl<'a> std::ops::Deref for Q4_1Tiles<'a> {
    type Target = TileBytes<'a>;

    fn deref(&self) -> &TileBytes<'a> {
        &self.0
    }
}

impl<'a> Q4_1Tiles<'a> {
    /// The bytes of weights [n, k] in the tile layout.
    pub fn size(n: usize, k: usize) -> usize {
        TileBytes::size(n, k, TILE_BLOCK_BYTES)
    }

    /// `bytes`, as `pack` wrote them for weights [n, k].
    pub fn new(bytes: &'a [u8], n: usize, k: usize) -> Q4_1Tiles<'a> {
        Self::checked(bytes, n, k).unwrap_or_else(|misfit| panic!("{misfit}"))
    }

    /// `new`, or why `bytes` cannot be the tiles of weights [n, k].
    pub fn checked(bytes: &'a [u8], n: usize, k: usize) -> Result<Q4_1Tiles<'a>, String> {
        TileBytes::checked(bytes, (n, k), TILE_BLOCK_BYTES, "Q4_1").map(Q4_1Tiles)
    }

    /// The weight's [n, k].
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Weight row r's code for input c, its block's scale and minimum.
    fn weight(&self, r: usize, c: usize) -> (u8, f32, f32) {
        let block = self.block(r / TILE_ROWS, c / BLOCK);
        let (row, i) = (r % TILE_ROWS, c % BLOCK);
        let byte = block[code_byte(row, i)];
        let code = if i < BLOCK / 2 { byte & 0x0F } else { byte >> 4 };
        let float = |at: usize| f32::from_le_bytes(block[at + 4 * row..at + 4 * row + 4].try_into().unwrap());
        (code, float(CODE_BYTES), float(CODE_BYTES + 4 * TILE_ROWS))
    }
}

/// Where, in a tile's block, row `row`'s code `i` lies (its nibble: low for
/// i < 16).
fn code_byte(row: usize, i: usize) -> usize {
    let i = i % (BLOCK / 2);
    (i / 4) * 32 + row * 4 + i % 4
}

/// Packs weights [n, k] into `out` (`Q4_1Tiles::size(n, k)` bytes): codes
/// 0..15, one a byte, [n, k]; scales and minimums [n, k / 32]. Rows past
/// `n` in the last tile are zeros.
pub fn pack(codes: &[u8], scales: &[f32], mins: &[f32], n: usize, k: usize, out: &mut [u8]) {
    let blocks = k / BLOCK;
    assert!(codes.len() == n * k && scales.len() == n * blocks && mins.len() == n * blocks);
    assert_eq!(out.len(), Q4_1Tiles::size(n, k));
    out.fill(0);
    for r in 0..n {
        let (t, row) = (r / TILE_ROWS, r % TILE_ROWS);
        for b in 0..blocks {
            let block = &mut out[(t * blocks + b) * TILE_BLOCK_BYTES..][..TILE_BLOCK_BYTES];
            for i in 0..BLOCK {
                let code = codes[r * k + b * BLOCK + i];
                assert!(code < 16, "Q4_1 codes are 0..15, not {code}");
                block[code_byte(row, i)] |= if i < BLOCK / 2 { code } else { code << 4 };
            }
            let (scale, min) = (scales[r * blocks + b], mins[r * blocks + b]);
            block[CODE_BYTES + 4 * row..][..4].copy_from_slice(&scale.to_le_bytes());
            block[CODE_BYTES + 4 * (TILE_ROWS + row)..][..4].copy_from_slice(&min.to_le_bytes());
        }
    }
}

/// out[n, k] = the weights as floats.
pub fn dequantize(weights: &Q4_1Tiles, out: &mut [f32]) {
    let (n, k) = (weights.n, weights.k);
    assert_eq!(out.len(), n * k, "out is [rows of the weights, k]");
    for (r, row) in out.chunks_exact_mut(k).enumerate() {
        for (c, w) in row.iter_mut().enumerate() {
            let (code, scale, min) = weights.weight(r, c);
            *w = scale * code as f32 + min;
        }
    }
}

/// out[m, n] = x[m, k] @ w.T, the columns split in `parts` runs of tiles
/// (at most the pool's threads). Without AVX2, a plain loop computes the
/// same sums in the same order.
pub fn matmul(pool: &SpinPool, parts: usize, x: &[f32], weights: &Q4_1Tiles, out: &mut [f32]) {
    let xs = QuantizedRows::new(x, weights.k);
    #[cfg(target_arch = "x86_64")]
    let vnni = simd::vnni();
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    // Activation rows per pass over a tile: each pass reads the tile's codes once.
    let rows_per_pass = if vnni { VNNI_ROWS } else { 4 };
    tiles::run_passes(pool, parts, (xs.len(), weights.n), rows_per_pass, out, &|t, rows, out, count| {
        let n = weights.n;
        #[cfg(target_arch = "x86_64")]
        if vnni {
            // SAFETY: the CPU has AVX2, FMA and AVX-512 VNNI; as below.
            return unsafe { avx2::multiply_vnni(weights, t, &xs, rows, out, n, count) };
        }
        #[cfg(target_arch = "x86_64")]
        if simd::avx2() {
            // SAFETY: the CPU has AVX2 and FMA; the tile and the rows are inside their buffers.
            return unsafe { avx2::multiply(weights, t, &xs, rows, out, n, count) };
        }
        // SAFETY: as above.
        unsafe { plain_multiply(weights, t, &xs, rows, out, n, count) };
    });
}

/// `avx2::multiply` in plain loops: per block, the integer dot product,
/// then acc += dot * (weight scale * activation scale) and acc += minimum
/// * the activations' sum, each a fused multiply-add as there.
unsafe fn plain_multiply(
    weights: &Q4_1Tiles,
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
        let (_, scale, min) = weights.weight(row, b * BLOCK);
        let acc = (dot as f32).mul_add(scale * xs.scales[r * blocks + b], acc);
        min.mul_add(xs.sums[r * blocks + b], acc)
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q4_1Tiles, CODE_BYTES, TILE_ROWS};
    use crate::kernels::simd::{QuantizedRows, BLOCK};
    use crate::kernels::tiles::avx2::store;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Tile t's first block, the blocks per row, and the activation rows'
    /// codes, scales and sums, each row `blocks` blocks after the last;
    /// checks that they lie inside their buffers.
    fn operands(
        weights: &Q4_1Tiles,
        t: usize,
        xs: &QuantizedRows,
        rows: &Range<usize>,
    ) -> (*const u8, usize, (*const i8, *const f32, *const f32)) {
        let blocks = weights.blocks();
        assert!(xs.blocks == blocks && rows.end * blocks <= xs.scales.len() && t < weights.tiles());
        let at = (
            xs.codes[rows.start * blocks * BLOCK..].as_ptr(),
            xs.scales[rows.start * blocks..].as_ptr(),
            xs.sums[rows.start * blocks..].as_ptr(),
        );
        (weights.block(t, 0).as_ptr(), blocks, at)
    }

    /// out[r, 0..count] (rows `n` apart) = activation rows `rows` (at most
    /// 4) dotted with tile t's weight rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn multiply(
        weights: &Q4_1Tiles,
        t: usize,
        xs: &QuantizedRows,
        rows: Range<usize>,
        out: *mut f32,
        n: usize,
        count: usize,
    ) {
        let (tile, blocks, at) = operands(weights, t, xs, &rows);
        match rows.len() {
            4 => tile_rows::<4>(tile, blocks, at, out, n, count),
            3 => tile_rows::<3>(tile, blocks, at, out, n, count),
            2 => tile_rows::<2>(tile, blocks, at, out, n, count),
            _ => tile_rows::<1>(tile, blocks, at, out, n, count),
        }
    }

    /// `multiply` for up to VNNI_ROWS activation rows, each block's 32
    /// byte products per weight row summed by `vpdpbusd` into 32-bit lanes:
    /// the same integers as maddubs' 16-bit sums (which never saturate,
    /// see the module's comment), so the same outputs to the bit.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn multiply_vnni(
        weights: &Q4_1Tiles,
        t: usize,
        xs: &QuantizedRows,
        rows: Range<usize>,
        out: *mut f32,
        n: usize,
        count: usize,
    ) {
        let (tile, blocks, at) = operands(weights, t, xs, &rows);
        match rows.len() {
            8 => tile_rows_vnni::<8>(tile, blocks, at, out, n, count),
            7 => tile_rows_vnni::<7>(tile, blocks, at, out, n, count),
            6 => tile_rows_vnni::<6>(tile, blocks, at, out, n, count),
            5 => tile_rows_vnni::<5>(tile, blocks, at, out, n, count),
            4 => tile_rows_vnni::<4>(tile, blocks, at, out, n, count),
            3 => tile_rows_vnni::<3>(tile, blocks, at, out, n, count),
            2 => tile_rows_vnni::<2>(tile, blocks, at, out, n, count),
            _ => tile_rows_vnni::<1>(tile, blocks, at, out, n, count),
        }
    }

    /// `tile_rows` with `vpdpbusd`. Two 32-bit sums per row (the low and
    /// the high nibbles' codes) halve each block's chain of dependent
    /// instructions; integer sums, so their order changes nothing.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    unsafe fn tile_rows_vnni<const R: usize>(
        tile: *const u8,
        blocks: usize,
        (codes, x_scales, x_sums): (*const i8, *const f32, *const f32),
        out: *mut f32,
        n: usize,
        count: usize,
    ) {
        let k = blocks * BLOCK;
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let block = tile.add(b * super::TILE_BLOCK_BYTES);
            let mut dots = [[_mm256_setzero_si256(); 2]; R];
            for j in 0..4 {
                let packed = _mm256_loadu_si256(block.add(32 * j) as *const __m256i);
                let halves = [_mm256_and_si256(packed, low), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low)];
                for (h, w) in halves.into_iter().enumerate() {
                    for (r, dot) in dots.iter_mut().enumerate() {
                        let x = codes.add(r * k + b * BLOCK + 4 * j + h * BLOCK / 2);
                        let four = _mm256_set1_epi32((x as *const i32).read_unaligned());
                        dot[h] = _mm256_dpbusd_epi32(dot[h], w, four);
                    }
                }
            }
            let scales = _mm256_loadu_ps(block.add(CODE_BYTES) as *const f32);
            let mins = _mm256_loadu_ps(block.add(CODE_BYTES + 4 * TILE_ROWS) as *const f32);
            for r in 0..R {
                let dot = _mm256_cvtepi32_ps(_mm256_add_epi32(dots[r][0], dots[r][1]));
                let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*x_scales.add(r * blocks + b)));
                acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
                acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(*x_sums.add(r * blocks + b)), acc[r]);
            }
        }
        store(&acc, out, n, count);
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_rows<const R: usize>(
        tile: *const u8,
        blocks: usize,
        (codes, x_scales, x_sums): (*const i8, *const f32, *const f32),
        out: *mut f32,
        n: usize,
        count: usize,
    ) {
        let k = blocks * BLOCK;
        let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let block = tile.add(b * super::TILE_BLOCK_BYTES);
            let mut dots = [_mm256_setzero_si256(); R];
            for j in 0..4 {
                let packed = _mm256_loadu_si256(block.add(32 * j) as *const __m256i);
                // Codes 4j..4j+3 and 4j+16..4j+19 of each row.
                let halves = [_mm256_and_si256(packed, low), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low)];
                for (h, w) in halves.into_iter().enumerate() {
                    for (r, dot) in dots.iter_mut().enumerate() {
                        let x = codes.add(r * k + b * BLOCK + 4 * j + h * BLOCK / 2);
                        let four = _mm256_set1_epi32((x as *const i32).read_unaligned());
                        *dot = _mm256_add_epi16(*dot, _mm256_maddubs_epi16(w, four));
                    }
                }
            }
            let scales = _mm256_loadu_ps(block.add(CODE_BYTES) as *const f32);
            let mins = _mm256_loadu_ps(block.add(CODE_BYTES + 4 * TILE_ROWS) as *const f32);
            for r in 0..R {
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r], ones));
                let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*x_scales.add(r * blocks + b)));
                acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
                acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(*x_sums.add(r * blocks + b)), acc[r]);
            }
        }
        store(&acc, out, n, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::test_values as values;

    /// Weights [n, k]: codes 0..15 one a byte, scales and minimums.
    fn weights(n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let codes = values(n * k, 7).iter().map(|v| ((v + 1.0) * 7.99) as u8).collect();
        let scales = values(n * k / BLOCK, 8).iter().map(|v| 0.01 + v.abs() * 0.05).collect();
        let mins = values(n * k / BLOCK, 9).iter().map(|v| v * 0.3).collect();
        (codes, scales, mins)
    }

    fn packed(codes: &[u8], scales: &[f32], mins: &[f32], n: usize, k: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; Q4_1Tiles::size(n, k)];
        pack(codes, scales, mins, n, k, &mut bytes);
        bytes
    }

    #[test]
    fn packed_tiles_dequantize_to_their_weights() {
        // 20 rows: two whole tiles and one of 4.
        let (n, k) = (20, 96);
        let (codes, scales, mins) = weights(n, k);
        let bytes = packed(&codes, &scales, &mins, n, k);
        let mut dense = vec![0f32; n * k];
        dequantize(&Q4_1Tiles::new(&bytes, n, k), &mut dense);
        for (i, w) in dense.iter().enumerate() {
            let b = i / BLOCK;
            assert_eq!(*w, scales[b] * codes[i] as f32 + mins[b], "weight {i}");
        }
    }

    /// The product of quantized activations and the dequantized weights,
    /// in f64: what the kernels compute up to f32 rounding.
    fn reference(x: &[f32], dense: &[f32], k: usize) -> Vec<f64> {
        let xs = QuantizedRows::new(x, k);
        let n = dense.len() / k;
        let mut out = vec![];
        for r in 0..x.len() / k {
            for c in 0..n {
                out.push(
                    (0..k)
                        .map(|i| {
                            let activation = xs.codes[r * k + i] as f64 * xs.scales[(r * k + i) / BLOCK] as f64;
                            activation * dense[c * k + i] as f64
                        })
                        .sum(),
                );
            }
        }
        out
    }

    /// `matmul`'s products for weights of two whole tiles and one of 4, of
    /// 48 blocks a row and of one, by 1 to 9 rows of activations with an
    /// outlier block, as real activations have: `check(tiles, x, product)`.
    fn each_product(check: impl Fn(&Q4_1Tiles, &[f32], &[f32])) {
        let pool = SpinPool::new(3);
        for (n, k) in [(20, 96), (8, 1536), (3, 32)] {
            let (codes, scales, mins) = weights(n, k);
            let bytes = packed(&codes, &scales, &mins, n, k);
            let tiles = Q4_1Tiles::new(&bytes, n, k);
            for m in [1, 4, 5, 9] {
                let mut x = values(m * k, m as u32);
                x[3] = 40.0;
                let mut got = vec![0f32; m * n];
                matmul(&pool, 3, &x, &tiles, &mut got);
                check(&tiles, &x, &got);
            }
        }
    }

    #[test]
    fn products_are_the_quantized_activations_times_the_weights() {
        each_product(|tiles, x, got| {
            let ((n, k), m) = (tiles.shape(), x.len() / tiles.shape().1);
            let mut dense = vec![0f32; n * k];
            dequantize(tiles, &mut dense);
            for (g, e) in got.iter().zip(reference(x, &dense, k)) {
                assert!((*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()), "n {n} k {k} m {m}: {g} vs {e}");
            }
        });
    }

    /// The plain loops are the same operations in the same order.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_products_are_the_plain_loops_bit_for_bit() {
        simd::require_avx2();
        each_product(|tiles, x, got| {
            let (n, k) = tiles.shape();
            let m = x.len() / k;
            let mut plain = vec![0f32; m * n];
            let xs = QuantizedRows::new(x, k);
            for t in 0..tiles.tiles() {
                for row in (0..m).step_by(4) {
                    let count = TILE_ROWS.min(n - t * TILE_ROWS);
                    let out = plain[row * n + t * TILE_ROWS..].as_mut_ptr();
                    // SAFETY: tile t and rows row..row + 4 (at most) exist; `out` has
                    // `count` columns in each of those rows.
                    unsafe { plain_multiply(tiles, t, &xs, row..m.min(row + 4), out, n, count) };
                }
            }
            assert_eq!(got, plain, "n {n} k {k} m {m}");
        });
    }

    /// The VNNI path (which `matmul` takes where the CPU has it) sums the
    /// same integers as the AVX2 path: the same outputs, 1 to 9 rows.
    /// On a CPU without AVX-512 VNNI this fails saying so (`--skip vnni`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_vnni_products_are_the_avx2_path_bit_for_bit() {
        assert!(simd::vnni(), "not run: this CPU has no AVX-512 VNNI, so there is no VNNI path (--skip vnni)");
        each_product(|tiles, x, got| {
            let (n, k) = tiles.shape();
            let m = x.len() / k;
            let xs = QuantizedRows::new(x, k);
            let (mut maddubs, mut vnni) = (vec![0f32; m * n], vec![0f32; m * n]);
            for t in 0..tiles.tiles() {
                let count = TILE_ROWS.min(n - t * TILE_ROWS);
                for row in (0..m).step_by(4) {
                    let out = maddubs[row * n + t * TILE_ROWS..].as_mut_ptr();
                    // SAFETY: the CPU has AVX2 (it has VNNI); tile t and the rows exist; `out` has
                    // `count` columns in each of those rows.
                    unsafe { avx2::multiply(tiles, t, &xs, row..m.min(row + 4), out, n, count) };
                }
                for row in (0..m).step_by(VNNI_ROWS) {
                    let out = vnni[row * n + t * TILE_ROWS..].as_mut_ptr();
                    // SAFETY: as above, with AVX-512 VNNI.
                    unsafe { avx2::multiply_vnni(tiles, t, &xs, row..m.min(row + VNNI_ROWS), out, n, count) };
                }
            }
            assert_eq!(vnni, maddubs, "n {n} k {k} m {m}");
            assert_eq!(got, &vnni[..], "n {n} k {k} m {m}");
        });
    }

    #[test]
    fn a_rows_product_does_not_depend_on_the_rows_beside_it() {
        let (n, k) = (16, 256);
        let (codes, scales, mins) = weights(n, k);
        let bytes = packed(&codes, &scales, &mins, n, k);
        let tiles = Q4_1Tiles::new(&bytes, n, k);
        let x = values(7 * k, 3);
        let mut all = vec![0f32; 7 * n];
        matmul(&SpinPool::new(2), 2, &x, &tiles, &mut all);
        for r in 0..7 {
            let mut one = vec![0f32; n];
            matmul(&SpinPool::new(1), 1, &x[r * k..(r + 1) * k], &tiles, &mut one);
            assert_eq!(one, all[r * n..(r + 1) * n], "row {r}");
        }
    }

    #[test]
    fn largest_codes_and_activations_do_not_overflow() {
        // Every code 15 and every activation at full scale: 8 maddubs
        // results of 3,810 each share a 16-bit lane.
        let (n, k) = (8, 64);
        let bytes = packed(&vec![15u8; n * k], &vec![1.0; n * k / BLOCK], &vec![0.0; n * k / BLOCK], n, k);
        let pool = SpinPool::new(1);
        for sign in [1.0f32, -1.0] {
            let x = vec![sign; k];
            let mut out = vec![0f32; n];
            matmul(&pool, 1, &x, &Q4_1Tiles::new(&bytes, n, k), &mut out);
            assert!(out.iter().all(|v| (v - sign * 15.0 * k as f32).abs() < 1e-2), "{out:?}");
        }
    }

    #[test]
    #[should_panic(expected = "codes are 0..15")]
    fn a_code_past_four_bits_is_refused() {
        let (n, k) = (1, 32);
        packed(&vec![16u8; k], &[1.0], &[0.0], n, k);
    }
}
