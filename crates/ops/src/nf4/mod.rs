//! 4-bit weights (NF4, FP4) with double quantization, bit for bit as bitsandbytes 0.50 makes them
//! on the CPU (`bitsandbytes.functional.quantize_4bit(blocksize=64, quant_type="nf4",
//! compress_statistics=True)` and `dequantize_4bit`): the format of QLoRA's frozen base.
//!
//! **Codes.** The weight is flattened; each block of `blocksize` (64) consecutive elements is
//! divided by its absmax and each quotient takes the code of the nearest of 16 levels (NF4: the
//! quantiles of N(0, 1); FP4: a 1-2-1 float), two codes a byte, the first element in the high
//! nibble. An odd count pads one code of 0.0. bitsandbytes' CPU path (torch ops) multiplies a
//! full block by `1 / max(absmax, 1e-38)` but divides the last, partial block by its absmax
//! clamped to 1e-38, and stores that clamped absmax; a code is the count of midpoints between
//! sorted levels strictly below the quotient (`torch.bucketize`: a tie takes the lower level).
//!
//! **Double quantization.** The f32 absmax values (one a block, 4 bytes each) are stored in 8 bits:
//! their mean (`offset`, torch's f32 sum, `torch_sum`, divided by the count) is subtracted, then
//! blocks of 256 are quantized with bitsandbytes' signed dynamic map (`DYNAMIC_MAP_BITS`), each
//! with an f32 scale (`nested_absmax`). bitsandbytes' C kernel picks those codes through a table
//! of 65536 bins over [-1, 1] (`lut_index`), not the exact nearest level. Stored cost per weight:
//! 4 bits + 8 / 64 + 32 / (64 * 256) = 4.127 bits.
//!
//! **Dequantization.** `level[code] * absmax` in f32, where the nested absmax is
//! `dyn[code] * nested_absmax + offset` in f32; a bf16 weight rounds that product once (to nearest
//! even). Blocks run over the flattened weight, whatever its shape (bitsandbytes' CPU AVX-512
//! path indexes blocks per row when a row is a multiple of 16 but not of the block size; its CUDA
//! kernels and its quantizer use flat blocks, which is what this module does).
//!
//! CUDA: kernels/nf4.cu (`nf4_dequant_*`, through `dequantize`'s launcher in `cuda`).
mod cuda;
mod tables;

pub use cuda::{dequantize_cuda, DeviceQuant4};
pub use tables::{DYNAMIC_MAP_BITS, FP4_BITS, FP4_ORDER, NF4_BITS};

use ferrolm_tensor::{bail, bf16, Error, Result};
use rayon::prelude::*;
use std::sync::OnceLock;

/// The block sizes bitsandbytes accepts for 4-bit weights.
pub const BLOCKSIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];
/// The block size of the nested (absmax) quantization.
pub const NESTED_BLOCKSIZE: usize = 256;
/// The smallest absmax of a partial last block (bitsandbytes' `clamp(min=1e-38)`).
const TINY: f32 = 1e-38;

/// The 4-bit code books.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantType {
    /// NormalFloat4 (QLoRA).
    Nf4,
    /// bitsandbytes' 4-bit float.
    Fp4,
}

impl QuantType {
    /// `"nf4"` or `"fp4"` (bitsandbytes' `quant_type`); anything else is refused by name.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "nf4" => Ok(QuantType::Nf4),
            "fp4" => Ok(QuantType::Fp4),
            _ => bail!("nf4", "quant_type {s:?} is not supported (nf4 or fp4)"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }
    /// The 16 levels, index = code.
    pub fn levels(self) -> [f32; 16] {
        let bits = match self {
            QuantType::Nf4 => &NF4_BITS,
            QuantType::Fp4 => &FP4_BITS,
        };
        bits.map(f32::from_bits)
    }
    /// The codes in ascending order of level.
    fn order(self) -> [u8; 16] {
        match self {
            QuantType::Nf4 => std::array::from_fn(|i| i as u8),
            QuantType::Fp4 => FP4_ORDER,
        }
    }
}

/// The dtype the weight had, which dequantization gives back (bitsandbytes' `dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrigDtype {
    F32,
    BF16,
    F16,
}

