//! One decoder layer of a decode or prefill step on the CPU, for
//! Llama-style layers whose projections are Q4_1 blocks (the `8da4w`
//! layout): the residual add and RMSNorm, q/k/v, rotary, the KV write,
//! attention over each sequence's slots (decode_attention for decode rows,
//! extend_attention for a prefill's new tokens), o_proj, the second norm,
//! gate/up, SiLU and down, in one call.
//!
//! Why not torch: at batch 1 the projections of a small model take about
//! half of a step; the rest was per-op cost around them (torch.compile's
//! frame and guard checks per layer call, the custom ops' dispatch, SDPA's
//! set-up for one query), which a plain loop here does not have.

use crate::kernels::block_gemm::{self, Q4_1Tiles};
use crate::kernels::decode_attention::{self, Heads};
use crate::kernels::extend_attention::{self, Extend};
use crate::kernels::simd::{self, dot, BLOCK};
use crate::kernels::spin_pool::SpinPool;

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

impl Dims {
    /// Whether the sizes make a layer: query heads in whole groups over
    /// the KV heads, heads of an even size (rotate-half), and the
    /// projections' inputs in whole blocks.
    pub fn check(&self) -> Result<(), String> {
        let (heads, kv_heads, head_dim) = (self.heads, self.kv_heads, self.head_dim);
        if kv_heads == 0 || heads % kv_heads != 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(format!("{heads} query heads over {kv_heads} KV heads of {head_dim} values (an even count)"));
        }
        let (hidden, q_size, inter) = (self.hidden, self.q_size(), self.intermediate);
        if hidden % BLOCK != 0 || q_size % BLOCK != 0 || inter % BLOCK != 0 {
            return Err(format!(
                "hidden {hidden}, heads * head_dim {q_size} and intermediate {inter} are whole blocks of {BLOCK}"
            ));
        }
        Ok(())
    }

    fn heads(&self) -> Heads {
        Heads { heads: self.heads, kv_heads: self.kv_heads, head_dim: self.head_dim, scale: self.scale }
    }

    fn q_size(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_size(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn qkv_width(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }
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
    /// A step of prefill chunks or speculative verify rows, decode rows
    /// among them or not: each sequence's new tokens, the next rows in
    /// order. A sequence of one new token after a cached past is a decode
    /// row and attends as one (decode_attention), as in a decode step.
    Extend(Vec<NewTokens<'a>>),
}

/// One sequence's new tokens in an extend step.
#[derive(Clone, Copy)]
pub struct NewTokens<'a> {
    /// How many: the step's next rows.
    pub count: usize,
    /// The sequence's slots, the new tokens' last. Each new token sees the
    /// slots up to its own.
    pub slots: &'a [i64],
    /// Whether each new token attends as a decode row (decode_attention
    /// over the slots up to its own) instead of in extend_attention's
    /// tiles: a speculative verify row's token and drafts then get what a
    /// decode step gives them, to the bit, so greedy speculation keeps
    /// plain decoding's tokens where the activations' 8-bit rounding would
    /// turn a last-bit difference into another code.
    pub as_decode_rows: bool,
}

/// One layer's KV cache, k and v [cache slots, kv_heads * head_dim] each.
pub struct KvCache<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// Runs the layer on `x` (the previous layer's MLP output, or the
/// embeddings with a zero residual), [rows, hidden]. Afterwards `x` holds
/// this layer's MLP output and `residual` the stream before it, as
/// `DecoderLayer.after_attention` returns them. Nothing is written unless
/// every size fits and every slot lies inside the cache (`check`): else
/// the misfit.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    layer: &Layer,
    rows: &Rows,
    cache: KvCache,
    x: &mut [f32],
    residual: &mut [f32],
) -> Result<(), String> {
    check(dims, layer, rows, &cache, x.len(), residual.len())?;
    let (hidden, head_dim) = (dims.hidden, dims.head_dim);
    let n = rows.new_slot.len();
    let (q_size, kv_size, qkv_width) = (dims.q_size(), dims.kv_size(), dims.qkv_width());

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
        cache.k[at..at + kv_size].copy_from_slice(&row[q_size..q_size + kv_size]);
        cache.v[at..at + kv_size].copy_from_slice(&row[q_size + kv_size..]);
    }

    let mut attended = vec![0f32; n * q_size];
    let (k, v) = (&*cache.k, &*cache.v);
    match &rows.sequences {
        Sequences::Decode { slots, width, lens } => {
            // SAFETY: `check` found every row's slots inside the cache.
            unsafe {
                decode_attention::attend(
                    pool,
                    threads,
                    &dims.heads(),
                    (slots, *width, lens),
                    (k, v),
                    &qkv,
                    &mut attended,
                )
            }
        }
        Sequences::Extend(sequences) => attend_extends(pool, threads, dims, sequences, (k, v), &qkv, &mut attended)?,
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
    Ok(())
}

