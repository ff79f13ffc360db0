//! Attention of decode rows (one new token each) over their sequences'
//! slots in the paged KV cache, float32 on the CPU: decode_layer's
//! attention step. A task is a piece of one row's slots for one KV head
//! and its group of query heads; a long row's pieces are merged after.

use crate::kernels::simd::{self, dot};
use crate::kernels::spin_pool::{SharedPtr, SpinPool};

/// The attention's heads: `heads` query heads of `head_dim` values in
/// groups that share each of `kv_heads` KV heads; `scale` multiplies the scores.
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// How many pieces a row of `len` slots is split into, each with its own
/// softmax, merged afterwards, so that a single row's few KV heads still
/// occupy every thread: pieces of at most 1,024 slots, and up to 4 pieces
/// of at least 256 slots, so that a row of a few hundred tokens spreads
/// the embedded model's three KV heads over two threads evenly (a decode
/// step at 1,000 tokens of context about 4% faster, bench/README.md
/// K25). The count depends only on the
/// row's length, so a row's output does not depend on the batch or the
/// threads.
fn pieces(len: usize) -> usize {
    len.div_ceil(1024).max(len.div_ceil(256).min(4))
}

/// Softmax attention of each row's query heads over its sequence's cached
/// k/v. A task is a piece of a row's slots for one KV head and its group
/// of query heads (the group reads the head's k/v together, while they are
/// in cache); tasks are split among the pool's threads, and the pieces of
/// a row's head merged after.
///
/// # Safety
/// Row r's first `lens[r]` slots of `slots` [rows, width] lie inside the
/// cache `k` and `v` ([cache slots, kv_heads * head_dim] each); `qkv`
/// holds the rows' q, k and v and `out` their heads' outputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend(
    pool: &SpinPool,
    threads: usize,
    dims: &Heads,
    (slots, width, lens): (&[i64], usize, &[i64]),
    (k, v): (&[f32], &[f32]),
    qkv: &[f32],
    out: &mut [f32],
) {
    let head_dim = dims.head_dim;
    let q_size = dims.heads * head_dim;
    let kv_size = dims.kv_heads * head_dim;
    let qkv_width = q_size + 2 * kv_size;
    let group = dims.heads / dims.kv_heads;
    let mut tasks = Vec::new(); // (row, kv head, piece, slots)
    for (r, &len) in lens.iter().enumerate() {
        let slots = &slots[r * width..][..len as usize];
        let pieces = pieces(slots.len());
        for kv_head in 0..dims.kv_heads {
            for piece in 0..pieces {
                let range = slots.len() * piece / pieces..slots.len() * (piece + 1) / pieces;
                tasks.push((r, kv_head, piece, &slots[range]));
            }
        }
    }
    // The tasks run each head's piece p of every row in turn: the rows of
    // a verify step (one sequence's token and drafts, each over its own
    // prefix) read nearly the same k/v, which one row leaves in cache for
    // the next. Each task writes its own partial sums, so the order changes
    // no bit of the output.
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by_key(|&t| (tasks[t].1, tasks[t].2));
    // Each task's unnormalized weighted sums and (max score, sum of exp)
    // per query head.
    let mut partial = vec![0f32; tasks.len() * group * head_dim];
    let mut stats = vec![(0f32, 0f32); tasks.len() * group];
    let (partial_ptr, stats_ptr) = (SharedPtr(partial.as_mut_ptr()), SharedPtr(stats.as_mut_ptr()));
    let parts = threads.clamp(1, pool.threads()).min(tasks.len().max(1));
    pool.run(parts, &|part| {
        let mut weights = Vec::new();
        for &t in &order[tasks.len() * part / parts..tasks.len() * (part + 1) / parts] {
            let (r, kv_head, _, slots) = tasks[t];
            let kv_offset = kv_head * head_dim;
            let head_cache = HeadCache { k: k.as_ptr().add(kv_offset), v: v.as_ptr().add(kv_offset), stride: kv_size };
            let qs = &qkv[r * qkv_width + kv_head * group * head_dim..][..group * head_dim];
            // SAFETY: each task writes its own part of `partial` and `stats`;
            // the slots lie inside the cache (this function's contract).
            let o = std::slice::from_raw_parts_mut(partial_ptr.get().add(t * group * head_dim), group * head_dim);
            let head_stats = std::slice::from_raw_parts_mut(stats_ptr.get().add(t * group), group);
            #[cfg(target_arch = "x86_64")]
            if head_dim % 8 == 0 && simd::avx2() {
                avx2::attend_group(qs, head_dim, &head_cache, slots, dims.scale, &mut weights, o, head_stats);
                continue;
            }
            for ((q, o), stat) in qs.chunks_exact(head_dim).zip(o.chunks_exact_mut(head_dim)).zip(head_stats) {
                *stat = attend_head(q, &head_cache, slots, dims.scale, &mut weights, o);
            }
        }
    });
    // The pieces of a row's KV head are consecutive tasks.
    let mut t = 0;
    while t < tasks.len() {
        let (r, kv_head, _, _) = tasks[t];
        let pieces = tasks[t..].iter().take_while(|&&(r2, h2, _, _)| (r2, h2) == (r, kv_head)).count();
        for h in 0..group {
            let o = &mut out[r * q_size + (kv_head * group + h) * head_dim..][..head_dim];
            let head_pieces = (t..t + pieces).map(|p| (stats[p * group + h], &partial[(p * group + h) * head_dim..]));
            merge(head_pieces, o);
        }
        t += pieces;
    }
}

