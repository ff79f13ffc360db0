//! The tile products in AVX2, and with AVX-512 VNNI on 256-bit vectors:
//! each output one lane, each block's integer sums then one fused
//! multiply-add per output, in block order (the module's comment).

use super::{Operands, CODE_BYTES, TILE_BLOCK_BYTES};
use crate::kernels::simd::BLOCK;
use crate::kernels::tiles::avx2::store;
use std::arch::x86_64::*;
use std::ops::Range;

/// The first activation row's codes, scales and code sums; checks that
/// `rows` lie inside them.
fn activations(a: &Operands, rows: &Range<usize>) -> (*const i8, *const f32, *const i32) {
    let blocks = a.blocks;
    assert!(a.xs.blocks == blocks && rows.end * blocks <= a.xs.scales.len());
    (
        a.xs.codes[rows.start * blocks * BLOCK..].as_ptr(),
        a.xs.scales[rows.start * blocks..].as_ptr(),
        a.xs.code_sums[rows.start * blocks..].as_ptr(),
    )
}

/// out[r, 0..count] (rows `n` apart) = activation rows `rows` (at most
/// 4) dotted with the tile's weight rows.
///
/// # Safety
/// The CPU has AVX2 and FMA; the tile holds `a.blocks` blocks; `out`
/// has room for `rows.len()` rows of `count` columns, `n` apart.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn multiply(a: &Operands, rows: Range<usize>, out: *mut f32, n: usize, count: usize) {
    let x = activations(a, &rows);
    match rows.len() {
        4 => tile_rows::<4>(a.tile, a.blocks, x, out, n, count),
        3 => tile_rows::<3>(a.tile, a.blocks, x, out, n, count),
        2 => tile_rows::<2>(a.tile, a.blocks, x, out, n, count),
        _ => tile_rows::<1>(a.tile, a.blocks, x, out, n, count),
    }
}

/// `multiply` for up to VNNI_ROWS activation rows with `vpdpbusd`.
///
/// # Safety
/// As for `multiply`; the CPU also has AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
pub unsafe fn multiply_vnni(a: &Operands, rows: Range<usize>, out: *mut f32, n: usize, count: usize) {
    let x = activations(a, &rows);
    match rows.len() {
        8 => tile_rows_vnni::<8>(a.tile, a.blocks, x, out, n, count),
        7 => tile_rows_vnni::<7>(a.tile, a.blocks, x, out, n, count),
        6 => tile_rows_vnni::<6>(a.tile, a.blocks, x, out, n, count),
        5 => tile_rows_vnni::<5>(a.tile, a.blocks, x, out, n, count),
        4 => tile_rows_vnni::<4>(a.tile, a.blocks, x, out, n, count),
        3 => tile_rows_vnni::<3>(a.tile, a.blocks, x, out, n, count),
        2 => tile_rows_vnni::<2>(a.tile, a.blocks, x, out, n, count),
        _ => tile_rows_vnni::<1>(a.tile, a.blocks, x, out, n, count),
    }
}

/// R activation rows against a tile. `vpdpbusd` multiplies unsigned by
/// signed bytes: the codes plus 128 (flipping the sign bit) against the
/// activations, then 128 times the activations' code sum off. Two 32-bit
/// sums per row (even and odd code groups) halve each block's chain of
/// dependent instructions; integer sums, so their order changes nothing.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
unsafe fn tile_rows_vnni<const R: usize>(
    tile: *const u8,
    blocks: usize,
    (codes, x_scales, code_sums): (*const i8, *const f32, *const i32),
    out: *mut f32,
    n: usize,
    count: usize,
) {
    let k = blocks * BLOCK;
    let sign_bit = _mm256_set1_epi8(i8::MIN);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let block = tile.add(b * TILE_BLOCK_BYTES);
        let mut dots = [[_mm256_setzero_si256(); 2]; R];
        for j in 0..BLOCK / 4 {
            let w = _mm256_loadu_si256(block.add(32 * j) as *const __m256i);
            let offset = _mm256_xor_si256(w, sign_bit);
            for (r, dot) in dots.iter_mut().enumerate() {
                let four = _mm256_set1_epi32((codes.add(r * k + b * BLOCK + 4 * j) as *const i32).read_unaligned());
                dot[j % 2] = _mm256_dpbusd_epi32(dot[j % 2], offset, four);
            }
        }
        let scales = _mm256_loadu_ps(block.add(CODE_BYTES) as *const f32);
        for r in 0..R {
            let excess = _mm256_set1_epi32(128 * *code_sums.add(r * blocks + b));
            let dot = _mm256_sub_epi32(_mm256_add_epi32(dots[r][0], dots[r][1]), excess);
            let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*x_scales.add(r * blocks + b)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
        }
    }
    store(&acc, out, n, count);
}

/// R activation rows against a tile with `maddubs`: the codes' magnitudes
/// (unsigned) against the activations with the codes' signs. A pair's
/// 16-bit sum is at most 2 * 128 * 127 = 32,512 and fits; each group of 4
/// is widened to 32 bits before the next is added.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_rows<const R: usize>(
    tile: *const u8,
    blocks: usize,
    (codes, x_scales, _): (*const i8, *const f32, *const i32),
    out: *mut f32,
    n: usize,
    count: usize,
) {
    let k = blocks * BLOCK;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let block = tile.add(b * TILE_BLOCK_BYTES);
        let mut dots = [_mm256_setzero_si256(); R];
        for j in 0..BLOCK / 4 {
            let w = _mm256_loadu_si256(block.add(32 * j) as *const __m256i);
            let magnitudes = _mm256_sign_epi8(w, w);
            for (r, dot) in dots.iter_mut().enumerate() {
                let four = _mm256_set1_epi32((codes.add(r * k + b * BLOCK + 4 * j) as *const i32).read_unaligned());
                let pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(four, w));
                *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(pairs, ones));
            }
        }
        let scales = _mm256_loadu_ps(block.add(CODE_BYTES) as *const f32);
        for r in 0..R {
            let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*x_scales.add(r * blocks + b)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r]);
        }
    }
    store(&acc, out, n, count);
}