/// Whether the layer's weights, the step's rows, the cache and x and the
/// residual (of `x_len` and `residual_len` values) fit `dims` and each
/// other; the slots as `check_slots` says.
fn check(
    dims: &Dims,
    layer: &Layer,
    rows: &Rows,
    cache: &KvCache,
    x_len: usize,
    residual_len: usize,
) -> Result<(), String> {
    dims.check()?;
    let (hidden, n) = (dims.hidden, rows.new_slot.len());
    if x_len != n * hidden || residual_len != n * hidden {
        return Err(format!("x and the residual are [{n} rows, {hidden}]"));
    }
    let (q_size, inter) = (dims.q_size(), dims.intermediate);
    let projections = [
        ("qkv", &layer.qkv, (dims.qkv_width(), hidden)),
        ("o", &layer.o, (hidden, q_size)),
        ("gate_up", &layer.gate_up, (2 * inter, hidden)),
        ("down", &layer.down, (hidden, inter)),
    ];
    for (name, tiles, shape) in projections {
        if tiles.shape() != shape {
            return Err(format!("the {name} projection is {:?}, not {shape:?}", tiles.shape()));
        }
    }
    if layer.input_norm.len() != hidden || layer.post_norm.len() != hidden {
        return Err(format!("the norms' weights hold {hidden} values"));
    }
    if layer.qkv_bias.is_some_and(|bias| bias.len() != dims.qkv_width()) {
        return Err(format!("the q/k/v bias holds {} values", dims.qkv_width()));
    }
    let half = dims.head_dim / 2;
    if rows.cos.len() != n * half || rows.sin.len() != n * half {
        return Err(format!("cos and sin are [{n} rows, {half}]"));
    }
    let kv_size = dims.kv_size();
    if cache.k.len() != cache.v.len() || cache.k.len() % kv_size != 0 {
        return Err(format!("the k and v caches are alike, [cache slots, {kv_size}]"));
    }
    check_slots(rows, cache.k.len() / kv_size)
}

/// Whether every slot the step writes or reads lies inside a cache of
/// `cache_slots`, each decode row reads 1..=width of its slots and the
/// extends' new tokens are the rows, each within its sequence: the
/// attention's unchecked reads rely on it.
fn check_slots(rows: &Rows, cache_slots: usize) -> Result<(), String> {
    let n = rows.new_slot.len();
    let inside = |s: i64| s >= 0 && (s as usize) < cache_slots;
    let outside = || Err(format!("a KV slot outside the cache of {cache_slots}"));
    if !rows.new_slot.iter().all(|&s| inside(s)) {
        return outside();
    }
    match &rows.sequences {
        Sequences::Decode { slots, width, lens } => {
            if lens.len() != n || slots.len() != n * width {
                return Err(format!("one list of {width} slots and one length per row ({n})"));
            }
            for (r, &len) in lens.iter().enumerate() {
                if len < 1 || len as usize > *width {
                    return Err(format!("a row attends over 1..={width} slots, not {len}"));
                }
                if !slots[r * width..][..len as usize].iter().all(|&s| inside(s)) {
                    return outside();
                }
            }
        }
        Sequences::Extend(sequences) => {
            if sequences.iter().map(|tokens| tokens.count).sum::<usize>() != n {
                return Err(format!("the extends' new tokens are the rows ({n})"));
            }
            for NewTokens { count, slots, .. } in sequences {
                if *count < 1 || *count > slots.len() {
                    return Err(format!("an extend has 1..={} new tokens, not {count}", slots.len()));
                }
                if !slots.iter().all(|&s| inside(s)) {
                    return outside();
                }
            }
        }
    }
    Ok(())
}