/// o = one softmax's weighted sum from its pieces' (max, sum of exp) and
/// unnormalized sums, each rescaled to the largest max.
fn merge<'a>(pieces: impl Iterator<Item = ((f32, f32), &'a [f32])> + Clone, o: &mut [f32]) {
    let max = pieces.clone().fold(f32::NEG_INFINITY, |m, ((piece_max, _), _)| m.max(piece_max));
    o.fill(0.0);
    let mut total = 0.0;
    for ((piece_max, piece_total), sums) in pieces {
        // exp(0) is exactly 1: a softmax of one piece is its own sums.
        let factor = (piece_max - max).exp();
        total += piece_total * factor;
        o.iter_mut().zip(sums).for_each(|(o, v)| *o += v * factor);
    }
    let inverse = 1.0 / total;
    o.iter_mut().for_each(|o| *o *= inverse);
}

/// One KV head's rows in the cache: slot s's k is `k + s * stride`.
struct HeadCache {
    k: *const f32,
    v: *const f32,
    stride: usize,
}

/// o = sum over `slots` of exp(q . k_s * scale - max) v_s, the softmax's
/// weighted sum before its division; returns (max, the sum of the
/// exponentials). `weights` is scratch.
///
/// # Safety
/// Each slot's row of `q.len()` values, `stride` apart, lies inside the
/// buffers `cache` points into.
unsafe fn attend_head(
    q: &[f32],
    cache: &HeadCache,
    slots: &[i64],
    scale: f32,
    weights: &mut Vec<f32>,
    o: &mut [f32],
) -> (f32, f32) {
    let head_dim = q.len();
    weights.clear();
    let mut max = f32::NEG_INFINITY;
    for &s in slots {
        let k = std::slice::from_raw_parts(cache.k.add(s as usize * cache.stride), head_dim);
        let score = dot(q, k) * scale;
        max = max.max(score);
        weights.push(score);
    }
    let mut total = 0.0;
    for w in weights.iter_mut() {
        *w = (*w - max).exp();
        total += *w;
    }
    o.fill(0.0);
    for (&s, &w) in slots.iter().zip(weights.iter()) {
        let v = std::slice::from_raw_parts(cache.v.add(s as usize * cache.stride), head_dim);
        o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
    }
    (max, total)
}

