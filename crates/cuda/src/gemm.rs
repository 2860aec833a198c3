//! cuBLASLt GEMM: bf16 or f32 in and out, fp32 accumulation (CUBLAS_COMPUTE_32F, no TF32, so f32
//! results match the CPU reference to ~1e-5), strided batches, either operand transposed, a
//! 32 MiB workspace, and the heuristic's algorithm cached per problem shape.
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

/// One operand of a row-major GEMM: `trans` means its storage is column-major (unit row stride).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    pub ptr: u64,
    pub trans: bool,
    pub ld: i64,
    pub batch_stride: i64,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    bf16: bool,
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
    pub rows: usize,
    pub cols: usize,
    pub ld: i64,
    pub stride: i64,
}

/// A cuBLASLt call D = op(A) · op(B) (alpha 1, beta 0), everything column-major; built by `plan`
/// and executed by `Gemm::run` on a GPU or by `emu::lt_matmul` on the emulator.
#[derive(Clone, Copy, Debug)]
pub struct LtCall {
    pub bf16: bool,
    pub ta: bool,
    pub tb: bool,
    pub k: usize,
    pub batch: usize,
    pub a: LtMatrix,
    pub b: LtMatrix,
    pub d: LtMatrix,
}

impl LtCall {
    /// Row-major out (batch, m, n) contiguous = a (batch, m, k) · b (batch, k, n).
    #[allow(clippy::too_many_arguments)]
    pub fn plan(dtype: DType, a: Operand, b: Operand, m: usize, n: usize, k: usize, batch: usize, out: u64) -> Result<LtCall> {
        let bf16 = match dtype {
            DType::BF16 => true,
            DType::F32 => false,
            d => return Err(Error::new("matmul", format!("{d} GEMM is not supported on CUDA"))),
        };
        let (ta, tb) = (b.trans, a.trans); // cuBLASLt's A is our b, its B is our a
                                           // Lt A = B^T (n, k); Lt B = A^T (k, m); D = C^T (n, m).
        let (ar, ac) = if ta { (k, n) } else { (n, k) };
        let (br, bc) = if tb { (m, k) } else { (k, m) };
        Ok(LtCall {
            bf16,
            ta,
            tb,
            k,
            batch,
            a: LtMatrix { ptr: b.ptr, rows: ar, cols: ac, ld: b.ld, stride: b.batch_stride },
            b: LtMatrix { ptr: a.ptr, rows: br, cols: bc, ld: a.ld, stride: a.batch_stride },
            d: LtMatrix { ptr: out, rows: n, cols: m, ld: n as i64, stride: (m * n) as i64 },
        })
    }
}

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: DevBuf,
    algos: HashMap<Key, sys::cublasLtMatmulAlgo_t>,
}
// SAFETY: the handle is only used under the backend's Mutex.
unsafe impl Send for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
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
    pub fn new(ctx: &Arc<CudaContext>, pool: &Arc<Pool>, _stream: &Arc<CudaStream>) -> Result<Gemm> {
        ctx.bind_to_thread().map_err(err("cublaslt"))?;
        let handle = lt::create_handle()
            .map_err(|e| Error::new("cublaslt", format!("cannot create a cuBLASLt handle (is libcublasLt on the library path?): {e:?}")))?;
        let workspace = pool.alloc(WORKSPACE)?;
        Ok(Gemm { handle, workspace, algos: HashMap::new() })
    }

    /// Runs a planned call on `stream`.
    pub fn run(&mut self, stream: &CudaStream, c: &LtCall) -> Result<()> {
        let dt = if c.bf16 { sys::cudaDataType::CUDA_R_16BF } else { sys::cudaDataType::CUDA_R_32F };
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
        unsafe {
            let (oa, ob) = (opn(c.ta), opn(c.tb));
            lt::set_matmul_desc_attribute(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &oa as *const _ as *const c_void,
                std::mem::size_of_val(&oa),
            )
            .map_err(err("matmul"))?;
            lt::set_matmul_desc_attribute(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &ob as *const _ as *const c_void,
                std::mem::size_of_val(&ob),
            )
            .map_err(err("matmul"))?;
        }
        for (i, x) in [&c.a, &c.b, &c.d].into_iter().enumerate() {
            d.layouts[i] = layout(dt, x.rows, x.cols, x.ld, c.batch, x.stride)?;
        }
        let key = Key {
            bf16: c.bf16,
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
        let algo = match self.algos.get(&key) {
            Some(a) => *a,
            None => {
                let pref = lt::create_matmul_pref().map_err(err("matmul"))?;
                let ws = WORKSPACE as u64;
                let h = unsafe {
                    let r = lt::set_matmul_pref_attribute(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &ws as *const u64 as *const c_void,
                        8,
                    );
                    let h = r.and_then(|_| {
                        lt::get_matmul_algo_heuristic(self.handle, op, d.layouts[0], d.layouts[1], d.layouts[2], d.layouts[2], pref)
                    });
                    let _ = lt::destroy_matmul_pref(pref);
                    h.map_err(|e| Error::new("matmul", format!("no cuBLASLt algorithm for {c:?}: {e:?}")))?
                };
                self.algos.insert(key, h.algo);
                h.algo
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
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
                c.d.ptr as *const c_void,
                d.layouts[2],
                c.d.ptr as *mut c_void,
                d.layouts[2],
                &algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| Error::new("matmul", format!("cuBLASLt matmul failed: {e:?}")))
    }
}
