//! The Rust side of the CUDA emulator (the C++ side is crates/cuda/emu): kernel launch through
//! the table that build.rs generates (indexed by `Kernel`), as items for an emulated stream, and
//! a reference implementation of the cuBLASLt call that `gemm.rs` plans, with cuBLASLt's
//! column-major semantics and its validity checks, so the layout arithmetic of every GEMM is
//! tested without a GPU. Device pointers on the emulated device are host addresses (see
//! `pool::Mem::Host`). It knows no backend: the emulator's execution (`exec::emulator`) queues
//! what it returns.
use crate::emu_stream::Job;
use crate::gemm::{LtCall, LtMatrix};
use crate::launch::{Arg, Launch};
use ferrolm_tensor::{bail, bf16, Result};
use std::ffi::c_void;

/// Whether build.rs compiled the emulator into this binary.
pub const AVAILABLE: bool = cfg!(ferro_emu);

#[cfg(ferro_emu)]
mod ffi {
    use std::ffi::{c_char, c_int, c_void};
    #[repr(C)]
    pub struct TableEntry {
        pub name: *const c_char,
        pub run: unsafe extern "C" fn(*mut *mut c_void),
    }
    extern "C" {
        pub static ferro_emu_kernels: [TableEntry; 0];
        pub static ferro_emu_kernel_count: c_int;
        pub fn ferro_emu_run(
            entry: unsafe extern "C" fn(*mut *mut c_void),
            gx: u32,
            gy: u32,
            gz: u32,
            block: u32,
            smem: u32,
            args: *mut *mut c_void,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        pub fn ferro_emu_set_reverse(on: c_int);
    }
}

/// The item that runs kernel `i` (its `Kernel` index; `name` for messages) over the grid, for
/// the compute stream to queue: the argument values are copied now (the launcher's locals are
/// gone when it runs) and the stream's worker runs the grid to completion. The emulator's table
/// is generated in `Kernel` order (build.rs), so the kernel's index is its entry. A failure is
/// the stream's sticky error, reported by the next wait (as a GPU reports a kernel fault).
///
/// # Safety
/// As `CudaBackend::launch`: `args` points at one value per kernel parameter, of the
/// parameter's type, and device pointers in them are live host allocations of the pool holding
/// what the kernel accesses, until the stream has run the kernel.
#[cfg(ferro_emu)]
pub(crate) unsafe fn launch(i: usize, name: &'static str, cfg: Launch, args: &[Arg]) -> Result<Job> {
    // SAFETY: reads an immutable int defined by the generated translation unit.
    if i >= unsafe { ffi::ferro_emu_kernel_count } as usize {
        bail!(name, "kernel not in the emulator's table (a stale build?)");
    }
    // SAFETY: i is below `ferro_emu_kernel_count` (checked above), so the entry is inside the
    // immutable static array.
    let entry = unsafe { (*ffi::ferro_emu_kernels.as_ptr().add(i)).run };
    // Each value in its own 8-byte aligned words (every parameter type is at most 8-aligned).
    let values: Vec<Vec<u64>> = args
        .iter()
        .map(|a| {
            let mut w = vec![0u64; a.size.div_ceil(8)];
            // SAFETY: the caller's contract: a.ptr addresses a live value of a.size bytes.
            unsafe { std::ptr::copy_nonoverlapping(a.ptr as *const u8, w.as_mut_ptr() as *mut u8, a.size) };
            w
        })
        .collect();
    let reverse = REVERSE.with(|r| r.get());
    Ok(Box::new(move || {
        let Launch { grid, block, smem, .. } = cfg;
        let mut values = values;
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|w| w.as_mut_ptr() as *mut c_void).collect();
        let mut err = vec![0u8; 1024];
        // SAFETY: only stores an int into a thread_local of the runtime (this worker's).
        unsafe { ffi::ferro_emu_set_reverse(reverse as _) };
        // SAFETY: the launch's contract covers the values behind `ptrs` (copied above) and
        // the device memory they address; `err` is a writable buffer of the length passed,
        // which the runtime NUL-terminates within it.
        let rc = unsafe {
            ffi::ferro_emu_run(entry, grid.0, grid.1, grid.2, block, smem, ptrs.as_mut_ptr(), err.as_mut_ptr() as *mut _, err.len())
        };
        if rc != 0 {
            let msg = String::from_utf8_lossy(&err[..err.iter().position(|&c| c == 0).unwrap_or(err.len())]).into_owned();
            let what = if rc == 2 { "invalid launch configuration" } else { "kernel failed" };
            return Err(format!("{name}: {what} (emulator, grid {grid:?}, block {block}, {smem} B shared): {msg}"));
        }
        Ok(())
    }))
}
/// # Safety
/// Nothing runs: the emulator was not built.
#[cfg(not(ferro_emu))]
pub(crate) unsafe fn launch(_: usize, name: &'static str, _: Launch, _: &[Arg]) -> Result<Job> {
    bail!(name, "the CUDA emulator was not built")
}

