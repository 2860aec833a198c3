//! CUDA kernel benchmark: every kernel's median GPU time against its floor.
//!
//! Floors are measured first on the same device: the device-to-device copy bandwidth (a dense
//! `copy_strided`, which the engine runs as one cuMemcpyDtoD; bytes moved / bandwidth) and the cuBLASLt bf16 GEMM peak at 8192^3 (FLOPs / peak). Each row
//! is the median of >= 10 timed repetitions (CUDA events on the compute stream) after warm-up,
//! on fresh random inputs (never zeros). Kernels are called through the `Backend` trait and the
//! fused ops' storage-level functions (`ferrolm::ops::<op>::forward` / `backward`) directly (no
//! autograd bookkeeping), so the time is the kernels' plus the engine's launch overhead.
//!
//! Output: a markdown table on stdout; with `$OUT` set also `$OUT/bench_cuda.md` and
//! `$OUT/bench_cuda.json` (`attention_fwd_bwd_ms: {key: ms}`, joined by
//! `scripts/bench_attention_torch.py --ours $OUT/bench_cuda.json`; `attention_w4_*` the same
//! for the 4-warp flash kernels, timed beside the default 8-warp ones).
//!
//!   cargo run --release --example bench_cuda [-- --reps 20 --quick]   (`--help` lists the flags)
//!   ... -- --attention 4,16,16,2048,128   (attention only, at that shape: for Nsight Compute)
//!   ... -- --attention-only               (attention only, at its eight shapes)
//!   on a GPU host: .gpu/run bin/bench_cuda
//!
//! With no CUDA device it prints "skipped: no CUDA device" and exits 0 (1 with
//! FERROLM_REQUIRE_GPU=1).
use anyhow::anyhow;
use ferrolm::cli::BenchCudaArgs;
use ferrolm::ops::nf4::{dequantize_cuda, DeviceQuant4, OrigDtype, Quant4, QuantSpec};
use ferrolm::ops::{attention, bias, cross_entropy, embedding, rmsnorm, rope, softcap, softmax, swiglu, AttnDims, Glu};
use ferrolm::tensor::backend::{Backend, BinaryOp, ReduceOp, UnaryOp, View};
use ferrolm::tensor::{bf16, CpuStorage, DType, Device, Layout, Rng, Shape, Storage};
use ferrolm::AnyResult;
use ferrolm_cuda::CudaBackend;
use std::fmt::Write as _;
use std::sync::Arc;

/// A device buffer with its (contiguous) layout.
struct Buf {
    s: Storage,
    l: Layout,
}
impl Buf {
    fn sl(&self) -> View<'_> {
        (&self.s, &self.l)
    }
}

/// Approximately N(0, std^2), fast enough for large inputs: the sum of four 16-bit uniforms
/// from one draw.
fn fast_normal(rng: &mut Rng, std: f32) -> f32 {
    let r = rng.next_u64();
    let s: f32 = (0..4).map(|i| ((r >> (16 * i)) & 0xFFFF) as f32 / 65536.0).sum();
    (s - 2.0) * 1.732_050_8 * std
}

struct Bench {
    be: Arc<CudaBackend>,
    rng: Rng,
    reps: usize,
}

fn layout(shape: &[usize]) -> Layout {
    Layout::contiguous(Shape(shape.to_vec()))
}

impl Bench {
    fn randn(&mut self, shape: &[usize], dt: DType, std: f32) -> AnyResult<Buf> {
        let n: usize = shape.iter().product();
        let cpu = match dt {
            DType::BF16 => CpuStorage::BF16((0..n).map(|_| bf16::from_f32(fast_normal(&mut self.rng, std))).collect()),
            DType::F32 => CpuStorage::F32((0..n).map(|_| fast_normal(&mut self.rng, std)).collect()),
            d => return Err(anyhow!("randn: {d} not supported")),
        };
        Ok(Buf { s: self.be.from_cpu(&cpu)?, l: layout(shape) })
    }
    fn ids(&mut self, n: usize, below: usize) -> AnyResult<Buf> {
        let v: Vec<i32> = (0..n).map(|_| self.rng.below(below as u64) as i32).collect();
        Ok(Buf { s: self.be.from_cpu(&CpuStorage::I32(v))?, l: layout(&[n]) })
    }
    fn scalar_f32(&mut self, v: f32) -> AnyResult<Buf> {
        Ok(Buf { s: self.be.from_cpu(&CpuStorage::F32(vec![v]))?, l: layout(&[]) })
    }

    /// Median GPU milliseconds of one call of `f`: 3 warm-up calls, then `reps` timed
    /// repetitions, each of `inner` back-to-back calls between two events (inner chosen so a
    /// repetition lasts about 1 ms, which hides event resolution for the small kernels).
    fn time(&self, mut f: impl FnMut() -> AnyResult<()>) -> AnyResult<f64> {
        let be = &self.be;
        for _ in 0..3 {
            f()?;
        }
        be.synchronize()?;
        let ev = |e: ferrolm_cuda::CudaEvent, g: ferrolm_cuda::CudaEvent| -> AnyResult<f64> {
            Ok(e.elapsed_ms(&g).map_err(|x| anyhow!("event timing failed: {x:?}"))? as f64)
        };
        let a = be.timing_event()?;
        f()?;
        let b = be.timing_event()?;
        let one = ev(a, b)?;
        let inner = ((1.0 / one.max(1e-4)).ceil() as usize).clamp(1, 100);
        let mut v = Vec::with_capacity(self.reps);
        for _ in 0..self.reps {
            let a = be.timing_event()?;
            for _ in 0..inner {
                f()?;
            }
            let b = be.timing_event()?;
            v.push(ev(a, b)? / inner as f64);
        }
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        Ok(v[v.len() / 2])
    }
}

