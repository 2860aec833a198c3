//! The GPU's execution: a driver context, its compute stream, the kernel module (the fatbin, or
//! the sources compiled by NVRTC at first use) and the cuBLASLt handle. With the profile on,
//! every launch is bracketed by two timing events on the compute stream.
use super::{CudaEvent, CudaStream, Exec};
use crate::err;
use crate::gemm::{Gemm, LtCall};
use crate::instrument::profile::{self, LaunchShape, TimedSpan};
use crate::launch::{Arg, Launch};
use crate::pool::{Mem, Pool};
use crate::KernelImage;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, PinnedHostSlice};
use ferrolm_tensor::{bail, Error, Result};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    /// Every op of the `Backend` trait is enqueued here.
    stream: Arc<CudaStream>,
    raw_stream: Arc<cudarc::driver::CudaStream>,
    module: Arc<CudaModule>,
    /// The kernels' function handles, indexed by `Kernel`, each looked up on its first launch.
    funcs: Box<[OnceLock<CudaFunction>]>,
    gemm: Mutex<Gemm>,
    sm_count: OnceLock<u32>,
}

/// A launch's two timing events, read back by the profile.
struct EventSpan {
    start: CudaEvent,
    end: CudaEvent,
}

impl TimedSpan for EventSpan {
    fn wait_end(&self) -> Result<()> {
        self.end.synchronize()
    }
    fn elapsed_ms(&self) -> Result<f32> {
        self.start.elapsed_ms(&self.end)
    }
}

impl Gpu {
    /// Opens device `ordinal`, creates its compute stream, loads the kernels and makes its pool.
    pub(crate) fn open(ordinal: usize, image: KernelImage) -> Result<(Gpu, Arc<Pool>)> {
        if !crate::is_available() {
            bail!("cuda", "no CUDA device available (libcuda missing, no driver, or no GPU)");
        }
        let n = crate::device_count();
        if ordinal >= n {
            bail!("cuda", "device cuda:{ordinal} does not exist ({n} device(s) visible)");
        }
        let ctx = CudaContext::new(ordinal).map_err(err("cuda"))?;
        // SAFETY: cudarc's event tracking orders its own CudaSlice buffers across streams; this
        // backend never uses CudaSlice for tensors: pool buffers are raw pointers ordered by its
        // own stream discipline (one compute stream, events for copy streams), so nothing
        // relies on the tracking being on. Called before any stream or buffer exists.
        unsafe { ctx.disable_event_tracking() };
        let raw_stream = ctx.new_stream().map_err(err("cuda"))?;
        let module = load_module(&ctx, image)?;
        let pool = Pool::new(Mem::Gpu(ctx.clone()));
        let gemm = Gemm::new(&ctx, &pool, &raw_stream)?;
        let funcs = (0..crate::KERNEL_COUNT).map(|_| OnceLock::new()).collect();
        let stream = Arc::new(CudaStream::Gpu(raw_stream.clone()));
        let gpu = Gpu { ordinal, ctx, stream, raw_stream, module, funcs, gemm: Mutex::new(gemm), sm_count: OnceLock::new() };
        Ok((gpu, pool))
    }

    /// The function handle of kernel `index`, looked up in the module on its first launch only.
    fn func(&self, index: usize, name: &'static str) -> Result<&CudaFunction> {
        let Some(slot) = self.funcs.get(index) else {
            bail!(name, "kernel index {index} is past the backend's table");
        };
        if let Some(f) = slot.get() {
            return Ok(f);
        }
        let f = self.module.load_function(name).map_err(|e| Error::new(name, format!("kernel not found in the image: {e:?}")))?;
        Ok(slot.get_or_init(|| f))
    }

    /// With the profile on: a timing event recorded on the compute stream before a launch
    /// (`profile_end` records its partner after it).
    fn profile_start(&self) -> Result<Option<CudaEvent>> {
        if profile::enabled() {
            self.timing_event().map(Some)
        } else {
            Ok(None)
        }
    }
    /// Records the launch `name` in the profile: timed between `start` and a new event, or
    /// counted when the profile was turned on in between.
    fn profile_end(&self, start: Option<CudaEvent>, name: &'static str, shape: LaunchShape) -> Result<()> {
        match start {
            Some(start) => {
                let end = self.timing_event()?;
                profile::timed(name, shape, Box::new(EventSpan { start, end }), self.sm_count(), &|| self.device_name());
            }
            None if profile::enabled() => profile::count(name, shape, self.sm_count(), &|| self.device_name()),
            None => {}
        }
        Ok(())
    }
}

