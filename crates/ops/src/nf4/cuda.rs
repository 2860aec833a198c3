//! A 4-bit weight on a CUDA device and its dequantization (kernels/nf4.cu, `nf4_dequant_*`).
//! The codes and the 8-bit absmax codes travel as i32 words (the tensor crate has no byte dtype;
//! the kernel reads them as bytes), padded to 16 bytes so the kernel's 16-byte loads stay inside.
use super::{Absmax, Quant4};
use crate::dispatch::{on, On};
use ferrolm_tensor::{bail, DType, Device, Result, Tensor};

/// A `Quant4` uploaded to a device: what the dequantize kernel reads.
pub struct DeviceQuant4 {
    /// The packed codes as little-endian i32 words (ceil(n / 2) bytes, zero-padded).
    pub packed: Tensor,
    /// The nested absmax codes as i32 words (nested), else one i32 word of padding.
    pub codes: Tensor,
    /// The nested scales (nested), else the f32 absmax of every block.
    pub absmax: Tensor,
    /// The 16 levels, then the 256 of the nested map (zeros when not nested).
    pub tables: Tensor,
    pub offset: f32,
    pub shape: Vec<usize>,
    pub blocksize: usize,
    pub nested_blocksize: usize,
    pub nested: bool,
}

/// `bytes` as little-endian i32 words, zero-padded to a multiple of 16 bytes (at least one word).
fn words(bytes: &[u8]) -> Vec<i32> {
    let len = bytes.len().div_ceil(16).max(1) * 4;
    let mut w = vec![0i32; len];
    for (i, c) in bytes.chunks(4).enumerate() {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        w[i] = i32::from_le_bytes(b);
    }
    w
}

impl DeviceQuant4 {
    /// Uploads `q` (checked first: see `Quant4::check`) to `device`.
    pub fn upload(q: &Quant4, name: &str, device: Device) -> Result<DeviceQuant4> {
        q.check(name)?;
        let w = |b: &[u8]| {
            let v = words(b);
            let n = v.len();
            Tensor::from_vec(v, [n], device)
        };
        let mut tables = q.quant_type.levels().to_vec();
        let (codes, absmax, offset, nbs, nested) = match &q.absmax {
            Absmax::Plain(a) => (w(&[])?, a.clone(), 0.0, 1, false),
            Absmax::Nested(n) => {
                tables.extend_from_slice(&n.map);
                (w(&n.codes)?, n.absmax.clone(), n.offset, n.blocksize, true)
            }
        };
        tables.resize(16 + 256, 0.0);
        let na = absmax.len().max(1);
        let absmax = if absmax.is_empty() { vec![0.0] } else { absmax };
        Ok(DeviceQuant4 {
            packed: w(&q.packed)?,
            codes,
            absmax: Tensor::from_vec(absmax, [na], device)?,
            tables: Tensor::from_vec(tables, [16 + 256], device)?,
            offset,
            shape: q.shape.clone(),
            blocksize: q.blocksize,
            nested_blocksize: nbs,
            nested,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The weight dequantized on its device, as `dtype` (f32 or bf16), shaped as the weight: one
/// launch of `nf4_dequant_*`.
pub fn dequantize_cuda(q: &DeviceQuant4, dtype: DType) -> Result<Tensor> {
    const OP: &str = "nf4_dequantize";
    let n = q.numel();
    let ts = [&q.packed, &q.codes, &q.absmax, &q.tables];
    let out = Tensor::with_storages(&ts, |s| {
        let be = match on(OP, s[0].0)? {
            On::Cuda(be) => be,
            On::Cpu => bail!(OP, "the weight is on the host: dequantize it with Quant4::dequantize_f32"),
        };
        launch(&be, s, q, n, dtype)
    })?;
    Tensor::new(out, q.shape.clone())
}

fn launch(
    be: &ferrolm_cuda::CudaBackend,
    s: &[ferrolm_tensor::backend::View],
    q: &DeviceQuant4,
    n: usize,
    dtype: DType,
) -> Result<ferrolm_tensor::Storage> {
    use crate::dispatch::dev_ptr;
    use ferrolm_cuda::kernels;
    const OP: &str = "nf4_dequantize";
    let out = be.alloc_storage(n, dtype)?;
    let (pp, pc, pa, pt) = (dev_ptr(OP, s[0])?, dev_ptr(OP, s[1])?, dev_ptr(OP, s[2])?, dev_ptr(OP, s[3])?);
    let vec = pp.addr().is_multiple_of(16) && out.ptr().addr().is_multiple_of(16);
    // A thread per group of 32 elements (16 bytes of codes) on the vector path, else per element.
    let items = if vec { n.div_ceil(32) } else { n };
    let cfg = be.plan_elementwise(items, 1, false).elems(n);
    let (bs, nbs) = (q.blocksize as i32, q.nested_blocksize as i32);
    // SAFETY: packed holds ceil(n / 2) bytes padded to 16, codes one byte per block (nested),
    // absmax the scales the check counted, tables 272 f32 (all checked by `upload`); out holds n
    // elements of `dtype`; `vec` only where packed and out are 16-byte aligned.
    unsafe { kernels::nf4_dequant(be, dtype, cfg, pp, pc, pa, pt, q.offset, out.ptr(), n as i64, bs, nbs, q.nested as i32, vec as i32)? };
    Ok(out.into())
}