/// `attend_head` in AVX2 for a group of query heads sharing a KV head,
/// heads of a multiple of 8 values: the group reads each k/v row once,
/// and the exponentials are vectorized (scalar loops, a libm call per
/// exponential, made a long context's attention most of a decode step).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::HeadCache;
    use crate::kernels::simd::avx2::{exponentials, sum_lanes};
    use std::arch::x86_64::*;

    /// How many slots ahead the k and v rows are prefetched. The rows of
    /// one KV head are a fraction of each slot's row of the cache, so the
    /// hardware's stream prefetch leaves the loads waiting: prefetching
    /// 16 slots ahead makes a decode step at 4,000 tokens of context about
    /// a fifth faster, and changes nothing measurable up to 2,000
    /// (bench/README.md K24).
    const PREFETCH_SLOTS: usize = 16;

    /// Prefetches the cache lines of `slot`'s `values` floats from `base`.
    #[inline(always)]
    unsafe fn prefetch_row(base: *const f32, stride: usize, slot: Option<&i64>, values: usize) {
        if let Some(&slot) = slot {
            let row = base.add(slot as usize * stride) as *const i8;
            for line in (0..values * 4).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(row.add(line));
            }
        }
    }

    /// The slots whose rows head `h` prefetches while it reads tile `tile`'s,
    /// the i-th while at the tile's i-th slot (PREFETCH_SLOTS ahead, past the
    /// tile's end too): the group's first head reads each row from memory,
    /// the others find it in cache and prefetch none.
    #[inline(always)]
    fn prefetched(slots: &[i64], tile: usize, h: usize) -> &[i64] {
        if h == 0 { slots.get(tile * SLOT_TILE + PREFETCH_SLOTS..).unwrap_or(&[]) } else { &[] }
    }

    /// Slots whose k (then v) rows each head of the group reads in turn:
    /// 64 rows of 128 floats are 32 KB, which stay in L1 and L2.
    const SLOT_TILE: usize = 64;

    /// `attend_head` for each head of `qs` (heads of `head_dim` values),
    /// into the same heads of `out` and `stats`; `weights` is scratch.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `head_dim` is a multiple of 8; as for
    /// `attend_head`, each slot's row lies inside the cache.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_group(
        qs: &[f32],
        head_dim: usize,
        cache: &HeadCache,
        slots: &[i64],
        scale: f32,
        weights: &mut Vec<f32>,
        out: &mut [f32],
        stats: &mut [(f32, f32)],
    ) {
        let (heads, len) = (qs.len() / head_dim, slots.len());
        weights.clear();
        weights.resize(heads * len, 0.0);
        for (tile, tile_slots) in slots.chunks(SLOT_TILE).enumerate() {
            for (h, (q, scores)) in qs.chunks_exact(head_dim).zip(weights.chunks_exact_mut(len)).enumerate() {
                let scores = &mut scores[tile * SLOT_TILE..][..tile_slots.len()];
                let ahead = prefetched(slots, tile, h);
                for (i, (score, &s)) in scores.iter_mut().zip(tile_slots).enumerate() {
                    prefetch_row(cache.k, cache.stride, ahead.get(i), head_dim);
                    *score = dot(q, cache.k.add(s as usize * cache.stride)) * scale;
                }
            }
        }
        for (scores, stat) in weights.chunks_exact_mut(len).zip(stats.iter_mut()) {
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            *stat = (max, exponentials(scores, max));
        }
        out.fill(0.0);
        for (tile, tile_slots) in slots.chunks(SLOT_TILE).enumerate() {
            for (h, (o, head_weights)) in out.chunks_exact_mut(head_dim).zip(weights.chunks_exact(len)).enumerate() {
                let tile_weights = &head_weights[tile * SLOT_TILE..][..tile_slots.len()];
                let ahead = prefetched(slots, tile, h);
                let mut start = 0;
                for width in [8, 4, 2, 1] {
                    while head_dim / 8 - start >= width {
                        match width {
                            8 => weighted_sum::<8>(cache, tile_slots, ahead, tile_weights, start, o),
                            4 => weighted_sum::<4>(cache, tile_slots, ahead, tile_weights, start, o),
                            2 => weighted_sum::<2>(cache, tile_slots, ahead, tile_weights, start, o),
                            _ => weighted_sum::<1>(cache, tile_slots, ahead, tile_weights, start, o),
                        }
                        start += width;
                    }
                }
            }
        }
    }

    /// q . k over q's length (a multiple of 8), four vectors at a time in
    /// four chains of FMAs. (Accumulators in an array indexed by the loop
    /// were kept on the stack, each FMA a store and a load.)
    #[inline(always)]
    unsafe fn dot(q: &[f32], k: *const f32) -> f32 {
        let (mut a, mut b, mut c, mut d) =
            (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let load = |i: usize| (_mm256_loadu_ps(q.as_ptr().add(8 * i)), _mm256_loadu_ps(k.add(8 * i)));
        let vectors = q.len() / 8;
        let mut i = 0;
        while i + 4 <= vectors {
            let ((q0, k0), (q1, k1), (q2, k2), (q3, k3)) = (load(i), load(i + 1), load(i + 2), load(i + 3));
            a = _mm256_fmadd_ps(q0, k0, a);
            b = _mm256_fmadd_ps(q1, k1, b);
            c = _mm256_fmadd_ps(q2, k2, c);
            d = _mm256_fmadd_ps(q3, k3, d);
            i += 4;
        }
        while i < vectors {
            let (q0, k0) = load(i);
            a = _mm256_fmadd_ps(q0, k0, a);
            i += 1;
        }
        sum_lanes(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)))
    }

    /// o[8 * start .. 8 * (start + N)] += the weighted sum of those values
    /// of v over `slots`: N vectors of accumulators stay in registers
    /// across the slots. While at slot j it prefetches the same values of
    /// slot `ahead[j]` (none past `ahead`'s end).
    #[inline(always)]
    unsafe fn weighted_sum<const N: usize>(
        cache: &HeadCache,
        slots: &[i64],
        ahead: &[i64],
        weights: &[f32],
        start: usize,
        o: &mut [f32],
    ) {
        let o = o.as_mut_ptr().add(8 * start);
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.add(8 * i));
        }
        for (j, (&s, &w)) in slots.iter().zip(weights).enumerate() {
            prefetch_row(cache.v.add(8 * start), cache.stride, ahead.get(j), 8 * N);
            let v = cache.v.add(s as usize * cache.stride + 8 * start);
            let w = _mm256_set1_ps(w);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(8 * i)), *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * i), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores, softmax and weighted values of a group of three query heads
    /// over 1, 7 and 150 slots (tiles of 64 and a remainder) taken out of
    /// order, for heads of 8 vectors and of 8 + 1, 8 + 4 and 2 x 8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_attention_is_the_plain_loops() {
        simd::require_avx2();
        let mut seed = 7u32;
        let mut value = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        let (cached, heads) = (160, 3);
        for head_dim in [64, 72, 96, 128] {
            let stride = 2 * head_dim; // two KV heads; the second is read
            let k: Vec<f32> = (0..cached * stride).map(|_| value()).collect();
            let v: Vec<f32> = (0..cached * stride).map(|_| value()).collect();
            let qs: Vec<f32> = (0..heads * head_dim).map(|_| value()).collect();
            let cache = HeadCache { k: k[head_dim..].as_ptr(), v: v[head_dim..].as_ptr(), stride };
            for len in [1, 7, 150] {
                let slots: Vec<i64> = (0..len).map(|i| (i * 17 % cached) as i64).collect();
                let (mut fast, mut fast_stats) = (vec![0f32; heads * head_dim], vec![(0f32, 0f32); heads]);
                let mut weights = Vec::new();
                // SAFETY: the CPU has AVX2; every slot is below `cached`.
                unsafe {
                    avx2::attend_group(&qs, head_dim, &cache, &slots, 0.125, &mut weights, &mut fast, &mut fast_stats)
                };
                for ((q, fast), fast_stats) in
                    qs.chunks_exact(head_dim).zip(fast.chunks_exact(head_dim)).zip(&fast_stats)
                {
                    let mut plain = vec![0f32; head_dim];
                    // SAFETY: every slot is below `cached`.
                    let (max, total) = unsafe { attend_head(q, &cache, &slots, 0.125, &mut weights, &mut plain) };
                    assert!((max - fast_stats.0).abs() < 1e-5, "head_dim {head_dim}, {len} slots");
                    assert!((total - fast_stats.1).abs() < 1e-5 * total, "head_dim {head_dim}, {len} slots");
                    for (a, b) in plain.iter().zip(fast) {
                        assert!((a - b).abs() < 1e-5 * total, "head_dim {head_dim}, {len} slots: {a} vs {b}");
                    }
                }
            }
        }
    }

    /// A row of 2,600 slots is four pieces (`pieces`) whose
    /// softmaxes are merged: the result is the whole softmax, computed here
    /// in f64, for heads on the AVX2 path (8 values) and off it (6).
    #[test]
    fn a_long_rows_pieces_merge_into_one_softmax() {
        let (len, heads) = (2600usize, 2);
        for head_dim in [8, 6] {
            let dims = Heads { heads, kv_heads: 1, head_dim, scale: 0.3 };
            let wave = |i: usize, d: usize| ((i * 7 + d * 3) % 23) as f32 / 23.0 * 4.0 - 2.0;
            let k: Vec<f32> = (0..len * head_dim).map(|i| wave(i, 1)).collect();
            let v: Vec<f32> = (0..len * head_dim).map(|i| wave(i, 2)).collect();
            let slots: Vec<i64> = (0..len as i64).rev().collect();
            let qkv: Vec<f32> = (0..(heads + 2) * head_dim).map(|i| wave(i, 5)).collect();
            let mut out = vec![0f32; heads * head_dim];
            // SAFETY: the slots are 0..len, the cache's.
            unsafe { attend(SpinPool::global(), 2, &dims, (&slots, len, &[len as i64]), (&k, &v), &qkv, &mut out) };
            for head in 0..heads {
                let q = &qkv[head * head_dim..][..head_dim];
                let scores: Vec<f64> = (0..len)
                    .map(|s| (0..head_dim).map(|d| (q[d] * k[s * head_dim + d]) as f64).sum::<f64>() * 0.3)
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for d in 0..head_dim {
                    let want: f64 = scores
                        .iter()
                        .enumerate()
                        .map(|(s, x)| (x - max).exp() * v[s * head_dim + d] as f64)
                        .sum::<f64>()
                        / total;
                    let got = out[head * head_dim + d] as f64;
                    assert!((got - want).abs() < 1e-4, "head_dim {head_dim}, head {head}, {d}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn rows_split_into_pieces_of_256_to_1024_slots() {
        let counts: Vec<usize> = [1, 256, 257, 700, 1024, 1025, 2600, 4096, 4097].map(pieces).to_vec();
        assert_eq!(counts, [1, 1, 2, 3, 4, 4, 4, 4, 5]);
    }

    /// Rows of four and three pieces and of one, over two KV heads, the
    /// first two a verify step's (one prefix, one slot apart): each row's
    /// output in the batch is the one it gets alone, to the bit, whatever
    /// order the tasks ran in.
    #[test]
    fn a_row_gets_the_same_bits_alone_and_among_rows_of_many_pieces() {
        let (dims, cached) = (Heads { heads: 4, kv_heads: 2, head_dim: 8, scale: 0.3 }, 2600usize);
        let wave = |i: usize, d: usize| ((i * 7 + d * 3) % 23) as f32 / 23.0 * 4.0 - 2.0;
        let kv_size = dims.kv_heads * dims.head_dim;
        let k: Vec<f32> = (0..cached * kv_size).map(|i| wave(i, 1)).collect();
        let v: Vec<f32> = (0..cached * kv_size).map(|i| wave(i, 2)).collect();
        let slots: Vec<i64> = (0..cached as i64).collect();
        let lens = [2599i64, 2600, 1500, 700, 200];
        let table: Vec<i64> = lens.iter().flat_map(|_| slots.iter().copied()).collect();
        let qkv_width = (dims.heads + 2 * dims.kv_heads) * dims.head_dim;
        let qkv: Vec<f32> = (0..lens.len() * qkv_width).map(|i| wave(i, 5)).collect();
        let q_size = dims.heads * dims.head_dim;
        let mut batched = vec![0f32; lens.len() * q_size];
        // SAFETY: every row's slots are 0..cached, the cache's.
        unsafe { attend(SpinPool::global(), 2, &dims, (&table, cached, &lens), (&k, &v), &qkv, &mut batched) };
        for (r, &len) in lens.iter().enumerate() {
            let mut alone = vec![0f32; q_size];
            let row = &qkv[r * qkv_width..][..qkv_width];
            // SAFETY: as above.
            unsafe { attend(SpinPool::global(), 2, &dims, (&slots, cached, &[len]), (&k, &v), row, &mut alone) };
            assert_eq!(&batched[r * q_size..][..q_size], &alone[..], "row {r}");
        }
    }

    /// Two rows over one shared KV head (two query heads each), the first
    /// attending over 3 slots, the second over 1 (its list padded).
    #[test]
    fn attend_weighs_each_rows_own_slots() {
        let dims = Heads { heads: 2, kv_heads: 1, head_dim: 2, scale: 0.5 };
        let k = [0.0f32, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 9.0, 9.0]; // 5 slots of [1 head, 2]
        let v = [0.0f32, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let (slots, lens) = ([1i64, 2, 3, 4, 0, 0], [3i64, 1]);
        // each row: q (2 heads x 2), k, v
        let qkv = [1.0f32, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let mut out = [0f32; 8];
        // SAFETY: the rows' slots are 1..=4, inside the 5 of the cache.
        unsafe { attend(SpinPool::global(), 2, &dims, (&slots, 3, &lens), (&k, &v), &qkv, &mut out) };
        for (r, head, q) in [(0, 0, [1.0f32, 0.0]), (0, 1, [0.0, 2.0])] {
            let slots = [1usize, 2, 3];
            let scores: Vec<f32> = slots.iter().map(|&s| 0.5 * (q[0] * k[2 * s] + q[1] * k[2 * s + 1])).collect();
            let total: f32 = scores.iter().map(|s| s.exp()).sum();
            for d in 0..2 {
                let want: f32 = slots.iter().zip(&scores).map(|(&s, w)| w.exp() / total * v[2 * s + d]).sum();
                assert!((out[r * 4 + head * 2 + d] - want).abs() < 1e-5, "row {r} head {head}");
            }
        }
        // the second row sees only slot 4: its value, whatever the scores
        assert_eq!(&out[4..], &[7.0, 8.0, 7.0, 8.0]);
    }
}