impl OrigDtype {
    /// bitsandbytes' names: `"float32"`, `"bfloat16"`, `"float16"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "float32" => Ok(OrigDtype::F32),
            "bfloat16" => Ok(OrigDtype::BF16),
            "float16" => Ok(OrigDtype::F16),
            _ => bail!("nf4", "dtype {s:?} is not one of float32, bfloat16, float16"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            OrigDtype::F32 => "float32",
            OrigDtype::BF16 => "bfloat16",
            OrigDtype::F16 => "float16",
        }
    }
}

/// What to make: the code book, the block size and whether the absmax values are quantized too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub quant_type: QuantType,
    pub blocksize: usize,
    pub double_quant: bool,
}

impl QuantSpec {
    /// QLoRA's: NF4, blocks of 64, double quantization.
    pub const QLORA: QuantSpec = QuantSpec { quant_type: QuantType::Nf4, blocksize: 64, double_quant: true };
}

/// The absmax values of double quantization: 8-bit codes in blocks of 256, an f32 scale a block
/// and the subtracted mean.
#[derive(Clone, Debug, PartialEq)]
pub struct NestedAbsmax {
    /// One code per 4-bit block (`weight.absmax`, uint8).
    pub codes: Vec<u8>,
    /// One scale per `blocksize` codes (`weight.nested_absmax`).
    pub absmax: Vec<f32>,
    /// 256 (`nested_blocksize`).
    pub blocksize: usize,
    /// The mean subtracted before quantizing (`nested_offset`).
    pub offset: f32,
    /// The 256 levels of the codes (`weight.nested_quant_map`; bitsandbytes' dynamic map).
    pub map: Vec<f32>,
}

/// The absmax of each 4-bit block.
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    Plain(Vec<f32>),
    Nested(NestedAbsmax),
}

/// A 4-bit quantized weight (bitsandbytes' `Params4bit` with its `QuantState`).
#[derive(Clone, Debug, PartialEq)]
pub struct Quant4 {
    pub quant_type: QuantType,
    /// The weight's shape (its element count is their product).
    pub shape: Vec<usize>,
    pub dtype: OrigDtype,
    /// Elements per absmax block.
    pub blocksize: usize,
    /// ceil(n / 2) bytes, two codes each, the first element in the high nibble.
    pub packed: Vec<u8>,
    pub absmax: Absmax,
}

/// The dynamic map as f32.
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// torch's f32 sum on the CPU (aten's `cascade_sum` over one contiguous chunk: 8-lane vector
/// accumulators (Vectorized<float> of AVX2, what torch 2.x runs its sum with on x86), four of
/// them interleaved, each a cascade of 4 levels flushed every 16 vectors; the scalar tail, then
/// the lanes, added last). bitsandbytes' offset is `absmax.mean()` = this sum / count. torch
/// splits sums of more than 32768 elements over its threads, so above 32768 blocks (2,097,152
/// weights) its last bit depends on the thread count; this is its one-thread value.
pub fn torch_sum(x: &[f32]) -> f32 {
    const L: usize = 8;
    let n = x.len();
    if n < L {
        return row_sum(n, 0.0f32, |i| x[i]);
    }
    let nv = n / L;
    let lanes = row_sum(nv, [0.0f32; L], |i| std::array::from_fn(|k| x[i * L + k]));
    let mut acc = 0.0f32;
    for &v in &x[nv * L..] {
        acc += v;
    }
    for v in lanes {
        acc += v;
    }
    acc
}

/// An accumulator of `torch_sum`: a scalar or a vector of lanes.
trait Acc: Copy {
    fn add(self, o: Self) -> Self;
}
impl Acc for f32 {
    fn add(self, o: f32) -> f32 {
        self + o
    }
}
impl<const L: usize> Acc for [f32; L] {
    fn add(self, o: Self) -> Self {
        std::array::from_fn(|k| self[k] + o[k])
    }
}

/// aten's `row_sum`: four interleaved `multi_row_sum` accumulators, the tail into the first.
fn row_sum<A: Acc>(size: usize, zero: A, load: impl Fn(usize) -> A) -> A {
    let groups = size / 4;
    let mut p = multi_row_sum(groups, zero, |g, k| load(4 * g + k));
    for i in groups * 4..size {
        p[0] = p[0].add(load(i));
    }
    for k in 1..4 {
        p[0] = p[0].add(p[k]);
    }
    p[0]
}

