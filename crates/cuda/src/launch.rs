//! Launch helpers shared by the `Backend` impl, plus the fused optimizer / loss launchers that
//! have no `Backend` method (AdamW, global grad norm, fused cross-entropy).
use crate::device::{Args, CudaBackend};
use crate::storage::{cuda, CudaStorage};
use ferrolm_tensor::{bail, DType, Layout, Result, Storage};

pub(crate) const MAX_RANK: usize = 6;

/// Mirror of `struct Strided` in kernels/common.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Strided {
    shape: [i64; MAX_RANK],
    stride: [i64; MAX_RANK],
    offset: i64,
    rank: i32,
    contiguous: i32,
}

impl Strided {
    /// Drops size-1 dims and merges dims that are contiguous with each other.
    pub fn from_layout(op: &str, l: &Layout) -> Result<Strided> {
        Self::from_parts(op, l.dims(), &l.strides, l.offset, l.is_contiguous())
    }
    pub fn from_parts(op: &str, dims: &[usize], strides: &[usize], offset: usize, contiguous: bool) -> Result<Strided> {
        let mut s = Strided { offset: offset as i64, contiguous: contiguous as i32, ..Default::default() };
        if contiguous {
            return Ok(s);
        }
        let mut d: Vec<(i64, i64)> = Vec::new();
        for (&n, &st) in dims.iter().zip(strides) {
            if n == 1 {
                continue;
            }
            match d.last_mut() {
                Some(last) if last.1 == st as i64 * n as i64 => {
                    last.0 *= n as i64;
                    last.1 = st as i64;
                }
                _ => d.push((n as i64, st as i64)),
            }
        }
        if d.len() > MAX_RANK {
            bail!(op, "view of rank {} cannot be collapsed to rank {MAX_RANK} for CUDA: make it contiguous first", d.len());
        }
        s.rank = d.len() as i32;
        for (i, (n, st)) in d.into_iter().enumerate() {
            s.shape[i] = n;
            s.stride[i] = st;
        }
        Ok(s)
    }
}

pub(crate) fn grid1(n: usize, block: u32) -> (u32, u32, u32) {
    let g = n.div_ceil(block as usize).clamp(1, 65535 * 16);
    (g as u32, 1, 1)
}
pub(crate) fn rows_grid(rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, 1 << 20) as u32, 1, 1)
}
pub(crate) fn sfx(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => bail!(op, "{d} is not supported by the CUDA kernels (use f32 or bf16)"),
    }
}

/// Kernel name `base_f32` / `base_bf16` as a static string.
pub(crate) fn kname(base: &str, suffix: &str) -> &'static str {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static NAMES: Mutex<Option<HashMap<String, &'static str>>> = Mutex::new(None);
    let key = format!("{base}_{suffix}");
    let mut g = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    if let Some(s) = m.get(&key) {
        return s;
    }
    let s: &'static str = Box::leak(key.clone().into_boxed_str());
    m.insert(key, s);
    s
}

// ---- fused optimizer / loss launchers ----------------------------------------------------------