/// Each extend's attention (extend_attention) over the cache, its rows'
/// queries copied out of `qkv` together; the decode rows among them (one
/// new token after a cached past, and every token of an extend marked
/// `as_decode_rows`) in one decode_attention call, so that such a row's
/// output is what a decode step gives it.
fn attend_extends(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    sequences: &[NewTokens],
    (k, v): (&[f32], &[f32]),
    qkv: &[f32],
    out: &mut [f32],
) -> Result<(), String> {
    let (q_size, qkv_width) = (dims.q_size(), dims.qkv_width());
    let mut q = Vec::new();
    let mut decode_rows = Vec::new(); // (row, slots)
    let mut first = 0;
    for &NewTokens { count, slots, as_decode_rows } in sequences {
        if as_decode_rows || (count == 1 && slots.len() > 1) {
            let past = slots.len() - count;
            decode_rows.extend((0..count).map(|t| (first + t, &slots[..past + t + 1])));
            first += count;
            continue;
        }
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
        extend_attention::attend(pool, threads, &extend, &mut out[first * q_size..(first + count) * q_size])?;
        first += count;
    }
    if !decode_rows.is_empty() {
        attend_decode_rows(pool, threads, dims, &decode_rows, (k, v), qkv, out);
    }
    Ok(())
}

/// The decode rows of an extend step, `rows` (row, slots), attended as a
/// decode step's rows: their q/k/v rows and slots gathered, the outputs
/// put back in their rows of `out`. Their slots lie inside the cache
/// (`check_slots`).
fn attend_decode_rows(
    pool: &SpinPool,
    threads: usize,
    dims: &Dims,
    rows: &[(usize, &[i64])],
    (k, v): (&[f32], &[f32]),
    qkv: &[f32],
    out: &mut [f32],
) {
    let (q_size, qkv_width) = (dims.q_size(), dims.qkv_width());
    let width = rows.iter().map(|(_, slots)| slots.len()).max().unwrap_or(0);
    let mut table = vec![0i64; rows.len() * width];
    let (mut lens, mut gathered) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len() * qkv_width));
    for (i, &(row, slots)) in rows.iter().enumerate() {
        table[i * width..][..slots.len()].copy_from_slice(slots);
        lens.push(slots.len() as i64);
        gathered.extend_from_slice(&qkv[row * qkv_width..][..qkv_width]);
    }
    let mut attended = vec![0f32; rows.len() * q_size];
    // SAFETY: each row attends over its own slots, inside the cache (check_slots).
    unsafe {
        decode_attention::attend(pool, threads, &dims.heads(), (&table, width, &lens), (k, v), &gathered, &mut attended)
    };
    for (&(row, _), heads) in rows.iter().zip(attended.chunks_exact(q_size)) {
        out[row * q_size..][..q_size].copy_from_slice(heads);
    }
}