/// aten's `multi_row_sum` with 4 rows and 4 cascade levels.
fn multi_row_sum<A: Acc>(size: usize, zero: A, load: impl Fn(usize, usize) -> A) -> [A; 4] {
    let ceil_log2 = if size <= 1 { 0 } else { usize::BITS - (size - 1).leading_zeros() } as usize;
    let power = (ceil_log2 / 4).max(4);
    let (step, mask) = (1usize << power, (1usize << power) - 1);
    let mut acc = [[zero; 4]; 4];
    let add_row = |row: &mut [A; 4], i: usize| {
        for (k, a) in row.iter_mut().enumerate() {
            *a = a.add(load(i, k));
        }
    };
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            add_row(&mut acc[0], i);
            i += 1;
        }
        for j in 1..4 {
            let (lo, hi) = acc.split_at_mut(j);
            for (a, b) in hi[0].iter_mut().zip(lo[j - 1].iter_mut()) {
                *a = a.add(*b);
                *b = zero;
            }
            if i & (mask << (j * power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        add_row(&mut acc[0], i);
        i += 1;
    }
    for j in 1..4 {
        let (lo, hi) = acc.split_at_mut(j);
        for (a, b) in lo[0].iter_mut().zip(hi[0].iter()) {
            *a = a.add(*b);
        }
    }
    acc[0]
}

/// The 65536-bin table of bitsandbytes' 8-bit CPU quantizer for the dynamic map: bin i stands
/// for -1 + 2i / 65535 and holds the count of midpoints (0.5 (a + b)) below it.
fn dynamic_lut() -> &'static [u8] {
    static LUT: OnceLock<Vec<u8>> = OnceLock::new();
    LUT.get_or_init(|| {
        let map = dynamic_map();
        let mid: Vec<f32> = map.windows(2).map(|w| 0.5f32 * (w[0] + w[1])).collect();
        let mut code = 0usize;
        (0..65536u32)
            .map(|i| {
                let v = -1.0f32 + (2.0f32 * i as f32) / 65535.0f32;
                while code < mid.len() && mid[code] < v {
                    code += 1;
                }
                code as u8
            })
            .collect()
    })
}

/// The bin of a quotient: bitsandbytes' `norm_to_lut_index`, compiled with FMA contraction.
fn lut_index(v: f32) -> usize {
    let t = (v.clamp(-1.0, 1.0) + 1.0) * 0.5;
    t.mul_add(65535.0, 0.5) as u16 as usize
}

/// bitsandbytes' 8-bit blockwise quantization on the CPU (`quantize_blockwise` with the dynamic
/// map): per block of `bs`, its absmax (f32) and a code per element (0 for a block of zeros).
pub fn quantize_blockwise_dynamic(x: &[f32], bs: usize) -> (Vec<u8>, Vec<f32>) {
    let lut = dynamic_lut();
    let mut codes = vec![0u8; x.len()];
    let absmax: Vec<f32> = codes
        .par_chunks_mut(bs)
        .zip(x.par_chunks(bs))
        .map(|(q, blk)| {
            let am = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if am != 0.0 {
                let inv = 1.0 / am;
                for (q, &v) in q.iter_mut().zip(blk) {
                    *q = lut[lut_index(v * inv)];
                }
            }
            am
        })
        .collect();
    (codes, absmax)
}