/// Forward, backward and forward+backward ms of one attention shape.
type FwdBwd = (f64, f64, f64);
/// (shape key, the default 8-warp flash kernels' times, the 4-warp kernels' times).
type AttnTimes = (String, FwdBwd, FwdBwd);

/// One table row: floor from bytes (over the copy bandwidth) or FLOPs (over the GEMM peak).
struct Row {
    name: String,
    shape: String,
    ms: f64,
    bytes: f64,
    flops: f64,
    floor_ms: f64,
}

fn civil_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    // Howard Hinnant's days_from_civil inverse.
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}")
}

fn attn_key(b: usize, hq: usize, hkv: usize, t: usize, d: usize) -> String {
    format!("b{b}_hq{hq}_hkv{hkv}_t{t}_d{d}")
}

/// A size: tiny on the emulator, else the `--quick` or the full one.
fn pick<T>(tiny: bool, quick: bool, q: T, full: T, t: T) -> T {
    if tiny {
        t
    } else if quick {
        q
    } else {
        full
    }
}

fn main() {
    ferrolm::cli::main_with(run)
}

fn run(args: BenchCudaArgs) -> AnyResult<()> {
    let (quick, reps) = (args.quick, args.reps as usize);
    let emulator = std::env::var("FERROLM_CUDA_EMULATOR").is_ok_and(|v| v == "1");
    if ferrolm_cuda::device_count() == 0 && !emulator {
        println!("skipped: no CUDA device");
        if std::env::var("FERROLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            return Err(anyhow!("FERROLM_REQUIRE_GPU=1 but no CUDA device is available"));
        }
        return Ok(());
    }
    ferrolm::init_cuda(0)?;
    let be = CudaBackend::latest(0).ok_or_else(|| anyhow!("init_cuda(0) succeeded but no live CUDA backend was found"))?;
    let device = be.device_name();
    // The emulator runs every kernel on the CPU: tiny shapes, to rehearse this program (its
    // timings mean nothing).
    let tiny = be.is_emulated();
    if tiny {
        println!("emulator: tiny shapes; the timings below are not GPU measurements\n");
    }
    let date = civil_date();
    println!(
        "# ferrolm CUDA kernel benchmark\n\ndevice: {device}  \ndate: {date}  \nreps: {reps} (median), kernels image: {}\n",
        if ferrolm::kernels_image::FATBIN.is_some() { "nvcc fatbin" } else { "NVRTC sources" }
    );
    let mut bn = Bench { be: be.clone(), rng: Rng::new(0x5EED_F00D), reps };
    let bf = DType::BF16;

    // ---- floors ---------------------------------------------------------------------------
    let copy_n: usize = pick(tiny, quick, 64 << 20, 512 << 20, 1 << 16); // bf16 elements (1 GiB full)
    let src = bn.randn(&[copy_n], bf, 1.0)?;
    let copy_ms = bn.time(|| {
        be.copy_strided(src.sl())?;
        Ok(())
    })?;
    let copy_bytes = 2.0 * copy_n as f64 * 2.0;
    let bw = copy_bytes / (copy_ms * 1e-3); // bytes/s
    drop(src);
    let g = pick(tiny, quick, 4096, 8192, 64);
    let (ga, gb) = (bn.randn(&[g, g], bf, 1.0)?, bn.randn(&[g, g], bf, 1.0)?);
    let gemm_ms = bn.time(|| {
        be.matmul(ga.sl(), gb.sl())?;
        Ok(())
    })?;
    let gemm_flops = 2.0 * (g as f64).powi(3);
    let peak = gemm_flops / (gemm_ms * 1e-3); // FLOP/s
    drop((ga, gb));
    be.empty_cache()?;
    let mut md = String::new();
    writeln!(md, "# ferrolm CUDA kernel benchmark\n\ndevice: {device}  \ndate: {date}  \nreps: {reps} (median of CUDA-event timings after warm-up)\n")?;
    writeln!(md, "## Floors\n\n| floor | shape | ms | rate |\n|---|---|---:|---:|")?;
    writeln!(md, "| device copy (cuMemcpyDtoD through copy_strided, bf16) | {copy_n} elems | {copy_ms:.3} | {:.0} GB/s |", bw / 1e9)?;
    writeln!(md, "| cuBLASLt bf16 GEMM | {g}x{g}x{g} | {gemm_ms:.3} | {:.1} TFLOP/s |", peak / 1e12)?;
    print!("{}", md.split_once("## Floors").map(|x| format!("## Floors{}", x.1)).unwrap_or_default());
    use std::io::Write as _;
    std::io::stdout().flush().ok();

    let mut rows: Vec<Row> = Vec::new();
    let mut head_md = String::new();
    let push = |rows: &mut Vec<Row>, name: &str, shape: String, ms: f64, bytes: f64, flops: f64| {
        let floor_ms = if flops > 0.0 { flops / peak * 1e3 } else { bytes / bw * 1e3 };
        let gbps = bytes / (ms * 1e-3) / 1e9;
        println!("{name:<34} {shape:<28} {ms:>9.4} ms  {gbps:>7.0} GB/s  floor {floor_ms:>9.4} ms  ratio {:.2}", floor_ms / ms);
        rows.push(Row { name: name.into(), shape, ms, bytes, flops, floor_ms });
    };

    // ---- memory-bound kernels -------------------------------------------------------------
    // (skipped with --attention and --attention-only)
    if args.attention.is_empty() && !args.attention_only {
        let (r, c) = pick(tiny, quick, (4096, 4096), (8192, 8192), (64, 64));
        let n = r * c;
        {
            let (a, b) = (bn.randn(&[r, c], bf, 1.0)?, bn.randn(&[r, c], bf, 1.0)?);
            let ms = bn.time(|| {
                be.binary(BinaryOp::Add, a.sl(), b.sl())?;
                Ok(())
            })?;
            push(&mut rows, "add (bf16)", format!("({r}, {c})"), ms, 3.0 * n as f64 * 2.0, 0.0);
            let ms = bn.time(|| {
                be.unary(UnaryOp::Silu, a.sl())?;
                Ok(())
            })?;
            push(&mut rows, "silu (bf16)", format!("({r}, {c})"), ms, 2.0 * n as f64 * 2.0, 0.0);
            let ms = bn.time(|| {
                be.reduce(ReduceOp::Sum, a.sl(), &[1])?;
                Ok(())
            })?;
            push(&mut rows, "sum over last dim (bf16)", format!("({r}, {c})"), ms, (n + r) as f64 * 2.0, 0.0);
            let ms = bn.time(|| {
                be.reduce(ReduceOp::Sum, a.sl(), &[0])?;
                Ok(())
            })?;
            push(&mut rows, "sum over first dim (bf16)", format!("({r}, {c})"), ms, (n + c) as f64 * 2.0, 0.0);
            {
                // A gradient bucket's full sum, and a column sum, in f32.
                let nb: usize = pick(tiny, quick, 24_600_000, 24_600_000, 1 << 16);
                let v = bn.randn(&[nb], DType::F32, 1.0)?;
                let ms = bn.time(|| {
                    be.reduce(ReduceOp::Sum, v.sl(), &[0])?;
                    Ok(())
                })?;
                push(&mut rows, "full sum (f32)", format!("({nb})"), ms, nb as f64 * 4.0, 0.0);
                let (cr, cc) = pick(tiny, quick, (6000, 4096), (6000, 4096), (64, 96));
                let m = bn.randn(&[cr, cc], DType::F32, 1.0)?;
                let ms = bn.time(|| {
                    be.reduce(ReduceOp::Sum, m.sl(), &[0])?;
                    Ok(())
                })?;
                push(&mut rows, "column sum (f32)", format!("({cr}, {cc})"), ms, (cr * cc + cc) as f64 * 4.0, 0.0);
            }
            let tl = transpose_layout(&a.l);
            let ms = bn.time(|| {
                be.copy_strided((&a.s, &tl))?;
                Ok(())
            })?;
            push(&mut rows, "transpose copy (bf16)", format!("({c}, {r})^T"), ms, 2.0 * n as f64 * 2.0, 0.0);
            let ms = bn.time(|| {
                softmax::forward(a.sl())?;
                Ok(())
            })?;
            push(&mut rows, "softmax fwd (bf16)", format!("({r}, {c})"), ms, 2.0 * n as f64 * 2.0, 0.0);
            let y = Buf { s: softmax::forward(a.sl())?, l: a.l.clone() };
            let ms = bn.time(|| {
                softmax::backward(y.sl(), b.sl())?;
                Ok(())
            })?;
            push(&mut rows, "softmax bwd (bf16)", format!("({r}, {c})"), ms, 3.0 * n as f64 * 2.0, 0.0);
        }
        be.empty_cache()?;
        {
            // The gradient GEMMs of a linear layer (the 124M model's gate/up projection: N
            // tokens, in 768, out 2048), before and after they summed and cast their results:
            // dW = G^T X written as bf16 then cast into f32, against written as f32 in one GEMM;
            // dX = G W written then added to x's gradient so far, against added in the GEMM.
            let (nt, cin, cout) = pick(tiny, quick, (4096, 768, 2048), (8192, 768, 2048), (64, 32, 48));
            let (gr, x, w, acc) = (
                bn.randn(&[nt, cout], bf, 1.0)?,
                bn.randn(&[nt, cin], bf, 1.0)?,
                bn.randn(&[cout, cin], bf, 1.0)?,
                bn.randn(&[nt, cin], bf, 1.0)?,
            );
            let gt = Layout { shape: Shape(vec![cout, nt]), strides: vec![1, cout], offset: 0 }; // G^T, a view
            let flops = 2.0 * (nt * cin * cout) as f64;
            let (nw, nx) = ((cout * cin) as f64, (nt * cin) as f64);
            let ab = 2.0 * ((nt * cout) + (nt * cin)) as f64; // G and X read, bf16
            let ms = bn.time(|| {
                let dw = be.matmul((&gr.s, &gt), x.sl())?;
                be.cast((&dw, &layout(&[cout, cin])), DType::F32)?;
                Ok(())
            })?;
            let shape = format!("({nt}, {cout})^T ({nt}, {cin})");
            push(&mut rows, "dW gemm, then cast to f32 (before)", shape.clone(), ms, ab + nw * (2.0 + 2.0 + 4.0), flops);
            let mut dest = be.empty(cout * cin, DType::F32)?;
            let dl = layout(&[cout, cin]);
            let ms = bn.time(|| {
                be.matmul_into((&gr.s, &gt), x.sl(), 1.0, None, &mut dest, &dl)?;
                Ok(())
            })?;
            push(&mut rows, "dW gemm into f32 (now)", shape, ms, ab + nw * 4.0, flops);
            let ms = bn.time(|| {
                let dx = be.matmul(gr.sl(), w.sl())?;
                be.binary(BinaryOp::Add, acc.sl(), (&dx, &layout(&[nt, cin])))?;
                Ok(())
            })?;
            let shape = format!("({nt}, {cout}) ({cout}, {cin}) + acc");
            let gw = 2.0 * ((nt * cout) + (cout * cin)) as f64; // G and W read, bf16
            push(&mut rows, "dX gemm, then add (before)", shape.clone(), ms, gw + nx * (2.0 + 2.0 + 2.0 + 2.0), flops);
            let mut out = be.empty(nt * cin, bf)?;
            let ol = layout(&[nt, cin]);
            let ms = bn.time(|| {
                be.matmul_into(gr.sl(), w.sl(), 1.0, Some(acc.sl()), &mut out, &ol)?;
                Ok(())
            })?;
            push(&mut rows, "dX gemm with the addend (now)", shape, ms, gw + nx * (2.0 + 2.0), flops);
        }
        be.empty_cache()?;
        {
            let (rn, d) = pick(tiny, quick, (4096, 4096), (16384, 4096), (64, 64));
            let x = bn.randn(&[rn, d], bf, 1.0)?;
            let w = bn.randn(&[d], bf, 1.0)?;
            let dy = bn.randn(&[rn, d], bf, 1.0)?;
            let ms = bn.time(|| {
                rmsnorm::forward(x.sl(), w.sl(), 1e-5, 0.0)?;
                Ok(())
            })?;
            let nn = (rn * d) as f64;
            push(&mut rows, "rmsnorm fwd (bf16)", format!("({rn}, {d})"), ms, 2.0 * nn * 2.0 + rn as f64 * 4.0, 0.0);
            let (_y, inv) = rmsnorm::forward(x.sl(), w.sl(), 1e-5, 0.0)?;
            let inv = Buf { s: inv, l: layout(&[rn]) };
            let ms = bn.time(|| {
                rmsnorm::backward(dy.sl(), x.sl(), w.sl(), inv.sl(), 0.0)?;
                Ok(())
            })?;
            push(&mut rows, "rmsnorm bwd (bf16)", format!("({rn}, {d})"), ms, 3.0 * nn * 2.0 + rn as f64 * 4.0, 0.0);
        }
        be.empty_cache()?;
        {
            // QK-norm (Qwen3, Gemma 3: Gemma's (1 + w)): B·T·H rows of the head dim.
            let (rn, d) = pick(tiny, quick, (2 * 2048 * 16, 128), (4 * 4096 * 32, 128), (256, 64));
            let x = bn.randn(&[rn, d], bf, 1.0)?;
            let w = bn.randn(&[d], bf, 0.1)?;
            let dy = bn.randn(&[rn, d], bf, 1.0)?;
            let nn = (rn * d) as f64;
            let ms = bn.time(|| {
                rmsnorm::forward(x.sl(), w.sl(), 1e-6, 1.0)?;
                Ok(())
            })?;
            push(&mut rows, "qk-norm (1 + w) fwd (bf16)", format!("({rn}, {d})"), ms, 2.0 * nn * 2.0 + rn as f64 * 4.0, 0.0);
            let (_y, inv) = rmsnorm::forward(x.sl(), w.sl(), 1e-6, 1.0)?;
            let inv = Buf { s: inv, l: layout(&[rn]) };
            let ms = bn.time(|| {
                rmsnorm::backward(dy.sl(), x.sl(), w.sl(), inv.sl(), 1.0)?;
                Ok(())
            })?;
            push(&mut rows, "qk-norm (1 + w) bwd (bf16)", format!("({rn}, {d})"), ms, 3.0 * nn * 2.0 + rn as f64 * 4.0, 0.0);
        }
        be.empty_cache()?;
        {
            let (b, h, t, d) = pick(tiny, quick, (2, 16, 2048, 128), (4, 32, 4096, 128), (1, 2, 64, 64));
            let x = bn.randn(&[b, h, t, d], bf, 1.0)?;
            let cos = bn.randn(&[t, d], bf, 0.7)?;
            let sin = bn.randn(&[t, d], bf, 0.7)?;
            let nn = (b * h * t * d) as f64;
            let ms = bn.time(|| {
                rope::apply(x.sl(), cos.sl(), sin.sl(), None, false)?;
                Ok(())
            })?;
            push(&mut rows, "rope fwd (bf16)", format!("({b}, {h}, {t}, {d})"), ms, 2.0 * nn * 2.0 + 2.0 * (t * d) as f64 * 2.0, 0.0);
            let ms = bn.time(|| {
                rope::apply(x.sl(), cos.sl(), sin.sl(), None, true)?;
                Ok(())
            })?;
            push(&mut rows, "rope bwd (bf16)", format!("({b}, {h}, {t}, {d})"), ms, 2.0 * nn * 2.0 + 2.0 * (t * d) as f64 * 2.0, 0.0);
        }
        be.empty_cache()?;
        {
            let (rn, f) = pick(tiny, quick, (2048, 11008), (8192, 11008), (64, 128));
            let gt = bn.randn(&[rn, f], bf, 1.0)?;
            let up = bn.randn(&[rn, f], bf, 1.0)?;
            let dy = bn.randn(&[rn, f], bf, 1.0)?;
            let nn = (rn * f) as f64;
            let ms = bn.time(|| {
                swiglu::forward(gt.sl(), up.sl(), Glu::Silu)?;
                Ok(())
            })?;
            push(&mut rows, "swiglu fwd (bf16)", format!("({rn}, {f})"), ms, 3.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                swiglu::backward(dy.sl(), gt.sl(), up.sl(), Glu::Silu)?;
                Ok(())
            })?;
            push(&mut rows, "swiglu bwd (bf16)", format!("({rn}, {f})"), ms, 5.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                swiglu::forward(gt.sl(), up.sl(), Glu::GeluTanh)?;
                Ok(())
            })?;
            push(&mut rows, "geglu (gelu_tanh) fwd (bf16)", format!("({rn}, {f})"), ms, 3.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                swiglu::backward(dy.sl(), gt.sl(), up.sl(), Glu::GeluTanh)?;
                Ok(())
            })?;
            push(&mut rows, "geglu (gelu_tanh) bwd (bf16)", format!("({rn}, {f})"), ms, 5.0 * nn * 2.0, 0.0);
            // Logit softcapping over the same elements, and the bias of a projection of f outputs.
            let ms = bn.time(|| {
                softcap::forward(gt.sl(), 30.0)?;
                Ok(())
            })?;
            push(&mut rows, "softcap fwd (bf16)", format!("({rn}, {f})"), ms, 2.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                softcap::backward(dy.sl(), gt.sl(), 30.0)?;
                Ok(())
            })?;
            push(&mut rows, "softcap bwd (bf16)", format!("({rn}, {f})"), ms, 3.0 * nn * 2.0, 0.0);
            let b = bn.randn(&[f], bf, 1.0)?;
            let ms = bn.time(|| {
                bias::forward(gt.sl(), b.sl())?;
                Ok(())
            })?;
            push(&mut rows, "bias add fwd (bf16)", format!("({rn}, {f})"), ms, 2.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                bias::backward(dy.sl(), f)?;
                Ok(())
            })?;
            push(&mut rows, "bias grad db (bf16)", format!("({rn}, {f})"), ms, nn * 2.0, 0.0);
        }
        be.empty_cache()?;
        {
            // QLoRA's dequantize (kernels/nf4.cu, `nf4_dequant_*`): an NF4 weight with double
            // quantization to bf16 and to f32 in one launch, at an 8B Llama's q_proj (4096 x 4096)
            // and (not --quick) its gate/up/down (14336 x 4096). Bytes: the packed codes (n / 2),
            // the absmax codes (n / 64), the nested f32 scales (n / 16384) and the code books
            // read, as the device copy holds them (16-byte padded); the weight written.
            let shapes = pick(tiny, quick, vec![(4096, 4096)], vec![(4096, 4096), (14336, 4096)], vec![(64, 512)]);
            for (o, i) in shapes {
                let n = o * i;
                let w: Vec<f32> = (0..n).map(|_| fast_normal(&mut bn.rng, 0.02)).collect();
                let q = Quant4::quantize("w", &w, &[o, i], OrigDtype::BF16, QuantSpec::QLORA)?;
                drop(w);
                let dq = DeviceQuant4::upload(&q, "w", Device::Cuda(0))?;
                let read = [&dq.packed, &dq.codes, &dq.absmax, &dq.tables].iter().map(|t| t.numel() * 4).sum::<usize>() as f64;
                for (dt, name, eb) in [(DType::BF16, "nf4_dequant (bf16)", 2.0), (DType::F32, "nf4_dequant (f32)", 4.0)] {
                    let ms = bn.time(|| {
                        dequantize_cuda(&dq, dt)?;
                        Ok(())
                    })?;
                    push(&mut rows, name, format!("({o}, {i})"), ms, read + n as f64 * eb, 0.0);
                }
            }
        }
        be.empty_cache()?;
        {
            let (rn, v) = pick(tiny, quick, (2048, 32000), (8192, 32000), (64, 512));
            let x = bn.randn(&[rn, v], bf, 2.0)?;
            let t = bn.ids(rn, v)?;
            let scale = bn.scalar_f32(1.0 / rn as f32)?;
            let nn = (rn * v) as f64;
            let ms = bn.time(|| {
                cross_entropy::forward(x.sl(), t.sl(), -100)?;
                Ok(())
            })?;
            push(&mut rows, "cross-entropy fwd (bf16)", format!("({rn}, {v})"), ms, nn * 2.0, 0.0);
            let (_, lse, _) = cross_entropy::forward(x.sl(), t.sl(), -100)?;
            let lse = Buf { s: lse, l: layout(&[rn]) };
            let ms_b = bn.time(|| {
                cross_entropy::backward(x.sl(), t.sl(), lse.sl(), -100, scale.sl())?;
                Ok(())
            })?;
            push(&mut rows, "cross-entropy bwd (bf16)", format!("({rn}, {v})"), ms_b, 2.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                cross_entropy::forward(x.sl(), t.sl(), -100)?;
                cross_entropy::backward(x.sl(), t.sl(), lse.sl(), -100, scale.sl())?;
                Ok(())
            })?;
            push(&mut rows, "cross-entropy fwd+bwd (bf16)", format!("({rn}, {v})"), ms, 2.0 * nn * 2.0, 0.0);
            let ms = bn.time(|| {
                cross_entropy::forward_backward_cuda(&be, x.sl(), &t.s, -100, 1.0)?;
                Ok(())
            })?;
            push(&mut rows, "cross-entropy fused fwd+bwd (bf16)", format!("({rn}, {v})"), ms, 2.0 * nn * 2.0, 0.0);
        }
        be.empty_cache()?;
        {
            let (vocab, d, nt) = pick(tiny, quick, (32000, 2048, 4096), (32000, 4096, 16384), (512, 64, 128));
            let w = bn.randn(&[vocab, d], bf, 1.0)?;
            let ids = bn.ids(nt, vocab)?;
            let dy = bn.randn(&[nt, d], bf, 1.0)?;
            let ms = bn.time(|| {
                embedding::forward(w.sl(), ids.sl())?;
                Ok(())
            })?;
            push(&mut rows, "embedding fwd (bf16)", format!("V{vocab} d{d} n{nt}"), ms, 2.0 * (nt * d) as f64 * 2.0 + nt as f64 * 4.0, 0.0);
            let host_ids: Vec<i32> = match bn.be.to_cpu(ids.sl())? {
                CpuStorage::I32(v) => v,
                _ => anyhow::bail!("ids are not i32"),
            };
            // The training path: ids sorted once on the host, segment sums on the device.
            let ms = bn.time(|| {
                embedding::backward_sorted(dy.sl(), &host_ids, vocab)?;
                Ok(())
            })?;
            push(
                &mut rows,
                "embedding bwd (bf16)",
                format!("V{vocab} d{d} n{nt}"),
                ms,
                (nt * d) as f64 * 2.0 + (vocab * d) as f64 * 2.0 + nt as f64 * 4.0,
                0.0,
            );
        }
        be.empty_cache()?;
    }

    // ---- the LM head and its loss (issue 43) ------------------------------------------------
    // At the 124M shape (V 32000, hidden 768, 8 x 1024 tokens, untied) and Llama-3.2-1B's (V
    // 128256, hidden 2048, tied, 8 x 2048 tokens): unfused (the whole logits: the logits GEMM,
    // the fused cross-entropy writing dlogits, dX and dW GEMMs, dW in f32), fused in chunks of
    // the automatic size (`ops::head_loss`, forward and backward work in one call, dW into an
    // f32 destination), and the three GEMMs alone at the whole size (the floor the fused head is
    // held to: within 1.15x). FLOPs 6 N V C for each.
    if args.attention.is_empty() {
        use ferrolm::ops::{head_loss, head_loss::auto_chunk_tokens, HeadLossOptions, LossScale, Tokens};
        use ferrolm::Tensor;
        let shapes: Vec<(&str, usize, usize, usize)> = match (tiny, quick) {
            (true, _) => vec![("tiny", 256, 32, 1000)],
            (false, true) => vec![("124M", 4096, 768, 32000), ("1B", 4096, 2048, 128256)],
            (false, false) => vec![("124M", 8192, 768, 32000), ("1B", 16384, 2048, 128256)],
        };
        for (name, nt, c, v) in shapes {
            let flops = 6.0 * (nt * c) as f64 * v as f64;
            let shape = format!("{name}: N{nt} C{c} V{v}");
            let x = bn.randn(&[nt, c], bf, 1.0)?;
            let w = bn.randn(&[v, c], bf, 0.02)?;
            let host: Vec<i32> = (0..nt).map(|_| bn.rng.below(v as u64) as i32).collect();
            let t = Buf { s: be.from_cpu(&CpuStorage::I32(host.clone()))?, l: layout(&[nt]) };
            let wt = Layout { shape: Shape(vec![c, v]), strides: vec![1, c], offset: 0 }; // W^T, a view
            let (ll, lt) = (layout(&[nt, v]), Layout { shape: Shape(vec![v, nt]), strides: vec![1, v], offset: 0 });
            let (mut dw, dwl) = (be.empty(v * c, DType::F32)?, layout(&[v, c]));
            let unfused = bn.time(|| {
                let logits = be.matmul(x.sl(), (&w.s, &wt))?;
                let (_, _, dl) = cross_entropy::forward_backward_cuda(&be, (&logits, &ll), &t.s, -100, 1.0)?;
                drop(logits);
                let dl: Storage = dl.into();
                be.matmul((&dl, &ll), w.sl())?;
                be.matmul_into((&dl, &lt), x.sl(), 1.0, None, &mut dw, &dwl)?;
                Ok(())
            })?;
            let g = bn.randn(&[nt, v], bf, 1.0)?; // stands in for dlogits
            let gemms = bn.time(|| {
                be.matmul(x.sl(), (&w.s, &wt))?;
                be.matmul(g.sl(), w.sl())?;
                be.matmul_into((&g.s, &lt), x.sl(), 1.0, None, &mut dw, &dwl)?;
                Ok(())
            })?;
            drop((g, dw));
            be.empty_cache()?;
            let (xt, wt) = (Tensor::new(x.s, [nt, c])?, Tensor::new(w.s, [v, c])?);
            xt.set_requires_grad(true)?;
            wt.set_requires_grad(true)?;
            let dest = Tensor::empty([v, c], DType::F32, xt.device())?;
            wt.set_grad_dest(Some(Arc::new(move || Ok(Some(dest.clone())))));
            let tg = Tokens::upload(host, [nt], xt.device())?;
            let chunk = auto_chunk_tokens(v, 2).min(nt);
            let o = HeadLossOptions { ignore_index: -100, scale: LossScale::Mean, chunk_tokens: chunk };
            let fused = bn.time(|| {
                head_loss(&xt, &wt, &tg, &o)?;
                Ok(())
            })?;
            push(&mut rows, "head + loss unfused fwd+bwd (bf16)", shape.clone(), unfused, 0.0, flops);
            push(&mut rows, &format!("head + loss fused, chunks of {chunk} (bf16)"), shape.clone(), fused, 0.0, flops);
            push(&mut rows, "head + loss: its three GEMMs alone (bf16)", shape.clone(), gemms, 0.0, flops);
            let line = format!(
                "head + loss {shape}: fused {fused:.3} ms, unfused {unfused:.3} ms, three GEMMs {gemms:.3} ms: fused / unfused {:.2} \
                 (target <= 1), fused / GEMMs {:.2} (target <= 1.15)",
                fused / unfused,
                fused / gemms
            );
            println!("{line}");
            head_md.push_str(&format!("- {line}\n"));
            drop((xt, wt, tg));
            be.empty_cache()?;
        }
    }

    // ---- attention ------------------------------------------------------------------------
    let mut shapes = vec![
        (4, 16, 16, 1024, 128),
        (4, 16, 16, 2048, 128),
        (4, 16, 16, 4096, 128),
        (8, 32, 32, 2048, 64),
        (4, 32, 8, 2048, 128),
        (8, 32, 8, 2048, 64),
        (4, 16, 16, 8192, 128),
        (8, 32, 8, 1024, 64), // the 1B model's attention
    ];
    if quick {
        shapes.truncate(2);
    }
    if tiny {
        shapes = vec![(1, 2, 2, 64, 64), (1, 4, 2, 64, 64)];
    }
    if !args.attention.is_empty() {
        shapes = args.attention.clone();
    }
    let mut attn_json: Vec<AttnTimes> = Vec::new();
    let mut attn_md = String::from(
        "| key | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | floor ms | floor/time | 4 warps: fwd ms | bwd ms | fwd+bwd ms | fwd+bwd 8w/4w |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (b, hq, hkv, t, d) in shapes {
        let dims = AttnDims { b, hq, hkv, t, d };
        let q = bn.randn(&[b, hq, t, d], bf, 1.0)?;
        let k = bn.randn(&[b, hkv, t, d], bf, 1.0)?;
        let v = bn.randn(&[b, hkv, t, d], bf, 1.0)?;
        let dout = bn.randn(&[b, hq, t, d], bf, 1.0)?;
        let scale = 1.0 / (d as f64).sqrt();
        let (o, lse) = attention::forward(q.sl(), k.sl(), v.sl(), dims, scale, None)?;
        let (o, lse) = (Buf { s: o, l: layout(&[b, hq, t, d]) }, Buf { s: lse, l: layout(&[b, hq, t]) });
        // The flash kernels with 8 warps per block (the default), then with 4 (the `_w4` kernels):
        // which is faster per head dim is this table's question on a GPU.
        let time_all = |warps: usize| -> AnyResult<FwdBwd> {
            attention::with_flash_warps(warps, || {
                let fwd = bn.time(|| {
                    attention::forward(q.sl(), k.sl(), v.sl(), dims, scale, None)?;
                    Ok(())
                })?;
                let bwd = bn.time(|| {
                    attention::backward([dout.sl(), q.sl(), k.sl(), v.sl(), o.sl(), lse.sl()], dims, scale, None)?;
                    Ok(())
                })?;
                let both = bn.time(|| {
                    let (o2, l2) = attention::forward(q.sl(), k.sl(), v.sl(), dims, scale, None)?;
                    attention::backward([dout.sl(), q.sl(), k.sl(), v.sl(), (&o2, &o.l), (&l2, &lse.l)], dims, scale, None)?;
                    Ok(())
                })?;
                Ok((fwd, bwd, both))
            })?
        };
        let (fwd, bwd, both) = time_all(8)?;
        let w4 = time_all(4)?;
        // Causal: fwd 2·B·H·T²·D (half of 4·B·H·T²·D), bwd 2.5x the forward.
        let f_fwd = 2.0 * (b * hq) as f64 * (t as f64).powi(2) * d as f64;
        let f_all = 3.5 * f_fwd;
        let key = attn_key(b, hq, hkv, t, d);
        push(&mut rows, "attention fwd (bf16, causal)", key.clone(), fwd, 0.0, f_fwd);
        push(&mut rows, "attention bwd (bf16, causal)", key.clone(), bwd, 0.0, 2.5 * f_fwd);
        push(&mut rows, "attention fwd+bwd (bf16, causal)", key.clone(), both, 0.0, f_all);
        push(&mut rows, "attention fwd (bf16, causal, 4 warps)", key.clone(), w4.0, 0.0, f_fwd);
        push(&mut rows, "attention fwd+bwd (bf16, causal, 4 warps)", key.clone(), w4.2, 0.0, f_all);
        let floor = f_all / peak * 1e3;
        writeln!(
            attn_md,
            "| {key} | {fwd:.3} | {bwd:.3} | {both:.3} | {:.1} | {:.1} | {floor:.3} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} |",
            f_fwd / (fwd * 1e-3) / 1e12,
            f_all / (both * 1e-3) / 1e12,
            floor / both,
            w4.0,
            w4.1,
            w4.2,
            both / w4.2
        )?;
        attn_json.push((key, (fwd, bwd, both), w4));
        drop((q, k, v, dout, o, lse));
        be.empty_cache()?;
    }

    // ---- report ---------------------------------------------------------------------------
    writeln!(md, "\n## Kernels\n\nfloor = bytes / copy bandwidth for memory-bound kernels, FLOPs / GEMM peak for attention; ratio = floor / time (1.0 = at the floor).\n")?;
    writeln!(md, "| kernel | shape | median ms | GB or GFLOP | GB/s | floor ms | floor/time |\n|---|---|---:|---:|---:|---:|---:|")?;
    for r in &rows {
        let amount = if r.flops > 0.0 { format!("{:.1} GFLOP", r.flops / 1e9) } else { format!("{:.3} GB", r.bytes / 1e9) };
        let gbps = r.bytes / (r.ms * 1e-3) / 1e9;
        writeln!(md, "| {} | {} | {:.4} | {} | {gbps:.0} | {:.4} | {:.2} |", r.name, r.shape, r.ms, amount, r.floor_ms, r.floor_ms / r.ms)?;
    }
    if !head_md.is_empty() {
        writeln!(md, "\n## LM head + loss, fused in chunks against unfused and its GEMMs\n\n{head_md}")?;
    }
    writeln!(md, "\n## Attention fwd+bwd (join with scripts/bench_attention_torch.py)\n\n{attn_md}")?;
    println!("\n{md}");

    let mut js = String::from("{\n");
    let q = |s: &str| serde_json::to_string(s).unwrap();
    writeln!(js, "  \"device\": {},\n  \"date\": {},\n  \"reps\": {reps},", q(&device), q(&date))?;
    writeln!(js, "  \"copy_gbps\": {:.3},\n  \"gemm_bf16_tflops\": {:.3},", bw / 1e9, peak / 1e12)?;
    let obj =
        |f: &dyn Fn(&AttnTimes) -> f64| attn_json.iter().map(|x| format!("    {}: {:.6}", q(&x.0), f(x))).collect::<Vec<_>>().join(",\n");
    writeln!(js, "  \"attention_fwd_ms\": {{\n{}\n  }},", obj(&|x| x.1 .0))?;
    writeln!(js, "  \"attention_bwd_ms\": {{\n{}\n  }},", obj(&|x| x.1 .1))?;
    writeln!(js, "  \"attention_fwd_bwd_ms\": {{\n{}\n  }},", obj(&|x| x.1 .2))?;
    writeln!(js, "  \"attention_w4_fwd_ms\": {{\n{}\n  }},", obj(&|x| x.2 .0))?;
    writeln!(js, "  \"attention_w4_bwd_ms\": {{\n{}\n  }},", obj(&|x| x.2 .1))?;
    writeln!(js, "  \"attention_w4_fwd_bwd_ms\": {{\n{}\n  }},", obj(&|x| x.2 .2))?;
    let kr: Vec<String> = rows
        .iter()
        .map(|r| {
            let gbps = r.bytes / (r.ms * 1e-3) / 1e9;
            format!(
                "    {{\"kernel\": {}, \"shape\": {}, \"ms\": {:.6}, \"floor_ms\": {:.6}, \"gbps\": {gbps:.3}}}",
                q(&r.name),
                q(&r.shape),
                r.ms,
                r.floor_ms
            )
        })
        .collect();
    writeln!(js, "  \"kernels\": [\n{}\n  ]\n}}", kr.join(",\n"))?;
    if let Ok(out) = std::env::var("OUT") {
        std::fs::create_dir_all(&out)?;
        std::fs::write(format!("{out}/bench_cuda.md"), &md)?;
        std::fs::write(format!("{out}/bench_cuda.json"), &js)?;
        println!("wrote {out}/bench_cuda.md and {out}/bench_cuda.json");
    }
    let (cur, pk, cached) = be.memory_stats();
    println!(
        "pool: {:.2} GiB live, {:.2} GiB peak, {:.2} GiB cached, {} device allocations",
        cur as f64 / (1u64 << 30) as f64,
        pk as f64 / (1u64 << 30) as f64,
        cached as f64 / (1u64 << 30) as f64,
        be.device_allocations()
    );
    Ok(())
}

/// The layout of the transpose of a contiguous 2-D layout (a strided view, not a copy).
fn transpose_layout(l: &Layout) -> Layout {
    let d = l.dims().to_vec();
    let mut t = Layout::contiguous(Shape(vec![d[1], d[0]]));
    t.strides = vec![1, d[1]];
    t
}