/// out = SiLU(gate) * up.
fn silu_times(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd::avx2() {
        // SAFETY: the CPU has AVX2 and FMA; avx2::silu_times stays within the shortest slice.
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::kernels::simd::avx2::exp;
    use std::arch::x86_64::*;

    /// `silu_times` eight values at a time; returns how many it wrote (the
    /// caller does the rest). e^-g is capped at e^88 (f32's range), where
    /// g / (1 + e^-g) is already 0 to within 1e-36 of g.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::decode_attention::attend;

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
    fn a_slot_past_the_cache_is_refused_before_any_write() {
        let sequences = Sequences::Decode { slots: &[0, 2], width: 2, lens: &[2] };
        let rows = Rows { cos: &[], sin: &[], new_slot: &[1], sequences };
        assert!(check_slots(&rows, 2).unwrap_err().contains("outside the cache"));
    }

    /// Two extends in one step (3 new tokens after 37 cached, a verify row
    /// marked `as_decode_rows`, and a fresh prompt of 5): each new token
    /// attends as a decode row over its sequence's slots up to its own, the
    /// verify row's tokens to the bit, the prompt's (extend_attention)
    /// within float rounding.
    #[test]
    fn extend_rows_attend_as_decode_rows_over_their_prefix() {
        let dims = Dims { hidden: 0, heads: 6, kv_heads: 2, head_dim: 8, intermediate: 0, eps: 0.0, scale: 0.35 };
        let (q_size, kv_size) = (6 * 8, 2 * 8);
        let wave = |i: usize, salt: usize| ((i * 13 + salt * 7) % 29) as f32 / 29.0 * 3.0 - 1.5;
        let cache_slots = 60;
        let k: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 1)).collect();
        let v: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 2)).collect();
        let first: Vec<i64> = (10..50).rev().collect(); // 40 slots, the last 3 new
        let second: Vec<i64> = (50..55).collect();
        let rows = 8;
        let qkv: Vec<f32> = (0..rows * (q_size + 2 * kv_size)).map(|i| wave(i, 3)).collect();
        let mut extended = vec![0f32; rows * q_size];
        let sequences = vec![
            NewTokens { count: 3, slots: &first, as_decode_rows: true },
            NewTokens { count: 5, slots: &second, as_decode_rows: false },
        ];
        let step = Rows { cos: &[], sin: &[], new_slot: &[0; 8], sequences: Sequences::Extend(sequences.clone()) };
        check_slots(&step, cache_slots).unwrap();
        attend_extends(SpinPool::global(), 2, &dims, &sequences, (&k, &v), &qkv, &mut extended).unwrap();
        // The same rows as a decode step: row t of an extend of T new tokens
        // over L slots reads the first L - T + t + 1.
        let width = first.len();
        let mut table = vec![0i64; rows * width];
        let mut lens = vec![];
        for &NewTokens { count, slots, .. } in &sequences {
            for t in 0..count {
                let seen = slots.len() - count + t + 1;
                table[lens.len() * width..][..seen].copy_from_slice(&slots[..seen]);
                lens.push(seen as i64);
            }
        }
        let mut decoded = vec![0f32; rows * q_size];
        // SAFETY: the table's slots are the extends', inside the cache (checked above).
        unsafe { attend(SpinPool::global(), 2, &dims.heads(), (&table, width, &lens), (&k, &v), &qkv, &mut decoded) };
        assert_eq!(&extended[..3 * q_size], &decoded[..3 * q_size]);
        for (i, (a, b)) in extended.iter().zip(&decoded).enumerate().skip(3 * q_size) {
            assert!((a - b).abs() < 1e-5, "value {i}: {a} vs {b}");
        }
    }

    /// A decode row between two extends (a verify step's batch: drafted
    /// and undrafted sequences) attends as a decode step's row does, to
    /// the bit; the extends' rows as they do alone.
    #[test]
    fn a_decode_row_among_extends_attends_as_in_a_decode_step() {
        let dims = Dims { hidden: 0, heads: 6, kv_heads: 2, head_dim: 8, intermediate: 0, eps: 0.0, scale: 0.35 };
        let (q_size, kv_size) = (6 * 8, 2 * 8);
        let wave = |i: usize, salt: usize| ((i * 17 + salt * 5) % 31) as f32 / 31.0 * 3.0 - 1.5;
        let cache_slots = 80;
        let k: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 1)).collect();
        let v: Vec<f32> = (0..cache_slots * kv_size).map(|i| wave(i, 2)).collect();
        let (first, decoded, last): (Vec<i64>, Vec<i64>, Vec<i64>) =
            ((0..20).collect(), (20..57).collect(), (57..66).collect());
        let rows = 4 + 1 + 3;
        let qkv: Vec<f32> = (0..rows * (q_size + 2 * kv_size)).map(|i| wave(i, 3)).collect();
        let sequences = [(4, &first[..]), (1, &decoded[..]), (3, &last[..])].map(|(count, slots)| NewTokens {
            count,
            slots,
            as_decode_rows: false,
        });
        let mut mixed = vec![0f32; rows * q_size];
        attend_extends(SpinPool::global(), 2, &dims, &sequences, (&k, &v), &qkv, &mut mixed).unwrap();
        let mut alone = vec![0f32; q_size];
        let row = &qkv[4 * (q_size + 2 * kv_size)..][..q_size + 2 * kv_size];
        // SAFETY: the row's slots are inside the cache.
        unsafe {
            attend(SpinPool::global(), 2, &dims.heads(), (&decoded, decoded.len(), &[37]), (&k, &v), row, &mut alone)
        };
        assert_eq!(&mixed[4 * q_size..5 * q_size], &alone[..]);
        let mut extends = vec![0f32; rows * q_size];
        for (range, NewTokens { count, slots, .. }) in [(0..4, sequences[0]), (5..8, sequences[2])] {
            let at = range.start * (q_size + 2 * kv_size);
            attend_extends(
                SpinPool::global(),
                2,
                &dims,
                &[NewTokens { count, slots, as_decode_rows: false }],
                (&k, &v),
                &qkv[at..],
                &mut extends[range.start * q_size..range.end * q_size],
            )
            .unwrap();
        }
        assert_eq!(&mixed[..4 * q_size], &extends[..4 * q_size]);
        assert_eq!(&mixed[5 * q_size..], &extends[5 * q_size..]);
    }

    #[test]
    fn extends_must_cover_the_rows() {
        let sequences = Sequences::Extend(vec![NewTokens { count: 1, slots: &[0, 1], as_decode_rows: false }]);
        let misfit = check_slots(&Rows { cos: &[], sin: &[], new_slot: &[1, 2], sequences }, 4).unwrap_err();
        assert!(misfit.contains("the extends' new tokens are the rows"), "{misfit}");
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