impl Quant4 {
    /// Quantizes `values` (the weight flattened, widened to f32 from `dtype`) as bitsandbytes'
    /// `quantize_4bit` does. `name` names the weight in errors: a non-finite value, a shape that
    /// does not hold the values, a block size bitsandbytes does not take.
    pub fn quantize(name: &str, values: &[f32], shape: &[usize], dtype: OrigDtype, spec: QuantSpec) -> Result<Quant4> {
        let n = values.len();
        if shape.iter().product::<usize>() != n {
            bail!("nf4", "{name}: shape {shape:?} does not hold its {n} values");
        }
        if !BLOCKSIZES.contains(&spec.blocksize) {
            bail!("nf4", "{name}: blocksize {} is not one of {BLOCKSIZES:?}", spec.blocksize);
        }
        if n == 0 {
            bail!("nf4", "{name}: an empty weight (shape {shape:?}) has no blocks to quantize");
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!("nf4", "{name}: element {i} is {}: only finite weights quantize", values[i]);
        }
        let bs = spec.blocksize;
        let (levels, order) = (spec.quant_type.levels(), spec.quant_type.order());
        let sorted: [f32; 16] = order.map(|c| levels[c as usize]);
        let mid: [f32; 15] = std::array::from_fn(|i| (sorted[i] + sorted[i + 1]) / 2.0);
        let code = |s: f32| order[mid.iter().take_while(|&&m| m < s).count()];
        let full = n / bs * bs;
        // Per block: its absmax as stored, and its codes (one per byte for now).
        let mut codes = vec![0u8; n + n % 2];
        let mut absmax: Vec<f32> = codes[..full]
            .par_chunks_mut(bs)
            .zip(values[..full].par_chunks(bs))
            .map(|(q, blk)| {
                let am = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let inv = 1.0 / am.max(TINY);
                for (q, &v) in q.iter_mut().zip(blk) {
                    *q = code((v * inv).clamp(-1.0, 1.0));
                }
                am
            })
            .collect();
        if full < n {
            let am = values[full..].iter().fold(0.0f32, |m, v| m.max(v.abs())).max(TINY);
            for (q, &v) in codes[full..n].iter_mut().zip(&values[full..]) {
                *q = code((v / am).clamp(-1.0, 1.0));
            }
            absmax.push(am);
        }
        if n % 2 == 1 {
            codes[n] = code(0.0);
        }
        let packed = codes.chunks_exact(2).map(|p| (p[0] << 4) | p[1]).collect();
        let absmax = if spec.double_quant { Absmax::Nested(nest(&absmax)) } else { Absmax::Plain(absmax) };
        Ok(Quant4 { quant_type: spec.quant_type, shape: shape.to_vec(), dtype, blocksize: bs, packed, absmax })
    }

    /// The element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The number of 4-bit blocks (absmax values).
    pub fn blocks(&self) -> usize {
        self.numel().div_ceil(self.blocksize)
    }

    /// Bytes stored: the codes, the absmax values (8-bit codes, f32 scales and the offset when
    /// nested), not the two code books.
    pub fn stored_bytes(&self) -> usize {
        self.packed.len()
            + match &self.absmax {
                Absmax::Plain(a) => 4 * a.len(),
                Absmax::Nested(q) => q.codes.len() + 4 * q.absmax.len() + 4,
            }
    }

    /// Checks that every part has the length the shape implies; errors name the tensor
    /// (`<name>.absmax`, `<name>.nested_absmax`, ...) as a bitsandbytes checkpoint stores it.
    pub fn check(&self, name: &str) -> Result<()> {
        if !BLOCKSIZES.contains(&self.blocksize) {
            bail!("nf4", "{name}: blocksize {} is not one of {BLOCKSIZES:?}", self.blocksize);
        }
        if self.shape.iter().try_fold(1usize, |p, &d| p.checked_mul(d)).is_none() {
            bail!("nf4", "{name}: shape {:?} has more elements than memory can hold", self.shape);
        }
        let (n, blocks) = (self.numel(), self.blocks());
        if self.packed.len() != n.div_ceil(2) {
            bail!("nf4", "{name}: {} packed bytes for shape {:?} ({n} values need {})", self.packed.len(), self.shape, n.div_ceil(2));
        }
        let absmax_len = match &self.absmax {
            Absmax::Plain(a) => a.len(),
            Absmax::Nested(q) => q.codes.len(),
        };
        if absmax_len != blocks {
            bail!(
                "nf4",
                "{name}.absmax has {absmax_len} values; shape {:?} in blocks of {} has {blocks} blocks",
                self.shape,
                self.blocksize
            );
        }
        if let Absmax::Nested(q) = &self.absmax {
            if q.blocksize == 0 {
                bail!("nf4", "{name}: nested_blocksize is 0");
            }
            let want = blocks.div_ceil(q.blocksize);
            if q.absmax.len() != want {
                bail!(
                    "nf4",
                    "{name}.nested_absmax has {} values; {blocks} absmax codes in blocks of {} need {want}",
                    q.absmax.len(),
                    q.blocksize
                );
            }
            if q.map.len() != 256 {
                bail!("nf4", "{name}.nested_quant_map has {} values, not 256", q.map.len());
            }
        }
        Ok(())
    }

