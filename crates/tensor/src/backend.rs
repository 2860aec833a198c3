//! The contract between the op layer (`Tensor`) and a device. Every method takes storages with
//! their layouts and returns fresh contiguous storage; the op layer has already checked shapes,
//! dtypes and devices. Fused ops receive contiguous inputs (offset may be non-zero).
//! The CPU backend is built in; a device backend (CUDA) registers itself with `register`.
use crate::{CpuStorage, DType, Device, Layout, Result, Storage};
use std::sync::{Arc, RwLock};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sqr,
    Silu,
    /// d silu(x) / dx
    SiluGrad,
    /// x^p
    Powf(f64),
    /// x * mul + add
    Affine {
        mul: f64,
        add: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    /// 1.0 where equal, else 0.0
    Eq,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// Sizes of a causal attention call: q is (b, hq, t, d), k and v are (b, hkv, t, d).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub t: usize,
    pub d: usize,
}

pub type Sl<'a> = (&'a Storage, &'a Layout);

/// One parameter of a fused AdamW step. Every view is dense (contiguous, offset 0, owning
/// exactly its elements) and of one length; `master` is the fp32 copy of a bf16 `param`.
pub struct AdamWSlot<'a> {
    pub param: Sl<'a>,
    pub grad: Sl<'a>,
    pub master: Option<Sl<'a>>,
    pub m: Sl<'a>,
    pub v: Sl<'a>,
    pub weight_decay: f64,
}

/// AdamW hyper-parameters of one step (`step` is 1-based, for bias correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub step: u64,
}

pub trait Backend: Send + Sync {
    fn device(&self) -> Device;
    /// Upload a host storage to this backend's device.
    #[allow(clippy::wrong_self_convention)] // `self` is the backend doing the upload, not the source
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage>;
    /// Contiguous host copy of the view.
    fn to_cpu(&self, x: Sl) -> Result<CpuStorage>;
    fn full(&self, n: usize, dtype: DType, v: f64) -> Result<Storage>;
    fn copy_strided(&self, x: Sl) -> Result<Storage>;
    fn cast(&self, x: Sl, dtype: DType) -> Result<Storage>;
    fn unary(&self, op: UnaryOp, x: Sl) -> Result<Storage>;
    /// `a` and `b` have the same (broadcast) shape.
    fn binary(&self, op: BinaryOp, a: Sl, b: Sl) -> Result<Storage>;
    /// Reduces `dims`; the output keeps them with size 1.
    fn reduce(&self, op: ReduceOp, x: Sl, dims: &[usize]) -> Result<Storage>;
    /// a: (..., m, k), b: (..., k, n) with identical (possibly broadcast) batch dims.
    fn matmul(&self, a: Sl, b: Sl) -> Result<Storage>;
    fn cat(&self, parts: &[Sl], dim: usize) -> Result<Storage>;
    /// In place: `dst[view] = src` element-wise (same shape); used by optimizers and loaders.
    fn assign(&self, dst: &mut Storage, dst_layout: &Layout, src: Sl) -> Result<()>;

    /// w: (vocab, d) contiguous, ids: i32 of any shape -> (ids.., d)
    fn embedding(&self, w: Sl, ids: Sl) -> Result<Storage>;
    /// Deterministic scatter-add of dy (n, d) rows into a (vocab, d) gradient.
    fn embedding_backward(&self, dy: Sl, ids: Sl, vocab: usize) -> Result<Storage>;
    fn softmax_last(&self, x: Sl) -> Result<Storage>;
    fn softmax_last_backward(&self, y: Sl, dy: Sl) -> Result<Storage>;
    /// x: (rows, d), w: (d) -> (y, inv_rms (rows) f32)
    fn rmsnorm(&self, x: Sl, w: Sl, eps: f64) -> Result<(Storage, Storage)>;
    /// -> (dx, dw)
    fn rmsnorm_backward(&self, dy: Sl, x: Sl, w: Sl, inv_rms: Sl) -> Result<(Storage, Storage)>;
    /// x: (b, h, t, d), cos/sin: (t, d). `inverse` applies the transpose rotation (the backward).
    fn rope(&self, x: Sl, cos: Sl, sin: Sl, inverse: bool) -> Result<Storage>;
    fn swiglu(&self, gate: Sl, up: Sl) -> Result<Storage>;
    /// -> (dgate, dup)
    fn swiglu_backward(&self, dy: Sl, gate: Sl, up: Sl) -> Result<(Storage, Storage)>;
    /// Causal attention; -> (o (b,hq,t,d), lse (b,hq,t) f32)
    fn attention(&self, q: Sl, k: Sl, v: Sl, dims: AttnDims, scale: f64) -> Result<(Storage, Storage)>;
    /// -> (dq, dk, dv)
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dout: Sl,
        q: Sl,
        k: Sl,
        v: Sl,
        out: Sl,
        lse: Sl,
        dims: AttnDims,
        scale: f64,
    ) -> Result<(Storage, Storage, Storage)>;
    /// logits (n, v), targets i32 (n) -> (mean loss () in f32/f64, lse (n) f32, count of counted rows)
    fn cross_entropy(&self, logits: Sl, targets: Sl, ignore_index: i32) -> Result<(Storage, Storage, usize)>;
    /// dlogits = (softmax - onehot) * scale for counted rows, 0 for ignored ones.
    fn cross_entropy_backward(&self, logits: Sl, targets: Sl, lse: Sl, ignore_index: i32, scale: Sl) -> Result<Storage>;

    /// Optional fused optimizer kernels. `Ok(false)` / `Ok(None)`: the backend has none and
    /// the caller runs the op-based version (the CPU backend's answer).
    ///
    /// One AdamW update of every slot in place (m, v, master or param, and the bf16 param from
    /// the updated master). The caller holds the storages' read guards: a device backend
    /// writes through device pointers, ordered on its stream like every other op.
    fn adamw_step(&self, _slots: &[AdamWSlot], _h: AdamWHyper) -> Result<bool> {
        Ok(false)
    }
    /// sqrt(sum of squares) over every element of `xs` (dense views), read back to the host.
    fn global_norm(&self, _xs: &[Sl]) -> Result<Option<f64>> {
        Ok(None)
    }
}

static BACKENDS: RwLock<Vec<Arc<dyn Backend>>> = RwLock::new(Vec::new());

/// Makes a device backend available to every `Tensor` on `backend.device()`.
pub fn register(backend: Arc<dyn Backend>) {
    let mut b = BACKENDS.write().unwrap_or_else(|e| e.into_inner());
    b.retain(|x| x.device() != backend.device());
    b.push(backend);
}

pub(crate) fn get(op: &str, device: Device) -> Result<Arc<dyn Backend>> {
    if device == Device::Cpu {
        return Ok(crate::cpu::backend());
    }
    let b = BACKENDS.read().unwrap_or_else(|e| e.into_inner());
    b.iter().find(|x| x.device() == device).cloned().ok_or_else(|| {
        crate::Error::new(op, format!("no backend registered for {device}: build with CUDA support and initialise it first"))
    })
}
