//! cuBLASLt GEMM: bf16 or f32 in; out in the input's dtype or, from bf16, in f32; fp32
//! accumulation (CUBLAS_COMPUTE_32F, no TF32, so f32 results match the CPU reference to ~1e-5);
//! optionally D = A·B + C (beta 1, C of D's type and layout: another buffer, or D itself, which
//! cuBLASLt takes in place), so a gradient sum, an accumulation across chunks or a cast into an
//! f32 gradient buffer rides on the GEMM instead of a kernel of its own;
//! strided batches, either operand transposed, a 32 MiB workspace, and the heuristic's
//! algorithm cached per problem shape and pointer alignment.
//!
//! Row-major C (m, n) = A (m, k) · B (k, n) is computed as the column-major C^T = B^T · A^T,
//! so cuBLASLt's "A" is our B and its "B" is our A.
use crate::err;
use crate::pool::{DevBuf, Pool};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaContext, CudaStream};
use ferrolm_tensor::{DType, Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

const WORKSPACE: usize = 32 << 20;
pub(crate) const NO_ALGORITHM: &str = "no cuBLASLt algorithm";
const MATMUL_FAILED: &str = "cuBLASLt matmul failed";

/// True for an error cuBLASLt itself returned (no algorithm for the call, or the call refused),
/// as opposed to a call this crate planned wrongly: nothing was enqueued.
pub(crate) fn refused_by_cublaslt(e: &Error) -> bool {
    let m = e.to_string();
    m.contains(NO_ALGORITHM) || m.contains(MATMUL_FAILED)
}

/// One operand of a row-major GEMM: `trans` means its storage is column-major (unit row stride).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    pub ptr: u64,
    /// Elements of the buffer from `ptr` on: every element the GEMM reads must lie below it.
    pub avail: usize,
    pub trans: bool,
    pub ld: i64,
    pub batch_stride: i64,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    bf16: bool,
    out_bf16: bool,
    beta: bool,
    /// The alignment in bytes (a power of two, at most 256) of A, B, C and D's pointers.
    align: [u32; 4],
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: i64,
    ldb: i64,
    batch: usize,
    sa: i64,
    sb: i64,
}

/// One column-major matrix as cuBLASLt sees it: `rows x cols`, leading dimension `ld`, the next
/// batch entry `stride` elements further.
#[derive(Clone, Copy, Debug)]
pub struct LtMatrix {
    pub ptr: u64,
    /// Elements of the buffer from `ptr` on (see `LtMatrix::check_bounds`).
    pub avail: usize,
    pub rows: usize,
    pub cols: usize,
    pub ld: i64,
    pub stride: i64,
}

/// A cuBLASLt call D = alpha · op(A) · op(B) (+ C when `c` is given: beta 1 or 0), everything
/// column-major; built by `plan` and executed by `Gemm::run` on a GPU or by `emu::lt_matmul` on
/// the emulator.
#[derive(Clone, Copy, Debug)]
pub struct LtCall {
    /// A and B are bf16 (else f32).
    pub bf16: bool,
    /// C and D are bf16 (else f32; bf16 out needs bf16 in).
    pub out_bf16: bool,
    pub ta: bool,
    pub tb: bool,
    pub k: usize,
    pub batch: usize,
    pub a: LtMatrix,
    pub b: LtMatrix,
    /// The addend: D's shape, type, ld and batch stride, in a buffer of its own or D itself
    /// (in place: cuBLASLt requires C = D to share D's layout, which it does by construction).
    pub c: Option<LtMatrix>,
    pub d: LtMatrix,
    /// The product's scale (cuBLASLt's alpha; 1 for a plain product).
    pub alpha: f32,
}

/// The output of a planned GEMM: where D goes, its dtype, and an optional addend C of the same
/// shape, dtype and (dense, row-major) layout.
#[derive(Clone, Copy, Debug)]
pub struct GemmOut {
    /// D's (address, elements from it on).
    pub d: (u64, usize),
    pub dtype: DType,
    /// C's (address, elements from it on).
    pub acc: Option<(u64, usize)>,
    /// The product's scale: D = alpha · A B (+ C).
    pub alpha: f32,
}

impl GemmOut {
    /// A fresh output of the inputs' dtype, nothing added.
    pub fn plain(dtype: DType, d: (u64, usize)) -> GemmOut {
        GemmOut { d, dtype, acc: None, alpha: 1.0 }
    }
}