const OPT_CHUNK: usize = 4096;

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
    n: i64,
    grad_bf16: i32,
    pad: i32,
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
const _: () = assert!(std::mem::size_of::<GradT>() == 8 + 8 + 4 + 4);
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
        if let Some((g, i)) = grad_scale {
            if g.dtype != DType::F32 || i >= g.len {
                bail!(op, "grad_scale must be an f32 storage with an element {i} (got {} of {} elements)", g.dtype, g.len);
            }
        }
        let mut table = Vec::with_capacity(tensors.len());
        for t in tensors {
            let n = t.master.len;
            if [t.grad.len, t.m.len, t.v.len].iter().any(|&x| x != n) || t.param_bf16.is_some_and(|x| x.len != n) {
                bail!(op, "tensor lengths differ");
            }
            if [t.master.dtype, t.m.dtype, t.v.dtype].iter().any(|&d| d != DType::F32) {
                bail!(op, "master weights and moments must be f32");
            }
            sfx(op, t.grad.dtype)?;
            table.push(AdamT {
                master: t.master.buf.ptr,
                grad: t.grad.buf.ptr,
                m: t.m.buf.ptr,
                v: t.v.buf.ptr,
                param_bf16: t.param_bf16.map_or(0, |x| x.buf.ptr),
                n: n as i64,
                grad_bf16: (t.grad.dtype == DType::BF16) as i32,
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
        let args = Args::new()
            .push(dt.buf.ptr)
            .push(dm.buf.ptr)
            .push(p.lr)
            .push(p.beta1 as f32)
            .push(p.beta2 as f32)
            .push(p.eps)
            .push((1.0 / bc1) as f32)
            .push((1.0 / bc2) as f32)
            .push(grad_scale.map_or(0u64, |(g, i)| g.ptr_at(i)));
        self.launch("adamw_multi", (map.len() as u32, 1, 1), 256, 0, args)
        // dt, dm return to the pool here; stream order keeps them valid for the launch.
    }

    /// Global L2 norm of many gradients, deterministic two-stage reduction. Returns a device
    /// f32 pair [norm, clip factor min(1, max_norm / (norm + 1e-6))] (factor 1 if max_norm <= 0).
    pub fn grad_norm(&self, grads: &[&CudaStorage], max_norm: f32) -> Result<CudaStorage> {
        let op = "grad_norm";
        let mut table = Vec::new();
        for g in grads {
            sfx(op, g.dtype)?;
            table.push(GradT { grad: g.buf.ptr, n: g.len as i64, grad_bf16: (g.dtype == DType::BF16) as i32, pad: 0 });
        }
        let out = self.alloc(2, DType::F32)?;
        let map = Self::block_map(&table.iter().map(|t| t.n as usize).collect::<Vec<_>>());
        let partial = self.alloc(map.len().max(1), DType::F32)?;
        if map.is_empty() {
            self.memset0(&partial.buf, 4)?;
        } else {
            let dt = self.upload(&as_words(&table), DType::I32)?;
            let dm = self.upload(&as_words(&map), DType::I32)?;
            self.launch(
                "grad_norm_partial",
                (map.len() as u32, 1, 1),
                256,
                0,
                Args::new().push(dt.buf.ptr).push(dm.buf.ptr).push(partial.buf.ptr),
            )?;
        }
        let nb = map.len().max(1) as i64;
        self.launch("grad_norm_finish", (1, 1, 1), 1024, 0, Args::new().push(partial.buf.ptr).push(nb).push(max_norm).push(out.buf.ptr))?;
        Ok(out)
    }

    /// Fused cross-entropy forward + backward in one pass over the logits: returns
    /// (mean loss () f32, lse (n) f32, dlogits (n, v) in the logits' dtype) with
    /// dlogits = (softmax - onehot) * grad_mult / count. No host synchronisation.
    pub fn cross_entropy_fused(
        &self,
        logits: &Storage,
        logits_layout: &Layout,
        targets: &Storage,
        ignore_index: i32,
        grad_mult: f32,
    ) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
        let op = "cross_entropy_fused";
        let x = cuda(op, logits)?;
        let t = cuda(op, targets)?;
        let s = sfx(op, x.dtype)?;
        let v = *logits_layout.dims().last().unwrap_or(&1);
        let n = logits_layout.numel().checked_div(v).unwrap_or(0);
        let scale = self.alloc(1, DType::F32)?;
        self.launch(
            "ce_count_scale",
            (1, 1, 1),
            1024,
            0,
            Args::new().push(t.buf.ptr).push(n as i64).push(ignore_index).push(grad_mult).push(scale.buf.ptr),
        )?;
        let lse = self.alloc(n, DType::F32)?;
        let rl = self.alloc(n, DType::F32)?;
        let dx = self.alloc(n * v, x.dtype)?;
        self.launch(
            kname("ce_fused", s),
            rows_grid(n),
            256,
            0,
            Args::new()
                .push(x.ptr_at(logits_layout.offset))
                .push(t.buf.ptr)
                .push(scale.buf.ptr)
                .push(lse.buf.ptr)
                .push(rl.buf.ptr)
                .push(dx.buf.ptr)
                .push(n as i64)
                .push(v as i64)
                .push(ignore_index),
        )?;
        let loss = self.alloc(1, DType::F32)?;
        let count = self.alloc(1, DType::I32)?;
        self.launch(
            "ce_finish",
            (1, 1, 1),
            1024,
            0,
            Args::new()
                .push(rl.buf.ptr)
                .push(t.buf.ptr)
                .push(n as i64)
                .push(ignore_index)
                .push(1.0f32)
                .push(loss.buf.ptr)
                .push(count.buf.ptr)
                .push(0u64),
        )?;
        Ok((loss, lse, dx))
    }
}
