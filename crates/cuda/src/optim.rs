//! The fused optimizer launchers, which have no op of their own: the multi-tensor AdamW step
//! (`adamw_multi*`, `adamw_parts`) and the global gradient norm (`grad_norm`,
//! `grad_norm_weighted`, `read_f64`), over kernels/optim.cu. The kernels take their per-tensor
//! tables as `repr(C)` structs uploaded as I32 words (`KernelPod`).
use crate::consts;
use crate::device::CudaBackend;
use crate::kernels;
use crate::launch::{check_kernel_dtype, DevPtr, Launch};
use crate::storage::CudaStorage;
use ferrolm_tensor::{bail, DType, Result};

const OPT_CHUNK: usize = consts::OPT_CHUNK;

#[repr(C)]
#[derive(Clone, Copy)]
struct BlockMap {
    tensor: i32,
    pad: i32,
    start: i64,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamT {
    master: u64,
    grad: u64,
    m: u64,
    v: u64,
    param_bf16: u64,
    n: i64,
    grad_bf16: i32,
    weight_decay: f32,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct GradT {
    grad: u64,
    weight: u64,
    n: i64,
    grad_bf16: i32,
    pad: i32,
}

/// One gradient of `grad_norm_weighted`: `len` elements from element `offset` of `grad`, and
/// optionally their f32 weights from element `.1` of `.0`.
pub struct NormPart<'a> {
    pub grad: &'a CudaStorage,
    pub offset: usize,
    pub len: usize,
    pub weight: Option<(&'a CudaStorage, usize)>,
}

/// One range of a multi-tensor AdamW step: the device address and dtype of its first element in
/// each buffer, and its length.
pub(crate) struct AdamPart {
    pub(crate) master: (u64, DType),
    pub(crate) grad: (u64, DType),
    pub(crate) m: (u64, DType),
    pub(crate) v: (u64, DType),
    pub(crate) param_bf16: Option<(u64, DType)>,
    pub(crate) n: usize,
    pub(crate) weight_decay: f32,
}

/// One tensor of a multi-tensor AdamW step (all contiguous, same length).
pub struct AdamWTensor<'a> {
    pub master: &'a CudaStorage,
    pub grad: &'a CudaStorage,
    pub m: &'a CudaStorage,
    pub v: &'a CudaStorage,
    pub param_bf16: Option<&'a CudaStorage>,
    pub weight_decay: f32,
}
#[derive(Clone, Copy, Debug)]
pub struct AdamWParams {
    pub lr: f32,
    /// f64, as the host optimizers hold them: the bias corrections 1 - beta^t are computed from
    /// these exact values (an f32-rounded 0.95 shifts them by 2e-7 relative).
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f32,
    /// 1-based step count (for bias correction).
    pub step: u32,
}

/// `repr(C)` structs passed to kernels as raw words: only fields of plain number types and no
/// padding, so every byte of a value is initialised (checked at compile time below), and a size
/// that is a multiple of 4.
trait KernelPod: Copy {}
impl KernelPod for AdamT {}
impl KernelPod for GradT {}
impl KernelPod for BlockMap {}
const _: () = assert!(std::mem::size_of::<AdamT>() == 5 * 8 + 8 + 4 + 4);
const _: () = assert!(std::mem::size_of::<GradT>() == 8 + 8 + 8 + 4 + 4);
const _: () = assert!(std::mem::size_of::<BlockMap>() == 4 + 4 + 8);

/// The bytes of `v` as native-endian i32 words, the I32 storage the kernels read them from.
fn as_words<T: KernelPod>(v: &[T]) -> Vec<i32> {
    // SAFETY: T is one of the KernelPod structs: no padding (sizes asserted above equal the sum
    // of their fields), so all size_of_val(v) bytes are initialised; u8 has alignment 1, and the
    // slice borrows v only within this function.
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
    bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl CudaBackend {
    fn block_map(lens: &[usize]) -> Vec<BlockMap> {
        let mut map = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let mut s = 0;
            while s < n {
                map.push(BlockMap { tensor: i as i32, pad: 0, start: s as i64 });
                s += OPT_CHUNK;
            }
        }
        map
    }

    /// Fused AdamW over many tensors in one launch. `grad_scale` (device f32 scalar: element 0
    /// of the storage) multiplies every gradient; no host synchronisation. For the clip factor
    /// from `grad_norm` (element 1 of its output) use `adamw_multi_scaled(.., Some((&norm, 1)))`.
    pub fn adamw_multi(&self, tensors: &[AdamWTensor], p: AdamWParams, grad_scale: Option<&CudaStorage>) -> Result<()> {
        self.adamw_multi_scaled(tensors, p, grad_scale.map(|g| (g, 0)))
    }

    /// `adamw_multi` with the gradient scale read from element `i` of an f32 device storage,
    /// e.g. `Some((&grad_norm_out, 1))` applies the clip factor without a host round trip.
    pub fn adamw_multi_scaled(&self, tensors: &[AdamWTensor], p: AdamWParams, grad_scale: Option<(&CudaStorage, usize)>) -> Result<()> {
        let op = "adamw";
        let mut parts = Vec::with_capacity(tensors.len());
        for t in tensors {
            let n = t.master.len;
            if [t.grad.len, t.m.len, t.v.len].iter().any(|&x| x != n) || t.param_bf16.is_some_and(|x| x.len != n) {
                bail!(op, "tensor lengths differ");
            }
            let at0 = |s: &'_ CudaStorage| (s.ptr_at(0), s.dtype);
            parts.push(AdamPart {
                master: at0(t.master),
                grad: at0(t.grad),
                m: at0(t.m),
                v: at0(t.v),
                param_bf16: t.param_bf16.map(at0),
                n,
                weight_decay: t.weight_decay,
            });
        }
        self.adamw_parts(&parts, p, grad_scale, 1.0)
    }

    /// The launch behind every AdamW entry point: `parts` are (address, dtype) of ranges of `n`
    /// elements that the caller has bounds-checked.
    pub(crate) fn adamw_parts(
        &self,
        parts: &[AdamPart],
        p: AdamWParams,
        grad_scale: Option<(&CudaStorage, usize)>,
        host_scale: f32,
    ) -> Result<()> {
        let op = "adamw";
        if let Some((g, i)) = grad_scale {
            if g.dtype != DType::F32 || i >= g.len {
                bail!(op, "grad_scale must be an f32 storage with an element {i} (got {} of {} elements)", g.dtype, g.len);
            }
        }
        let mut table = Vec::with_capacity(parts.len());
        for t in parts {
            if [t.master.1, t.m.1, t.v.1].iter().any(|&d| d != DType::F32) || t.param_bf16.is_some_and(|x| x.1 != DType::BF16) {
                bail!(op, "master weights and moments must be f32 (and the parameter copy bf16)");
            }
            check_kernel_dtype(op, t.grad.1)?;
            table.push(AdamT {
                master: t.master.0,
                grad: t.grad.0,
                m: t.m.0,
                v: t.v.0,
                param_bf16: t.param_bf16.map_or(0, |x| x.0),
                n: t.n as i64,
                grad_bf16: (t.grad.1 == DType::BF16) as i32,
                weight_decay: t.weight_decay,
            });
        }
        let map = Self::block_map(&table.iter().map(|t| t.n as usize).collect::<Vec<_>>());
        if map.is_empty() {
            return Ok(());
        }
        let dt = self.upload(&as_words(&table), DType::I32)?;
        let dm = self.upload(&as_words(&map), DType::I32)?;
        let bc1 = 1.0 - p.beta1.powi(p.step as i32);
        let bc2 = 1.0 - p.beta2.powi(p.step as i32);
        let (inv_bc1, inv_bc2) = ((1.0 / bc1) as f32, (1.0 / bc2) as f32);
        let scale = grad_scale.map_or(DevPtr::NULL, |(g, i)| g.at(i));
        let n: usize = table.iter().map(|t| t.n as usize).sum();
        let cfg = Launch::new((map.len() as u32, 1, 1), 256).elems(n);
        // SAFETY: dt and dm hold the tensor table and block map the kernel reads (one block per
        // map entry); every table entry addresses n elements of live, length-checked storage.
        unsafe {
            kernels::adamw_multi(
                self,
                cfg,
                dt.ptr(),
                dm.ptr(),
                p.lr,
                p.beta1 as f32,
                p.beta2 as f32,
                p.eps,
                inv_bc1,
                inv_bc2,
                scale,
                host_scale,
            )
        }
        // dt, dm return to the pool here; stream order keeps them valid for the launch.
    }

    /// Global L2 norm of many gradients, deterministic two-stage reduction. Returns a device
    /// f32 pair [norm, clip factor min(1, max_norm / (norm + 1e-6))] (factor 1 if max_norm <= 0).
    pub fn grad_norm(&self, grads: &[&CudaStorage], max_norm: f32) -> Result<CudaStorage> {
        let parts: Vec<NormPart> = grads.iter().map(|&g| NormPart { grad: g, offset: 0, len: g.len, weight: None }).collect();
        Ok(self.grad_norm_weighted(&parts, max_norm)?.0)
    }

    /// The weighted squared norm sum(g^2 w) of many gradients in one pass: each gradient
    /// read once in its own dtype (f32 or bf16) with its optional f32 weights (same length),
    /// per-block partials in f64, then a fixed-order finish. Returns the device pair [norm, clip
    /// factor] of `grad_norm` and an 8-byte device storage holding the f64 sum (read it with
    /// `read_f64`). Two launches, whatever the number of gradients.
    pub fn grad_norm_weighted(&self, parts: &[NormPart], max_norm: f32) -> Result<(CudaStorage, CudaStorage)> {
        let op = "grad_norm";
        let mut table = Vec::new();
        for p in parts {
            check_kernel_dtype(op, p.grad.dtype)?;
            if p.offset.checked_add(p.len).is_none_or(|e| e > p.grad.len) {
                bail!(op, "{} elements at {} are outside a gradient of {}", p.len, p.offset, p.grad.len);
            }
            if let Some((w, at)) = p.weight {
                if w.dtype != DType::F32 || at.checked_add(p.len).is_none_or(|e| e > w.len) {
                    bail!(op, "a norm weight must be f32 covering its gradient's {} elements (got {} {} at {at})", p.len, w.len, w.dtype);
                }
            }
            table.push(GradT {
                grad: p.grad.ptr_at(p.offset),
                weight: p.weight.map_or(0, |(w, at)| w.ptr_at(at)),
                n: p.len as i64,
                grad_bf16: (p.grad.dtype == DType::BF16) as i32,
                pad: 0,
            });
        }
        let out = self.alloc(2, DType::F32)?;
        let sq = self.alloc(2, DType::F32)?; // the f64 sum's 8 bytes
        let map = Self::block_map(&table.iter().map(|t| t.n as usize).collect::<Vec<_>>());
        let partial = self.alloc(2 * map.len().max(1), DType::F32)?; // one f64 per block
        let n: usize = table.iter().map(|t| t.n as usize).sum();
        if map.is_empty() {
            self.memset0(&partial.buf, 8)?;
        } else {
            let dt = self.upload(&as_words(&table), DType::I32)?;
            let dm = self.upload(&as_words(&map), DType::I32)?;
            let cfg = Launch::new((map.len() as u32, 1, 1), 256).elems(n);
            // SAFETY: dt and dm hold the table and block map the kernel reads; every entry
            // addresses n live elements of its gradient (and weights, length-checked above);
            // `partial` has 8 bytes per block.
            unsafe { kernels::grad_norm_partial(self, cfg, dt.ptr(), dm.ptr(), partial.ptr())? };
        }
        let nb = map.len().max(1) as i64;
        // SAFETY: `partial` holds nb f64, `out` two f32, `sq` one f64.
        unsafe { kernels::grad_norm_finish(self, Launch::single(1024), partial.ptr(), nb, max_norm, out.ptr(), sq.ptr())? };
        Ok((out, sq))
    }

    /// The f64 that a kernel stored in the first 8 bytes of `s` (synchronises the stream).
    pub fn read_f64(&self, s: &CudaStorage) -> Result<f64> {
        if s.len * s.dtype.size_in_bytes() < 8 {
            bail!("read_f64", "a storage of {} bytes holds no f64", s.len * s.dtype.size_in_bytes());
        }
        let w: Vec<u32> = self.download(&s.buf, 0, 2)?;
        Ok(f64::from_bits(w[0] as u64 | (w[1] as u64) << 32))
    }
}