impl LtCall {
    /// Row-major out (batch, m, n) contiguous = a (batch, m, k) · b (batch, k, n) (+ the addend
    /// of `out`, laid out like the output). Every operand's extent is checked against its
    /// buffer, so neither cuBLASLt nor the emulator's reference can touch memory outside it.
    #[allow(clippy::too_many_arguments)]
    pub fn plan(dtype: DType, a: Operand, b: Operand, m: usize, n: usize, k: usize, batch: usize, out: GemmOut) -> Result<LtCall> {
        let bf16 = match dtype {
            DType::BF16 => true,
            DType::F32 => false,
            d => return Err(Error::new("matmul", format!("{d} GEMM is not supported on CUDA"))),
        };
        let out_bf16 = match (dtype, out.dtype) {
            (DType::BF16, DType::BF16) => true,
            (_, DType::F32) => false,
            (i, o) => return Err(Error::new("matmul", format!("a GEMM of {i} operands cannot write {o}"))),
        };
        let (ta, tb) = (b.trans, a.trans); // cuBLASLt's A is our b, its B is our a
                                           // Lt A = B^T (n, k); Lt B = A^T (k, m); D = C^T (n, m).
        let (ar, ac) = if ta { (k, n) } else { (n, k) };
        let (br, bc) = if tb { (m, k) } else { (k, m) };
        let call = LtCall {
            ta,
            tb,
            k,
            batch,
            a: LtMatrix { ptr: b.ptr, avail: b.avail, rows: ar, cols: ac, ld: b.ld, stride: b.batch_stride },
            b: LtMatrix { ptr: a.ptr, avail: a.avail, rows: br, cols: bc, ld: a.ld, stride: a.batch_stride },
            c: out.acc.map(|(ptr, avail)| LtMatrix { ptr, avail, rows: n, cols: m, ld: n as i64, stride: (m * n) as i64 }),
            d: LtMatrix { ptr: out.d.0, avail: out.d.1, rows: n, cols: m, ld: n as i64, stride: (m * n) as i64 },
            bf16,
            out_bf16,
            alpha: out.alpha,
        };
        for (name, x) in [("b", Some(&call.a)), ("a", Some(&call.b)), ("acc", call.c.as_ref()), ("out", Some(&call.d))] {
            if let Some(x) = x {
                x.check_bounds(name, batch)?;
            }
        }
        // An addend overlapping D but not at D's address would be read after D's writes.
        if let Some(c) = call.c.filter(|c| c.ptr != call.d.ptr) {
            let elem = if out_bf16 { 2 } else { 4 };
            // Bytes from the first element to past the last (extents were checked above).
            let span = |x: &LtMatrix| (x.ptr, x.ptr + ((batch.max(1) - 1) as u64 * x.stride as u64 + x.cols as u64 * x.ld as u64) * elem);
            let ((c0, c1), (d0, d1)) = (span(&c), span(&call.d));
            if c0 < d1 && d0 < c1 {
                return Err(Error::new("matmul", "the addend of a GEMM must be its output itself or lie apart from it"));
            }
        }
        Ok(call)
    }
}

impl LtMatrix {
    /// The last element `batch` column-major matrices touch, `(batch-1)*stride + (cols-1)*ld +
    /// rows - 1`, lies inside the buffer (negative strides and lds are refused).
    fn check_bounds(&self, name: &str, batch: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        let last = (|| {
            let ld = u64::try_from(self.ld).ok()?;
            let stride = if batch > 1 { u64::try_from(self.stride).ok()? } else { 0 };
            let rows = (self.rows as u64).checked_sub(1)?;
            let cols = (self.cols as u64).checked_sub(1)?;
            stride.checked_mul(batch as u64 - 1)?.checked_add(cols.checked_mul(ld)?)?.checked_add(rows)
        })();
        match last {
            Some(l) if l < self.avail as u64 => Ok(()),
            _ => Err(Error::new(
                "matmul",
                format!(
                    "operand {name} ({} x {}, ld {}, batch {batch} of stride {}) reaches past its buffer of {} elements",
                    self.rows, self.cols, self.ld, self.stride, self.avail
                ),
            )),
        }
    }
}

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: DevBuf,
    /// Per call shape: its descriptors and algorithm, made on its first call.
    algos: HashMap<Key, (Descs, sys::cublasLtMatmulAlgo_t)>,
}
// SAFETY: a cuBLASLt handle may be used from any thread as long as calls on it do not run
// concurrently; the backend keeps its Gemm behind a Mutex, so only one thread uses it at a time.
unsafe impl Send for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: the handle came from create_handle in Gemm::new, is destroyed only here, once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

struct Descs {
    op: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
}
impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: non-null descriptors were created by create_matrix_layout / create_matmul_desc
        // for this Descs alone and are destroyed only here, once; null ones are skipped.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.op.is_null() {
                let _ = lt::destroy_matmul_desc(self.op);
            }
        }
    }
}

