//! One decoder layer of a decode step (one new token per sequence) on the
//! CPU, for Llama-style layers whose projections are Q4_1 blocks (the
//! `8da4w` layout): the residual add and RMSNorm, q/k/v, rotary, the KV
//! write, attention over each sequence's slots, o_proj, the second norm,
//! gate/up, SiLU and down, in one call.
//!
//! Why not torch: at batch 1 the projections of a small model take about
//! half of a step; the rest was per-op cost around them (torch.compile's
//! frame and guard checks per layer call, the custom ops' dispatch, SDPA's
//! set-up for one query), which a plain loop here does not have.

use crate::block_gemm::{self, Q4_1Tiles};
use crate::block_quant::{self, SharedPtr};
use crate::extend_attention::{self, Extend};
use crate::spin_pool::SpinPool;

/// The layer's sizes.
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub eps: f32,
    /// Softmax scale of the attention scores.
    pub scale: f32,
}

/// The layer's weights: RMSNorm weights and Q4_1 projections in
/// block_gemm's tiles (gate and up fused, q/k/v fused, with an optional
/// bias as in Qwen2).
pub struct Layer<'a> {
    pub input_norm: &'a [f32],
    pub qkv: Q4_1Tiles<'a>,
    pub qkv_bias: Option<&'a [f32]>,
    pub o: Q4_1Tiles<'a>,
    pub post_norm: &'a [f32],
    pub gate_up: Q4_1Tiles<'a>,
    pub down: Q4_1Tiles<'a>,
}

/// What each row of the step needs besides its hidden state.
pub struct Rows<'a> {
    /// Rotary cos and sin at the row's position, [rows, head_dim / 2].
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// The KV slot of the row's new token.
    pub new_slot: &'a [i64],
    pub sequences: Sequences<'a>,
}