    /// The f32 absmax of every block (the nested ones dequantized: `map[code] * scale + offset`).
    pub fn absmax_f32(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::Plain(a) => a.clone(),
            Absmax::Nested(q) => {
                q.codes.iter().enumerate().map(|(i, &c)| q.map[c as usize] * q.absmax[i / q.blocksize] + q.offset).collect()
            }
        }
    }

    /// The values as f32 products `level[code] * absmax` (what bitsandbytes computes before
    /// rounding to the weight's dtype; a f32 weight's dequantization).
    pub fn dequantize_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.numel()];
        self.dequantize_into(&mut out, |v| v);
        out
    }

    /// The values rounded once to bf16 (a bf16 weight's dequantization).
    pub fn dequantize_bf16(&self) -> Vec<bf16> {
        let mut out = vec![bf16::ZERO; self.numel()];
        self.dequantize_into(&mut out, bf16::from_f32);
        out
    }

    /// Dequantizes into `out` (numel elements), each f32 product through `round`.
    pub fn dequantize_into<T: Send>(&self, out: &mut [T], round: impl Fn(f32) -> T + Sync) {
        assert_eq!(out.len(), self.numel(), "dequantize_into: output length");
        let (levels, absmax, bs) = (self.quant_type.levels(), self.absmax_f32(), self.blocksize);
        out.par_chunks_mut(bs).enumerate().for_each(|(b, o)| {
            let scale = absmax[b];
            for (j, o) in o.iter_mut().enumerate() {
                let i = b * bs + j;
                let c = (self.packed[i / 2] >> (4 * (1 - i % 2))) & 0xF;
                *o = round(levels[c as usize] * scale);
            }
        });
    }

    /// Checks the stored 16 levels (`<name>.quant_map`) against this quant type's; bitsandbytes
    /// dequantizes with its own table, so a different one is a corrupt or foreign checkpoint.
    pub fn check_quant_map(&self, name: &str, map: &[f32]) -> Result<()> {
        let levels = self.quant_type.levels();
        if map.len() != 16 || map.iter().zip(&levels).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(Error::new(
                "nf4",
                format!("{name}.quant_map is not the {} code book ({} values {map:?})", self.quant_type.name(), map.len()),
            ));
        }
        Ok(())
    }
}

/// Double quantization of the f32 absmax values: offset = their mean, then 8-bit dynamic codes
/// of (absmax - offset) in blocks of 256.
fn nest(absmax: &[f32]) -> NestedAbsmax {
    let offset = torch_sum(absmax) / absmax.len() as f32;
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let (codes, scales) = quantize_blockwise_dynamic(&centred, NESTED_BLOCKSIZE);
    NestedAbsmax { codes, absmax: scales, blocksize: NESTED_BLOCKSIZE, offset, map: dynamic_map().to_vec() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_quant_types_are_refused_by_name() {
        let e = QuantType::parse("int4").unwrap_err().to_string();
        assert!(e.contains("quant_type \"int4\" is not supported"), "{e}");
        assert_eq!(QuantType::parse("fp4").unwrap(), QuantType::Fp4);
    }

    #[test]
    fn codes_pack_high_nibble_first_and_round_trip_levels() {
        // Values that are exactly the NF4 levels times 2 quantize to their own codes.
        let lv = QuantType::Nf4.levels();
        let vals: Vec<f32> = (0..64).map(|i| 2.0 * lv[i % 16]).collect();
        let spec = QuantSpec { double_quant: false, ..QuantSpec::QLORA };
        let q = Quant4::quantize("w", &vals, &[64], OrigDtype::F32, spec).unwrap();
        assert_eq!(q.packed[0], 0x01);
        assert_eq!(q.packed[7], 0xEF);
        assert_eq!(q.dequantize_f32(), vals);
    }

    #[test]
    fn torch_sum_cascades_like_aten() {
        // 0.1 summed 1000 times: a sequential f32 sum gives 99.99905 and
        // the exact (f64) sum rounds to 100.0; torch on x86 gives 100.00001.
        let x = vec![0.1f32; 1000];
        assert_eq!(torch_sum(&x), 100.000_01);
        assert_eq!(torch_sum(&x[..5]), 0.5);
    }
}