fn layout(dt: sys::cudaDataType, rows: usize, cols: usize, ld: i64, batch: usize, stride: i64) -> Result<sys::cublasLtMatrixLayout_t> {
    let l = lt::create_matrix_layout(dt, rows as u64, cols as u64, ld).map_err(err("matmul"))?;
    if batch > 1 {
        let b = batch as i32;
        // SAFETY: `l` is a live layout created just above; each attribute value points at a
        // local of exactly the size passed (i32: 4 bytes, i64: 8), which cuBLASLt copies.
        unsafe {
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &b as *const i32 as *const c_void,
                4,
            )
            .map_err(err("matmul"))?;
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                8,
            )
            .map_err(err("matmul"))?;
        }
    }
    Ok(l)
}

impl Gemm {
    /// The descriptors of a call's shape and cuBLASLt's first heuristic algorithm for them,
    /// among those that accept the pointers' alignment.
    fn plan(&self, c: &LtCall, align: [u32; 4]) -> Result<(Descs, sys::cublasLtMatmulAlgo_t)> {
        let ty = |bf16: bool| if bf16 { sys::cudaDataType::CUDA_R_16BF } else { sys::cudaDataType::CUDA_R_32F };
        let op =
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F).map_err(err("matmul"))?;
        let mut d = Descs { op, layouts: [std::ptr::null_mut(); 3] };
        let opn = |t: bool| {
            if t {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        use sys::cublasLtMatmulDescAttributes_t::{CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB};
        for (attr, t) in [(CUBLASLT_MATMUL_DESC_TRANSA, c.ta), (CUBLASLT_MATMUL_DESC_TRANSB, c.tb)] {
            let o = opn(t);
            // SAFETY: `op` is a live descriptor (owned by `d`); the value points at a local
            // cublasOperation_t and passes its exact size, which cuBLASLt copies.
            unsafe {
                lt::set_matmul_desc_attribute(op, attr, &o as *const _ as *const c_void, std::mem::size_of_val(&o))
                    .map_err(err("matmul"))?;
            }
        }
        // C and D share one layout: same shape, type, ld and batch stride.
        for (i, (x, bf16)) in [(&c.a, c.bf16), (&c.b, c.bf16), (&c.d, c.out_bf16)].into_iter().enumerate() {
            d.layouts[i] = layout(ty(bf16), x.rows, x.cols, x.ld, c.batch, x.stride)?;
        }
        let pref = lt::create_matmul_pref().map_err(err("matmul"))?;
        let ws = WORKSPACE as u64;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: `pref` is live until destroyed below; each value points at a local of exactly
        // the size passed (u64: 8 bytes, u32: 4), which cuBLASLt copies; the handle, descriptor
        // and layouts are live.
        let h = unsafe {
            let mut r =
                lt::set_matmul_pref_attribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8);
            // cuBLASLt assumes 256-byte aligned pointers unless told otherwise; a view at an
            // offset (a parameter's slice of its gradient bucket) may be less aligned.
            let attrs = [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            for (attr, a) in attrs.into_iter().zip(align.iter()) {
                r = r.and_then(|_| lt::set_matmul_pref_attribute(pref, attr, a as *const u32 as *const c_void, 4));
            }
            let h = r
                .and_then(|_| lt::get_matmul_algo_heuristic(self.handle, op, d.layouts[0], d.layouts[1], d.layouts[2], d.layouts[2], pref));
            let _ = lt::destroy_matmul_pref(pref);
            h.map_err(|e| Error::new("matmul", format!("{NO_ALGORITHM} for {c:?}: {e:?}")))?
        };
        Ok((d, h.algo))
    }

    pub fn new(ctx: &Arc<CudaContext>, pool: &Arc<Pool>, _stream: &Arc<CudaStream>) -> Result<Gemm> {
        ctx.bind_to_thread().map_err(err("cublaslt"))?;
        let handle = lt::create_handle()
            .map_err(|e| Error::new("cublaslt", format!("cannot create a cuBLASLt handle (is libcublasLt on the library path?): {e:?}")))?;
        let workspace = pool.alloc(WORKSPACE)?;
        Ok(Gemm { handle, workspace, algos: HashMap::new() })
    }

    /// Runs a planned call on `stream`. The descriptors and the algorithm of a shape are made
    /// once and kept (a training step repeats a few dozen shapes hundreds of times).
    pub fn run(&mut self, stream: &CudaStream, c: &LtCall) -> Result<()> {
        let elem = |bf16: bool| if bf16 { 2u64 } else { 4 };
        // The largest power of two (at most 256) that divides the address: what an algorithm
        // may assume of it.
        let align = |ptr: u64| (1u64 << ptr.trailing_zeros().min(8)) as u32;
        let cptr = c.c.map_or(c.d.ptr, |x| x.ptr);
        let align = [align(c.a.ptr), align(c.b.ptr), align(cptr), align(c.d.ptr)];
        debug_assert!(align[3] as u64 >= elem(c.out_bf16));
        let key = Key {
            bf16: c.bf16,
            out_bf16: c.out_bf16,
            beta: c.c.is_some(),
            align,
            ta: c.ta,
            tb: c.tb,
            m: c.d.rows,
            n: c.d.cols,
            k: c.k,
            lda: c.a.ld,
            ldb: c.b.ld,
            batch: c.batch,
            sa: c.a.stride,
            sb: c.b.stride,
        };
        if !self.algos.contains_key(&key) {
            let planned = self.plan(c, align)?;
            self.algos.insert(key, planned);
        }
        let (d, algo) = self.algos.get(&key).expect("inserted above");
        let (op, algo) = (d.op, *algo);
        let (alpha, beta) = (c.alpha, if c.c.is_some() { 1.0f32 } else { 0.0 });
        // SAFETY: the handle, descriptor and layouts are live; alpha/beta are f32 as the f32
        // compute type requires; every operand's extent (rows, cols, ld, batch stride) was checked
        // against its buffer in LtCall::plan (C in D's layout), and the buffers are pool blocks
        // that stay allocated until the stream has run this call (blocks are reused only in
        // stream order); C is D itself (cuBLASLt's in-place form: one layout) or a buffer apart
        // from it (plan refuses an overlap); with beta 0, C is D and is not read; the workspace is a WORKSPACE-byte pool block owned by self.
        unsafe {
            lt::matmul(
                self.handle,
                op,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                c.a.ptr as *const c_void,
                d.layouts[0],
                c.b.ptr as *const c_void,
                d.layouts[1],
                cptr as *const c_void,
                d.layouts[2],
                c.d.ptr as *mut c_void,
                d.layouts[2],
                &algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| Error::new("matmul", format!("{MATMUL_FAILED}: {e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(avail: usize, ld: i64, batch_stride: i64) -> Operand {
        Operand { ptr: 0x1000, avail, trans: false, ld, batch_stride }
    }

    /// The planner refuses operands whose extent is past their buffers (before cuBLASLt or the
    /// emulator could read them).
    #[test]
    fn plan_checks_every_operand_against_its_buffer() {
        // (2, 3) x (3, 4) -> (2, 4), two batches.
        let out = |n: usize| GemmOut::plain(DType::F32, (0x2000, n));
        let ok = LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, out(16));
        assert!(ok.is_ok(), "{ok:?}");
        for (a, b, o) in [(op(11, 3, 6), op(24, 4, 12), 16), (op(12, 3, 6), op(23, 4, 12), 16), (op(12, 3, 6), op(24, 4, 12), 15)] {
            let e = LtCall::plan(DType::F32, a, b, 2, 4, 3, 2, out(o)).unwrap_err().to_string();
            assert!(e.contains("reaches past its buffer"), "{e}");
        }
        assert!(LtCall::plan(DType::F32, op(12, -3, 6), op(24, 4, 12), 2, 4, 3, 2, out(16)).is_err());
        assert!(LtCall::plan(DType::F32, op(12, 3, i64::MAX), op(24, 4, 12), 2, 4, 3, 2, out(16)).is_err());
        // The addend is checked like D, is D itself or apart from it, and bf16 out needs bf16 in.
        let acc = |c: (u64, usize)| GemmOut { acc: Some(c), ..out(16) };
        assert!(LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, acc((0x3000, 16))).is_ok());
        let e = LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, acc((0x3000, 15))).unwrap_err().to_string();
        assert!(e.contains("operand acc") && e.contains("reaches past its buffer"), "{e}");
        assert!(LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, acc((0x2000, 16))).is_ok(), "in place");
        let e = LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, acc((0x2004, 16))).unwrap_err().to_string();
        assert!(e.contains("apart from it"), "{e}");
        let e = LtCall::plan(DType::F32, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, GemmOut::plain(DType::BF16, (0x2000, 16))).unwrap_err();
        assert!(e.to_string().contains("cannot write bf16"), "{e}");
        let bf = LtCall::plan(DType::BF16, op(12, 3, 6), op(24, 4, 12), 2, 4, 3, 2, out(16)).unwrap();
        assert!(bf.bf16 && !bf.out_bf16);
    }
}