/// The sequences the rows belong to, whose slots their attention reads.
pub enum Sequences<'a> {
    /// A decode step: each row is one sequence's new token and attends over
    /// the first `lens[row]` of its row of `slots` [rows, width] (its new
    /// token's last).
    Decode { slots: &'a [i64], width: usize, lens: &'a [i64] },
    /// A prefill step: each entry is a sequence's count of new tokens, the
    /// next rows in order, and its slots (the new tokens' last); each new
    /// token sees the slots up to its own (extend_attention's rule).
    Extend(Vec<(usize, &'a [i64])>),
}

/// One layer's KV cache: `slots` slots of [kv_heads, head_dim] floats each.
pub struct KvCache {
    pub k: *mut f32,
    pub v: *mut f32,
    pub slots: usize,
}

// SAFETY: the attention tasks only read the cache; `decode_layer` writes
// the new k/v before they start.
unsafe impl Send for KvCache {}
unsafe impl Sync for KvCache {}

/// Runs the layer on `x` (the previous layer's MLP output, or the
/// embeddings with a zero residual), [rows, hidden]. Afterwards `x` holds
/// this layer's MLP output and `residual` the stream before it, as
/// `DecoderLayer.after_attention` returns them.
///
/// # Safety
/// `cache` points to two live buffers of `cache.slots` slots that nothing
/// else touches during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_layer(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    layer: &Layer,
    rows: &Rows,
    cache: &KvCache,
    x: &mut [f32],
    residual: &mut [f32],
) {
    let (hidden, head_dim) = (dims.hidden, dims.head_dim);
    let n = rows.new_slot.len();
    assert!(x.len() == n * hidden && residual.len() == n * hidden, "x and residual are [rows, hidden]");
    check_slots(rows, cache);
    let q_size = dims.heads * head_dim;
    let kv_size = dims.kv_heads * head_dim;
    let qkv_width = q_size + 2 * kv_size;

    let mut normed = vec![0f32; n * hidden];
    add_and_norm(x, residual, layer.input_norm, dims.eps, &mut normed);
    let mut qkv = vec![0f32; n * qkv_width];
    block_gemm::matmul(pool, threads, &normed, &layer.qkv, &mut qkv);
    let half = head_dim / 2;
    for (r, row) in qkv.chunks_exact_mut(qkv_width).enumerate() {
        if let Some(bias) = layer.qkv_bias {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
        let (cos, sin) = (&rows.cos[r * half..(r + 1) * half], &rows.sin[r * half..(r + 1) * half]);
        for head in row[..q_size + kv_size].chunks_exact_mut(head_dim) {
            rotate(head, cos, sin);
        }
        let at = rows.new_slot[r] as usize * kv_size;
        std::ptr::copy_nonoverlapping(row[q_size..].as_ptr(), cache.k.add(at), kv_size);
        std::ptr::copy_nonoverlapping(row[q_size + kv_size..].as_ptr(), cache.v.add(at), kv_size);
    }

    let mut attended = vec![0f32; n * q_size];
    match &rows.sequences {
        Sequences::Decode { slots, width, lens } => {
            attend(pool, threads, dims, (slots, *width, lens), cache, &qkv, &mut attended)
        }
        Sequences::Extend(sequences) => attend_extends(pool, threads, dims, sequences, cache, &qkv, &mut attended),
    }
    let mut projected = vec![0f32; n * hidden];
    block_gemm::matmul(pool, threads, &attended, &layer.o, &mut projected);
    add_and_norm(&projected, residual, layer.post_norm, dims.eps, &mut normed);

    let inter = dims.intermediate;
    let mut gate_up = vec![0f32; n * 2 * inter];
    block_gemm::matmul(pool, threads, &normed, &layer.gate_up, &mut gate_up);
    let mut activated = vec![0f32; n * inter];
    for (row, out) in gate_up.chunks_exact(2 * inter).zip(activated.chunks_exact_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        silu_times(gate, up, out);
    }
    block_gemm::matmul(pool, threads, &activated, &layer.down, x);
}

/// out = SiLU(gate) * up.
fn silu_times(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if block_quant::avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        done = unsafe { avx2::silu_times(gate, up, out) };
    }
    for ((o, g), u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// residual += x; out = RMSNorm(residual) * weight, row by row.
fn add_and_norm(x: &[f32], residual: &mut [f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = weight.len();
    for ((x, res), out) in
        x.chunks_exact(hidden).zip(residual.chunks_exact_mut(hidden)).zip(out.chunks_exact_mut(hidden))
    {
        res.iter_mut().zip(x).for_each(|(r, v)| *r += v);
        let inverse = 1.0 / (dot(res, res) / hidden as f32 + eps).sqrt();
        for ((o, r), w) in out.iter_mut().zip(res.iter()).zip(weight) {
            *o = w * (r * inverse);
        }
    }
}

/// Rotate-half RoPE of one head, as llama.py's `apply_rotary`.
fn rotate(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (first, second) = head.split_at_mut(cos.len());
    for (((a, b), c), s) in first.iter_mut().zip(second.iter_mut()).zip(cos).zip(sin) {
        let (x1, x2) = (*a, *b);
        *a = x1 * c - x2 * s;
        *b = x2 * c + x1 * s;
    }
}

/// Checks, before anything is written, that every slot the step writes or
/// reads lies inside the cache, that each decode row reads 1..=width of its
/// slots and that the extends' new tokens are the rows, each within its
/// sequence: the raw reads and writes below rely on it.
fn check_slots(rows: &Rows, cache: &KvCache) {
    let n = rows.new_slot.len();
    let inside = |s: i64| s >= 0 && (s as usize) < cache.slots;
    assert!(rows.new_slot.iter().all(|&s| inside(s)), "a KV slot outside the cache");
    match &rows.sequences {
        Sequences::Decode { slots, width, lens } => {
            assert!(lens.len() == n && slots.len() == n * width, "one slot list per row");
            for (r, &len) in lens.iter().enumerate() {
                assert!(len >= 1 && len as usize <= *width, "a row attends over 1..=width slots");
                assert!(slots[r * width..][..len as usize].iter().all(|&s| inside(s)), "a KV slot outside the cache");
            }
        }
        Sequences::Extend(sequences) => {
            assert_eq!(
                sequences.iter().map(|(count, _)| count).sum::<usize>(),
                n,
                "the extends' new tokens are the rows"
            );
            for (count, slots) in sequences {
                assert!(*count >= 1 && *count <= slots.len(), "an extend has 1..=its slots new tokens");
                assert!(slots.iter().all(|&s| inside(s)), "a KV slot outside the cache");
            }
        }
    }
}

/// Each extend's attention (rust/extend_attention.rs) over the cache,
/// its rows' queries copied out of `qkv` together. The caller has run
/// `check_slots`.
unsafe fn attend_extends(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    sequences: &[(usize, &[i64])],
    cache: &KvCache,
    qkv: &[f32],
    out: &mut [f32],
) {
    let q_size = dims.heads * dims.head_dim;
    let kv_size = dims.kv_heads * dims.head_dim;
    let qkv_width = q_size + 2 * kv_size;
    // SAFETY: the cache holds `slots` slots; this step's writes are done.
    let k = std::slice::from_raw_parts(cache.k, cache.slots * kv_size);
    let v = std::slice::from_raw_parts(cache.v, cache.slots * kv_size);
    let mut q = Vec::new();
    let mut first = 0;
    for &(count, slots) in sequences {
        q.clear();
        for row in qkv[first * qkv_width..].chunks_exact(qkv_width).take(count) {
            q.extend_from_slice(&row[..q_size]);
        }
        let extend = Extend {
            q: &q,
            k,
            v,
            slots,
            heads: dims.heads,
            kv_heads: dims.kv_heads,
            head_dim: dims.head_dim,
            scale: dims.scale,
        };
        extend_attention::attend(pool, threads, &extend, &mut out[first * q_size..(first + count) * q_size]);
        first += count;
    }
}

/// Slots a piece of one row's attention covers at most: a longer context
/// is split into pieces (each with its own softmax, merged afterwards) so
/// that a single row's few KV heads still occupy every thread. The count
/// depends only on the row's length, so a row's output does not depend
/// on the batch or the threads.
const SLOTS_PER_PIECE: usize = 1024;

/// Softmax attention of each row's query heads over its sequence's cached
/// k/v. A task is a piece of a row's slots for one KV head and its group
/// of query heads (the group reads the head's k/v together, while they are
/// in cache); tasks are split among the pool's threads, and the pieces of
/// a row's head merged after. The caller has run `check_slots`.
unsafe fn attend(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    (slots, width, lens): (&[i64], usize, &[i64]),
    cache: &KvCache,
    qkv: &[f32],
    out: &mut [f32],
) {
    let head_dim = dims.head_dim;
    let q_size = dims.heads * head_dim;
    let kv_size = dims.kv_heads * head_dim;
    let qkv_width = q_size + 2 * kv_size;
    let group = dims.heads / dims.kv_heads;
    let mut tasks = Vec::new(); // (row, kv head, slots)
    for (r, &len) in lens.iter().enumerate() {
        let slots = &slots[r * width..][..len as usize];
        let pieces = slots.len().div_ceil(SLOTS_PER_PIECE);
        for kv_head in 0..dims.kv_heads {
            for piece in 0..pieces {
                let range = slots.len() * piece / pieces..slots.len() * (piece + 1) / pieces;
                tasks.push((r, kv_head, &slots[range]));
            }
        }
    }
    // Each task's unnormalized weighted sums and (max score, sum of exp)
    // per query head.
    let mut partial = vec![0f32; tasks.len() * group * head_dim];
    let mut stats = vec![(0f32, 0f32); tasks.len() * group];
    let (partial_ptr, stats_ptr) = (SharedPtr(partial.as_mut_ptr()), SharedPtr(stats.as_mut_ptr()));
    let parts = threads.clamp(1, pool.threads()).min(tasks.len().max(1));
    pool.run(parts, &|part| {
        let mut weights = Vec::new();
        for t in tasks.len() * part / parts..tasks.len() * (part + 1) / parts {
            let (r, kv_head, slots) = tasks[t];
            let kv_offset = kv_head * head_dim;
            let head_cache = HeadCache { k: cache.k.add(kv_offset), v: cache.v.add(kv_offset), stride: kv_size };
            let qs = &qkv[r * qkv_width + kv_head * group * head_dim..][..group * head_dim];
            // SAFETY: each task writes its own part of `partial` and `stats`.
            let o = std::slice::from_raw_parts_mut(partial_ptr.get().add(t * group * head_dim), group * head_dim);
            let head_stats = std::slice::from_raw_parts_mut(stats_ptr.get().add(t * group), group);
            #[cfg(target_arch = "x86_64")]
            if head_dim % 8 == 0 && block_quant::avx2() {
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
        let (r, kv_head, _) = tasks[t];
        let pieces = tasks[t..].iter().take_while(|&&(r2, h2, _)| (r2, h2) == (r, kv_head)).count();
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
/// heads of a multiple of 8 values. The scalar build (SSE, a libm call per
/// exponential, the k/v read again for each head of the group) made a
/// long context's attention most of a decode step (bench/long_context.py:
/// 8.2 ms at 32 cached tokens, 20.7 at 1,300 and 37.0 at 3,000; with this
/// and the split into pieces, 7.5, 12.6 and 19.0).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::HeadCache;
    use crate::block_quant::avx2::sum_lanes;
    use std::arch::x86_64::*;

    /// Slots whose k (then v) rows each head of the group reads in turn:
    /// 64 rows of 128 floats are 32 KB, which stay in L1 and L2.
    const SLOT_TILE: usize = 64;

    /// `attend_head` for each head of `qs` (heads of `head_dim` values),
    /// into the same heads of `out` and `stats`; `weights` is scratch.
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
            for (q, scores) in qs.chunks_exact(head_dim).zip(weights.chunks_exact_mut(len)) {
                let scores = &mut scores[tile * SLOT_TILE..][..tile_slots.len()];
                for (score, &s) in scores.iter_mut().zip(tile_slots) {
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
            for (o, head_weights) in out.chunks_exact_mut(head_dim).zip(weights.chunks_exact(len)) {
                let tile_weights = &head_weights[tile * SLOT_TILE..][..tile_slots.len()];
                let mut start = 0;
                for width in [8, 4, 2, 1] {
                    while head_dim / 8 - start >= width {
                        match width {
                            8 => weighted_sum::<8>(cache, tile_slots, tile_weights, start, o),
                            4 => weighted_sum::<4>(cache, tile_slots, tile_weights, start, o),
                            2 => weighted_sum::<2>(cache, tile_slots, tile_weights, start, o),
                            _ => weighted_sum::<1>(cache, tile_slots, tile_weights, start, o),
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

    /// w = exp(w - max) in place; returns their sum.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exponentials(weights: &mut [f32], max: f32) -> f32 {
        let shift = _mm256_set1_ps(max);
        let mut sums = _mm256_setzero_ps();
        let mut chunks = weights.chunks_exact_mut(8);
        for chunk in &mut chunks {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift));
            _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            sums = _mm256_add_ps(sums, e);
        }
        let mut total = sum_lanes(sums);
        for w in chunks.into_remainder() {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), exp(_mm256_set1_ps(*w - max)));
            *w = lanes[0];
            total += *w;
        }
        total
    }

    /// o[8 * start .. 8 * (start + N)] += the weighted sum of those values
    /// of v over `slots`: N vectors of accumulators stay in registers
    /// across the slots.
    #[inline(always)]
    unsafe fn weighted_sum<const N: usize>(
        cache: &HeadCache,
        slots: &[i64],
        weights: &[f32],
        start: usize,
        o: &mut [f32],
    ) {
        let o = o.as_mut_ptr().add(8 * start);
        let mut acc = [_mm256_setzero_ps(); N];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.add(8 * i));
        }
        for (&s, &w) in slots.iter().zip(weights) {
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

    /// `silu_times` eight values at a time; returns how many it wrote (the
    /// caller does the rest). e^-g is capped at e^88 (f32's range), where
    /// g / (1 + e^-g) is already 0 to within 1e-36 of g.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_times(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let count = gate.len().min(up.len()).min(out.len()) / 8 * 8;
        let (one, cap) = (_mm256_set1_ps(1.0), _mm256_set1_ps(88.0));
        for i in (0..count).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), cap));
            let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
        count
    }

    /// e^x for x <= 88: scores minus their maximum (x <= 0, within 4 ulp,
    /// tested) and SiLU's e^-g:
    /// x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to
    /// r^7 / 7! (the next term is below 2^-27 of it), times 2^n built in
    /// the exponent bits. Below -87 (e^x under f32's normal range) it
    /// returns 0.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT);
        // ln 2 in two parts, so that n * LN2_HIGH is exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(power)))
    }
}

/// sum a[i] * b[i] in eight independent lanes, which the compiler vectorizes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotate_turns_each_pair_by_its_angle() {
        let angle = [0.3f32, -1.1];
        let (cos, sin): (Vec<f32>, Vec<f32>) = angle.iter().map(|a| (a.cos(), a.sin())).unzip();
        let mut head = [1.0, 2.0, 0.5, -1.0]; // pairs (1, 0.5) and (2, -1)
        rotate(&mut head, &cos, &sin);
        for (i, a) in angle.iter().enumerate() {
            let (x1, x2) = ([1.0f32, 2.0][i], [0.5f32, -1.0][i]);
            assert!((head[i] - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-6);
            assert!((head[i + 2] - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-6);
        }
    }

    #[test]
    fn add_and_norm_adds_the_residual_then_normalizes() {
        let (x, mut residual, weight) = ([1.0f32, 2.0, 3.0, 4.0], [1.0f32, 0.0, -1.0, 0.0], [1.0f32, 2.0, 1.0, 0.5]);
        let mut out = [0f32; 4];
        add_and_norm(&x, &mut residual, &weight, 0.0, &mut out);
        assert_eq!(residual, [2.0, 2.0, 2.0, 4.0]);
        let rms = ((4.0 + 4.0 + 4.0 + 16.0) / 4.0f32).sqrt();
        for i in 0..4 {
            assert!((out[i] - weight[i] * residual[i] / rms).abs() < 1e-6);
        }
    }

    #[test]
    #[should_panic(expected = "outside the cache")]
    fn a_slot_past_the_cache_is_refused_before_any_write() {
        let mut kv = [0f32; 4];
        let cache = KvCache { k: kv.as_mut_ptr(), v: kv.as_mut_ptr(), slots: 2 };
        let sequences = Sequences::Decode { slots: &[0, 2], width: 2, lens: &[2] };
        let rows = Rows { cos: &[], sin: &[], new_slot: &[1], sequences };
        check_slots(&rows, &cache);
    }

    /// Scores, softmax and weighted values of a group of three query heads
    /// over 1, 7 and 150 slots (tiles of 64 and a remainder) taken out of
    /// order, for heads of 8 vectors and of 8 + 1, 8 + 4 and 2 x 8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_attention_is_the_plain_loops() {
        if !block_quant::avx2() {
            return;
        }
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
                unsafe {
                    avx2::attend_group(&qs, head_dim, &cache, &slots, 0.125, &mut weights, &mut fast, &mut fast_stats)
                };
                for ((q, fast), fast_stats) in
                    qs.chunks_exact(head_dim).zip(fast.chunks_exact(head_dim)).zip(&fast_stats)
                {
                    let mut plain = vec![0f32; head_dim];
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

    /// A row of 2,600 slots is three pieces (SLOTS_PER_PIECE) whose
    /// softmaxes are merged: the result is the whole softmax, computed here
    /// in f64, for heads on the AVX2 path (8 values) and off it (6).
    #[test]
    fn a_long_rows_pieces_merge_into_one_softmax() {
        let (len, heads) = (2600usize, 2);
        for head_dim in [8, 6] {
            let dims = Dims { hidden: 0, heads, kv_heads: 1, head_dim, intermediate: 0, eps: 0.0, scale: 0.3 };
            let wave = |i: usize, d: usize| ((i * 7 + d * 3) % 23) as f32 / 23.0 * 4.0 - 2.0;
            let mut k: Vec<f32> = (0..len * head_dim).map(|i| wave(i, 1)).collect();
            let mut v: Vec<f32> = (0..len * head_dim).map(|i| wave(i, 2)).collect();
            let cache = KvCache { k: k.as_mut_ptr(), v: v.as_mut_ptr(), slots: len };
            let slots: Vec<i64> = (0..len as i64).rev().collect();
            let half = head_dim / 2;
            let (cos, sin) = (vec![1.0f32; half], vec![0.0f32; half]);
            let sequences = Sequences::Decode { slots: &slots, width: len, lens: &[len as i64] };
            let rows = Rows { cos: &cos, sin: &sin, new_slot: &[0], sequences };
            let qkv: Vec<f32> = (0..(heads + 2) * head_dim).map(|i| wave(i, 5)).collect();
            let mut out = vec![0f32; heads * head_dim];
            check_slots(&rows, &cache);
            unsafe { attend(SpinPool::global(), 2, &dims, (&slots, len, &[len as i64]), &cache, &qkv, &mut out) };
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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exponential_is_within_a_few_ulp() {
        if !block_quant::avx2() {
            return;
        }
        let xs: Vec<f32> = (0..=9000).map(|i| -0.01 * i as f32).collect();
        let mut weights = xs.clone();
        let total = unsafe { avx2::exponentials(&mut weights, 0.0) };
        for (x, got) in xs.iter().zip(&weights) {
            if *x < -87.0 {
                assert_eq!(*got, 0.0);
            } else {
                let want = x.exp();
                assert!((got - want).abs() <= 4.0 * f32::EPSILON * want, "e^{x}: {got} vs {want}");
            }
        }
        let want_total: f32 = xs.iter().map(|x| if *x < -87.0 { 0.0 } else { x.exp() }).sum();
        assert!((total - want_total).abs() < 1e-5 * want_total);
    }

    /// Two rows over one shared KV head (two query heads each), the first
    /// attending over 3 slots, the second over 1 (its list padded).
    #[test]
    fn attend_weighs_each_rows_own_slots() {
        let dims = Dims { hidden: 8, heads: 2, kv_heads: 1, head_dim: 2, intermediate: 0, eps: 0.0, scale: 0.5 };
        let mut k = [0.0f32, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 9.0, 9.0]; // 5 slots of [1 head, 2]
        let mut v = [0.0f32, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let cache = KvCache { k: k.as_mut_ptr(), v: v.as_mut_ptr(), slots: 5 };
        let (cos, sin) = ([1.0f32; 2], [0.0f32; 2]);
        let (slots, lens) = ([1i64, 2, 3, 4, 0, 0], [3i64, 1]);
        let sequences = Sequences::Decode { slots: &slots, width: 3, lens: &lens };
        let rows = Rows { cos: &cos, sin: &sin, new_slot: &[3, 4], sequences };
        // each row: q (2 heads x 2), k, v
        let qkv = [1.0f32, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let mut out = [0f32; 8];
        check_slots(&rows, &cache);
        unsafe { attend(SpinPool::global(), 2, &dims, (&slots, 3, &lens), &cache, &qkv, &mut out) };
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

    /// Two extends in one step (3 new tokens after 37 cached, and a fresh
    /// prompt of 5): each new token attends as a decode row over its
    /// sequence's slots up to its own.
    #[test]
    fn extend_rows_attend_as_decode_rows_over_their_prefix() {
        let dims = Dims { hidden: 0, heads: 6, kv_heads: 2, head_dim: 8, intermediate: 0, eps: 0.0, scale: 0.35 };
        let (q_size, kv_size) = (6 * 8, 2 * 8);
        let wave = |i: usize, salt: usize| ((i * 13 + salt * 7) % 29) as f32 / 29.0 * 3.0 - 1.5;
        let cache_slots = 60;
        let mut k: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 1)).collect();
        let mut v: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 2)).collect();
        let cache = KvCache { k: k.as_mut_ptr(), v: v.as_mut_ptr(), slots: cache_slots };
        let first: Vec<i64> = (10..50).rev().collect(); // 40 slots, the last 3 new
        let second: Vec<i64> = (50..55).collect();
        let rows = 8;
        let qkv: Vec<f32> = (0..rows * (q_size + 2 * kv_size)).map(|i| wave(i, 3)).collect();
        let mut extended = vec![0f32; rows * q_size];
        let sequences = vec![(3, &first[..]), (5, &second[..])];
        let step = Rows { cos: &[], sin: &[], new_slot: &[0; 8], sequences: Sequences::Extend(sequences.clone()) };
        check_slots(&step, &cache);
        unsafe { attend_extends(SpinPool::global(), 2, &dims, &sequences, &cache, &qkv, &mut extended) };
        // The same rows as a decode step: row t of an extend of T new tokens
        // over L slots reads the first L - T + t + 1.
        let width = first.len();
        let mut table = vec![0i64; rows * width];
        let mut lens = vec![];
        for (count, slots) in &sequences {
            for t in 0..*count {
                let seen = slots.len() - count + t + 1;
                table[lens.len() * width..][..seen].copy_from_slice(&slots[..seen]);
                lens.push(seen as i64);
            }
        }
        let mut decoded = vec![0f32; rows * q_size];
        unsafe { attend(SpinPool::global(), 2, &dims, (&table, width, &lens), &cache, &qkv, &mut decoded) };
        for (i, (a, b)) in extended.iter().zip(&decoded).enumerate() {
            assert!((a - b).abs() < 1e-5, "value {i}: {a} vs {b}");
        }
    }

    #[test]
    #[should_panic(expected = "the extends' new tokens are the rows")]
    fn extends_must_cover_the_rows() {
        let mut kv = [0f32; 8];
        let cache = KvCache { k: kv.as_mut_ptr(), v: kv.as_mut_ptr(), slots: 4 };
        let sequences = Sequences::Extend(vec![(1, &[0, 1][..])]);
        check_slots(&Rows { cos: &[], sin: &[], new_slot: &[1, 2], sequences }, &cache);
    }

    #[test]
    fn silu_times_up_matches_the_formula() {
        // 21 values: two vectors and a remainder, from far negative to far positive.
        let gate: Vec<f32> = (0..21).map(|i| (i as f32 - 10.0) * 11.0).collect();
        let up: Vec<f32> = (0..21).map(|i| 0.5 + i as f32 * 0.25).collect();
        let mut out = vec![0f32; 21];
        silu_times(&gate, &up, &mut out);
        for ((o, g), u) in out.iter().zip(&gate).zip(&up) {
            let want = (*g as f64 / (1.0 + (-*g as f64).exp())) * *u as f64;
            assert!((*o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "silu({g}) * {u}: {o} vs {want}");
        }
    }
}
