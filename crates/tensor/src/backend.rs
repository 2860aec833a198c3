//! The contract between the op layer (`Tensor`) and a device: memory, casts and primitive math
//! (element-wise, reductions, matmul, concatenation, copies), plus optional fused optimizer
//! hooks. Every method takes storages with their layouts and returns fresh contiguous storage;
//! the op layer has already checked shapes, dtypes and devices. The fused ops (RMSNorm,
//! attention, ...) are not part of it: each lives in its own module of the ops crate with its
//! CPU and CUDA forms, and finds a device's backend with `get` (`Backend::into_any` to downcast).
//! The CPU backend is built in; a device backend (CUDA) registers itself with `register`.
use crate::{CpuStorage, DType, Device, Layout, Result, Storage};
use std::any::Any;
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

/// A storage and the layout that views it: what every primitive and fused op reads.
pub type View<'a> = (&'a Storage, &'a Layout);

/// One parameter of a fused AdamW step. Every view is dense (contiguous, offset 0, owning
/// exactly its elements) and of one length; `master` is the fp32 copy of a bf16 `param`.
pub struct AdamWSlot<'a> {
    pub param: View<'a>,
    pub grad: View<'a>,
    pub master: Option<View<'a>>,
    pub m: View<'a>,
    pub v: View<'a>,
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

pub trait Backend: Send + Sync + 'static {
    fn device(&self) -> Device;
    /// The backend as `Any`, for code that needs its concrete type (an op's device launcher).
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    /// Upload a host storage to this backend's device.
    #[allow(clippy::wrong_self_convention)] // `self` is the backend doing the upload, not the source
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage>;
    /// Contiguous host copy of the view.
    fn to_cpu(&self, x: View) -> Result<CpuStorage>;
    fn full(&self, n: usize, dtype: DType, v: f64) -> Result<Storage>;
    fn copy_strided(&self, x: View) -> Result<Storage>;
    fn cast(&self, x: View, dtype: DType) -> Result<Storage>;
    fn unary(&self, op: UnaryOp, x: View) -> Result<Storage>;
    /// `a` and `b` have the same (broadcast) shape.
    fn binary(&self, op: BinaryOp, a: View, b: View) -> Result<Storage>;
    /// Reduces `dims`; the output keeps them with size 1.
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize]) -> Result<Storage>;
    /// a: (..., m, k), b: (..., k, n) with identical (possibly broadcast) batch dims.
    fn matmul(&self, a: View, b: View) -> Result<Storage>;
    /// In place: `out[out_layout] = alpha · a · b (+ acc)` for a (m, k) and b (k, n), accumulated
    /// in f32 and rounded once to `out`'s dtype. `out_layout` is a dense (m, n) view of `out` (at any
    /// offset) of a's dtype or f32; `acc`, when given, a dense (m, n) view of out's dtype in
    /// another storage. `Ok(false)`: not done here (the caller composes matmul, add and assign;
    /// the CPU backend's answer).
    fn matmul_into(&self, _a: View, _b: View, _alpha: f64, _acc: Option<View>, _out: &mut Storage, _out_layout: &Layout) -> Result<bool> {
        Ok(false)
    }
    /// `n` elements whose values are unspecified: the caller writes every one before any is
    /// read. The default zeroes them.
    fn empty(&self, n: usize, dtype: DType) -> Result<Storage> {
        self.full(n, dtype, 0.0)
    }
    fn cat(&self, parts: &[View], dim: usize) -> Result<Storage>;
    /// In place: `dst[view] = src` element-wise (same shape); used by optimizers and loaders.
    fn assign(&self, dst: &mut Storage, dst_layout: &Layout, src: View) -> Result<()>;
    /// `assign` from a source of another dtype, converted on the way in one pass (rounded
    /// once). `Ok(false)`: not supported here (the caller converts first, then assigns).
    fn assign_cast(&self, _dst: &mut Storage, _dst_layout: &Layout, _src: View) -> Result<bool> {
        Ok(false)
    }

    /// Optional fused optimizer kernels. `Ok(false)` / `Ok(None)`: the backend has none and
    /// the caller runs the op-based version (the CPU backend's answer).
    ///
    /// One AdamW update of every slot in place (m, v, master or param, and the bf16 param from
    /// the updated master). The caller holds the storages' read guards: a device backend
    /// writes through device pointers, ordered on its stream like every other op.
    /// Every gradient is multiplied by `grad_scale` first (read in its own dtype, f32 or bf16).
    fn adamw_step(&self, _slots: &[AdamWSlot], _h: AdamWHyper, _grad_scale: f64) -> Result<bool> {
        Ok(false)
    }
    /// sqrt(sum of squares) over every element of `xs` (dense views), read back to the host.
    fn global_norm(&self, _xs: &[View]) -> Result<Option<f64>> {
        Ok(None)
    }
    /// The weighted sum of squares over every element of `xs` (contiguous views):
    /// sum((scale x)^2 w), w the matching element of `weights[i]` (an f32 view of `xs[i]`'s
    /// length) or 1 where that is None; accumulated in f64 in a fixed order and read back once.
    fn sum_squares(&self, _xs: &[View], _weights: &[Option<View>], _scale: f64) -> Result<Option<f64>> {
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

/// The backend of `device` (the CPU's, or the one registered for it); an error naming `op` when
/// none is registered.
pub fn get(op: &str, device: Device) -> Result<Arc<dyn Backend>> {
    if device == Device::Cpu {
        return Ok(crate::cpu::backend());
    }
    let b = BACKENDS.read().unwrap_or_else(|e| e.into_inner());
    b.iter().find(|x| x.device() == device).cloned().ok_or_else(|| {
        crate::Error::new(op, format!("no backend registered for {device}: build with CUDA support and initialise it first"))
    })
}