impl Exec for Gpu {
    fn is_emulated(&self) -> bool {
        false
    }
    fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("cuda:{} ({e:?})", self.ordinal))
    }
    fn sm_count(&self) -> u32 {
        *self.sm_count.get_or_init(|| {
            self.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_or(132, |n| n.max(1) as u32)
        })
    }
    fn context(&self) -> Result<&Arc<CudaContext>> {
        Ok(&self.ctx)
    }
    fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn new_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(Arc::new(CudaStream::Gpu(self.ctx.new_stream().map_err(err("new_stream"))?)))
    }
    fn record_event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        let CudaStream::Gpu(s) = stream else { bail!("record_event", "a stream of another device kind") };
        let ev = self.ctx.new_event(None).map_err(err("record_event"))?;
        ev.record(s).map_err(err("record_event"))?;
        Ok(CudaEvent::Gpu(ev))
    }
    fn timing_event(&self) -> Result<CudaEvent> {
        let ev = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("timing_event"))?;
        ev.record(&self.raw_stream).map_err(err("timing_event"))?;
        Ok(CudaEvent::Gpu(ev))
    }
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(err("cuda"))
    }

    unsafe fn launch(&self, index: usize, name: &'static str, cfg: Launch, args: &mut [Arg]) -> Result<()> {
        let Launch { grid, block, smem, elems } = cfg;
        let shape = LaunchShape { grid, block, elems };
        let timer = self.profile_start()?;
        self.bind()?;
        let f = self.func(index, name)?;
        if smem > 48 * 1024 {
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| Error::new(name, format!("cannot enable {smem} bytes of shared memory: {e:?}")))?;
        }
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.ptr).collect();
        // SAFETY: the caller's contract: one pointer per parameter, of its type, and live device
        // memory behind every device pointer until the stream has run the kernel.
        unsafe { result::launch_kernel(f.cu_function(), grid, (block, 1, 1), smem, self.stream.cu_stream(), &mut ptrs) }
            .map_err(|e| Error::new(name, format!("launch failed: {e:?}")))?;
        self.profile_end(timer, name, shape)
    }

    fn gemm(&self, call: LtCall, name: &'static str, shape: LaunchShape) -> Result<()> {
        self.bind()?;
        let timer = self.profile_start()?;
        self.gemm.lock().unwrap_or_else(|e| e.into_inner()).run(&self.raw_stream, &call)?;
        self.profile_end(timer, name, shape)
    }

    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract gives the destination room for the bytes of src; a
        // pageable source is staged by the driver before the call returns, so src may be dropped
        // afterwards.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(err("upload"))
    }

    #[track_caller]
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: the source range lies inside a live block (the caller's contract) and dst has
        // room for it; dst is neither read nor dropped before the synchronize below.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(err("download"))?;
        self.stream.synchronize()
    }

    unsafe fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the range lies inside a live block (the caller's contract), which stays alive
        // until the stream has run the memset (pool blocks are reused only in stream order).
        unsafe { result::memset_d8_async(dst, byte, bytes, self.stream.cu_stream()) }.map_err(err("memset"))
    }

    unsafe fn copy_dtod(&self, op: &'static str, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let shape = LaunchShape { grid: (1, 1, 1), block: 0, elems: 0 };
        self.bind()?;
        let timer = self.profile_start()?;
        // SAFETY: both ranges lie inside their buffers (the caller's contract), which stay alive
        // until the stream has run the copy (pool blocks are reused in stream order).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(|e| Error::new(op, format!("{e:?}")))?;
        self.profile_end(timer, "memcpy_dtod", shape)
    }

    fn pinned_host(&self, bytes: usize) -> Result<Option<PinnedHostSlice<u8>>> {
        self.bind()?;
        // SAFETY: cuMemHostAlloc of bytes.max(1) bytes with flags 0 (plain page-locked, not
        // write-combined: the host reads it) on the bound context; the memory is uninitialised,
        // and is zeroed below before anything reads it.
        let mut p = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }.map_err(err("alloc_pinned"))?;
        p.as_mut_slice().map_err(err("alloc_pinned"))?.fill(0);
        Ok(Some(p))
    }
}

fn load_module(ctx: &Arc<CudaContext>, image: KernelImage) -> Result<Arc<CudaModule>> {
    let ptx = match image {
        KernelImage::Fatbin(b) => cudarc::nvrtc::Ptx::from_binary(b.to_vec()),
        KernelImage::Sources(srcs) => {
            let (maj, min) = ctx.compute_capability().map_err(err("nvrtc"))?;
            compile_sources(srcs, &format!("compute_{maj}{min}"))?
        }
    };
    ctx.load_module(ptx).map_err(|e| Error::new("cuda", format!("loading the kernel image failed (wrong GPU architecture?): {e:?}")))
}

/// The kernel sources as the one translation unit NVRTC compiles: every `.cu` in order, with
/// each `#include "x"` of an embedded file replaced by its text the first time (the files use
/// `#pragma once`). Other includes stay for the preprocessor (e.g. the emulator's header, behind
/// `#ifdef FERRO_EMU`).
pub fn nvrtc_translation_unit(srcs: &[(&str, &str)]) -> Result<String> {
    fn expand(name: &str, srcs: &[(&str, &str)], done: &mut Vec<String>, out: &mut String, depth: usize) -> Result<()> {
        if done.iter().any(|d| d == name) {
            return Ok(());
        }
        let Some((_, text)) = srcs.iter().find(|(n, _)| *n == name) else {
            bail!("nvrtc", "kernel source {name} is included but not embedded");
        };
        if depth > 16 {
            bail!("nvrtc", "#include nesting too deep at {name}");
        }
        done.push(name.to_string());
        out.push_str(&format!("// ---- {name}\n"));
        for line in text.lines() {
            let t = line.trim_start();
            let inc = t.strip_prefix("#include \"").and_then(|r| r.split('"').next());
            if let Some(inc) = inc.filter(|i| srcs.iter().any(|(n, _)| n == i)) {
                expand(inc, srcs, done, out, depth + 1)?;
            } else if !t.starts_with("#pragma once") {
                out.push_str(line);
                out.push('\n');
            }
        }
        Ok(())
    }
    let (mut done, mut out) = (Vec::new(), String::new());
    for (name, _) in srcs.iter().filter(|(n, _)| n.ends_with(".cu")) {
        expand(name, srcs, &mut done, &mut out, 0)?;
    }
    Ok(out)
}

/// Compiles the kernel sources with NVRTC for `arch` (e.g. "compute_90"). Needs libnvrtc on
/// the library path, not a GPU.
pub fn compile_sources(srcs: &[(&str, &str)], arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    let all = nvrtc_translation_unit(srcs)?;
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions { arch: Some(arch), options: vec!["-std=c++17".into(), "-DFERRO_NVRTC".into()], ..Default::default() };
    compile_ptx_with_opts(all, opts).map_err(|e| Error::new("nvrtc", format!("compiling kernels/ failed: {e}")))
}