thread_local! {
    /// `set_reverse_schedule` of this thread, handed to the worker with each launch.
    static REVERSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The kernel names of the emulator's table, in its order (checked against `Kernel` by the
/// kernels module's test).
#[cfg(all(test, ferro_emu))]
pub(crate) fn table_names() -> Vec<String> {
    // SAFETY: as in `launch`: the generated table has `ferro_emu_kernel_count` immutable
    // entries whose names are static NUL-terminated literals.
    unsafe {
        let n = ffi::ferro_emu_kernel_count as usize;
        let base = ffi::ferro_emu_kernels.as_ptr();
        (0..n).map(|i| std::ffi::CStr::from_ptr((*base.add(i)).name).to_string_lossy().into_owned()).collect()
    }
}

/// Launches from the calling thread visit a block's threads in reverse order at every scheduling
/// round (`true`) or in order. A race-free kernel gives the same bits either way.
pub(crate) fn set_reverse_schedule(on: bool) {
    REVERSE.with(|r| r.set(on));
}

/// cuBLASLt's checks for one matrix: positive sizes, ld >= rows (column-major), and that the
/// batch stride keeps entries inside what the caller passed (a zero stride broadcasts).
fn check(name: &str, m: &LtMatrix, batch: usize) -> Result<()> {
    if m.rows == 0 || m.cols == 0 {
        bail!("matmul", "cuBLASLt: matrix {name} is {}x{}", m.rows, m.cols);
    }
    if m.ld < m.rows as i64 {
        bail!("matmul", "cuBLASLt would reject matrix {name}: leading dimension {} < rows {}", m.ld, m.rows);
    }
    if batch > 1 && m.stride < 0 {
        bail!("matmul", "cuBLASLt: matrix {name} has a negative batch stride {}", m.stride);
    }
    Ok(())
}

/// What cuBLASLt checks when the call is made (before anything is queued).
pub(crate) fn lt_check(c: &LtCall) -> Result<()> {
    check("A", &c.a, c.batch)?;
    check("B", &c.b, c.batch)?;
    check("D", &c.d, c.batch)?;
    if let Some(x) = &c.c {
        check("C", x, c.batch)?;
        if (x.rows, x.cols, x.ld, x.stride) != (c.d.rows, c.d.cols, c.d.ld, c.d.stride) {
            bail!("matmul", "cuBLASLt would read C in D's layout, but C is {x:?} and D {:?}", c.d);
        }
    }
    if c.out_bf16 && !c.bf16 {
        bail!("matmul", "cuBLASLt has no f32 x f32 -> bf16 GEMM here");
    }
    let (m, n, k) = (c.d.rows, c.d.cols, c.k);
    let (a_m, a_k) = if c.ta { (c.a.cols, c.a.rows) } else { (c.a.rows, c.a.cols) };
    let (b_k, b_n) = if c.tb { (c.b.cols, c.b.rows) } else { (c.b.rows, c.b.cols) };
    if a_m != m || b_n != n || a_k != k || b_k != k {
        bail!("matmul", "cuBLASLt would reject the shapes: op(A) {a_m}x{a_k}, op(B) {b_k}x{b_n}, D {m}x{n}");
    }
    Ok(())
}

/// D = op(A) · op(B) (+ C) with cuBLASLt's semantics: column-major operands, op = transpose when
/// the flag is set, fp32 accumulation, C (D's type) added in fp32, the result rounded once to
/// the output type.
pub(crate) fn lt_matmul(c: &LtCall) -> Result<()> {
    lt_check(c)?;
    let (m, n, k) = (c.d.rows, c.d.cols, c.k);
    // Element (i, j) of a column-major matrix, or of its transpose.
    let at = |x: &LtMatrix, t: bool, i: usize, j: usize, base: i64| -> i64 {
        let (r, col) = if t { (j, i) } else { (i, j) };
        base + r as i64 + col as i64 * x.ld
    };
    let (mut acc, mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * k], vec![0f32; k * n]);
    for bi in 0..c.batch {
        let (ba, bb, bd) = (bi as i64 * c.a.stride, bi as i64 * c.b.stride, bi as i64 * c.d.stride);
        acc.iter_mut().for_each(|x| *x = 0.0);
        // SAFETY: emulated device pointers are host addresses of live pool blocks, aligned for
        // f32/bf16; `check` above refused negative lds and strides, and LtCall::plan checked
        // that the last element each matrix touches, (batch-1)*stride + (cols-1)*ld + rows-1,
        // lies inside its buffer (C's too, in D's layout), so every offset computed below is in
        // bounds. D does not alias A or B (the output is a fresh allocation or a gradient
        // buffer no operand reads); C is D itself (each element is read just before it is
        // written, below) or apart from it (plan refuses an overlap).
        unsafe {
            let load = |x: &LtMatrix, off: i64| -> f32 {
                if c.bf16 {
                    f32::from(*(x.ptr as *const bf16).offset(off as isize))
                } else {
                    *(x.ptr as *const f32).offset(off as isize)
                }
            };
            // op(A) (m, k) and op(B) (k, n) widened into dense column-major copies, so the
            // product's inner loop runs down contiguous columns (and vectorises): the same
            // products added in the same order (p ascending) for every element.
            for p in 0..k {
                for i in 0..m {
                    a[i + p * m] = load(&c.a, at(&c.a, c.ta, i, p, ba));
                }
            }
            for j in 0..n {
                for p in 0..k {
                    b[p + j * k] = load(&c.b, at(&c.b, c.tb, p, j, bb));
                }
            }
            for j in 0..n {
                let out = &mut acc[j * m..(j + 1) * m];
                for p in 0..k {
                    let bv = b[p + j * k];
                    for (o, &av) in out.iter_mut().zip(&a[p * m..(p + 1) * m]) {
                        *o += av * bv;
                    }
                }
            }
            for j in 0..n {
                for i in 0..m {
                    let off = (bd + i as i64 + j as i64 * c.d.ld) as isize;
                    let add = match &c.c {
                        Some(x) if c.out_bf16 => f32::from(*(x.ptr as *const bf16).offset(off)),
                        Some(x) => *(x.ptr as *const f32).offset(off),
                        None => 0.0,
                    };
                    let v = c.alpha * acc[i + j * m] + add;
                    if c.out_bf16 {
                        *(c.d.ptr as *mut bf16).offset(off) = bf16::from_f32(v);
                    } else {
                        *(c.d.ptr as *mut f32).offset(off) = v;
                    }
                }
            }
        }
    }
    Ok(())
}
