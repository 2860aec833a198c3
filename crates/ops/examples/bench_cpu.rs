//! CPU engine benchmark: the f32 FMA peak of one thread and of all; f32 GEMM through
//! `Tensor::matmul` next to ferrolm's `sgemm`, the same with A always packed, and
//! `matrixmultiply::sgemm` called directly (one thread, alternated call by call) on the same
//! shapes and strides; and forward+backward of a 2-layer Llama-style block stack built from
//! tensor ops.
//!
//!     cargo run --release -p ferrolm-ops --example bench_cpu   (`--help` for the details)
use clap::Parser;
use ferrolm_ops::{causal_attention, rms_norm, rope, swiglu};
use ferrolm_tensor::cpu::sgemm::{kernel_name as sgemm_kernel, sgemm, sgemm_packed, Gemm};
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use std::time::Instant;

/// Median seconds of each of `fs`, run in turn (so drift in the machine's speed hits them all),
/// over at least `min_reps` rounds and ~`budget` seconds, after one warm-up round.
fn median_secs_each(min_reps: usize, budget: f64, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    fs.iter_mut().for_each(|f| f());
    let mut ts = vec![Vec::new(); fs.len()];
    let start = Instant::now();
    while ts[0].len() < min_reps || (start.elapsed().as_secs_f64() < budget && ts[0].len() < 200) {
        for (f, t) in fs.iter_mut().zip(&mut ts) {
            let t0 = Instant::now();
            f();
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    ts.into_iter()
        .map(|mut t| {
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            t[t.len() / 2]
        })
        .collect()
}

/// Median seconds of `f` (`median_secs_each` of one).
fn median_secs(min_reps: usize, budget: f64, mut f: impl FnMut()) -> f64 {
    median_secs_each(min_reps, budget, &mut [&mut f])[0]
}

/// One GEMM shape: C (m, n) = A (m, k) @ B (k, n); with `ta` A is stored (k, m) (a transposed
/// view), with `tb` B is stored (n, k) (a Linear's `x @ W^T`). Returns GFLOP/s of
/// (Tensor::matmul, ferrolm's sgemm on one thread, the same with A always packed where the
/// AVX-512 GEMM runs, matrixmultiply::sgemm on one thread).
fn gemm_row(m: usize, k: usize, n: usize, ta: bool, tb: bool, rng: &mut Rng) -> (f64, f64, Option<f64>, f64) {
    let a_shape = if ta { [k, m] } else { [m, k] };
    let b_shape = if tb { [n, k] } else { [k, n] };
    let a = Tensor::randn(a_shape, 1.0, DType::F32, Device::Cpu, rng).unwrap();
    let b = Tensor::randn(b_shape, 1.0, DType::F32, Device::Cpu, rng).unwrap();
    let flops = 2.0 * (m * k * n) as f64;
    let _g = no_grad();
    let engine = median_secs(5, 0.6, || {
        let a = if ta { a.t().unwrap() } else { a.clone() };
        let b = if tb { b.t().unwrap() } else { b.clone() };
        std::hint::black_box(a.matmul(&b).unwrap());
    });
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let mut c = vec![0f32; m * n];
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // The two direct GEMMs alternate call by call, so drift in the machine's speed hits both.
    let (cp, ap, bp) = (c.as_mut_ptr(), av.as_ptr(), bv.as_ptr());
    let direct = |g: Gemm| {
        move || unsafe {
            g(m, k, n, 1.0, ap, rsa, csa, bp, rsb, csb, 0.0, cp, n as isize, 1);
            std::hint::black_box(cp);
        }
    };
    let (mut ours, mut theirs) = (direct(sgemm()), direct(matrixmultiply::sgemm));
    let gf = |t: f64| flops / t / 1e9;
    match sgemm_packed() {
        Some(packed) => {
            let mut packed = direct(packed);
            let t = median_secs_each(5, 1.8, &mut [&mut ours, &mut packed, &mut theirs]);
            (gf(engine), gf(t[0]), Some(gf(t[1])), gf(t[2]))
        }
        None => {
            let t = median_secs_each(5, 1.2, &mut [&mut ours, &mut theirs]);
            (gf(engine), gf(t[0]), None, gf(t[1]))
        }
    }
}

struct Layer {
    n1: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    n2: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
}

const B: usize = 4;
const T: usize = 128;
const DM: usize = 256;
const HQ: usize = 4;
const HD: usize = DM / HQ;
const HKV: usize = 2;
const FF: usize = 688;

fn layer(rng: &mut Rng) -> Layer {
    let w = |o: usize, i: usize, rng: &mut Rng| {
        let t = Tensor::randn([o, i], 1.0 / (i as f64).sqrt(), DType::F32, Device::Cpu, rng).unwrap();
        t.set_requires_grad(true).unwrap();
        t
    };
    let n = || {
        let t = Tensor::ones([DM], DType::F32, Device::Cpu).unwrap();
        t.set_requires_grad(true).unwrap();
        t
    };
    Layer {
        n1: n(),
        wq: w(HQ * HD, DM, rng),
        wk: w(HKV * HD, DM, rng),
        wv: w(HKV * HD, DM, rng),
        wo: w(DM, HQ * HD, rng),
        n2: n(),
        w1: w(FF, DM, rng),
        w3: w(FF, DM, rng),
        w2: w(DM, FF, rng),
    }
}

fn block(x: &Tensor, l: &Layer, cos: &Tensor, sin: &Tensor) -> Tensor {
    let h = rms_norm(x, &l.n1, 1e-5).unwrap(); // (B, T, DM)
    let heads = |w: &Tensor, n: usize| h.matmul(&w.t().unwrap()).unwrap().reshape([B, T, n, HD]).unwrap().permute(&[0, 2, 1, 3]).unwrap();
    let q = rope(&heads(&l.wq, HQ), cos, sin).unwrap(); // (B, HQ, T, HD)
    let k = rope(&heads(&l.wk, HKV), cos, sin).unwrap(); // (B, HKV, T, HD)
    let v = heads(&l.wv, HKV);
    let a = causal_attention(&q, &k, &v, 1.0 / (HD as f64).sqrt()).unwrap();
    let a = a.permute(&[0, 2, 1, 3]).unwrap().reshape([B, T, DM]).unwrap();
    let x = x.add(&a.matmul(&l.wo.t().unwrap()).unwrap()).unwrap();
    let h = rms_norm(&x, &l.n2, 1e-5).unwrap();
    let m = swiglu(&h.matmul(&l.w1.t().unwrap()).unwrap(), &h.matmul(&l.w3.t().unwrap()).unwrap()).unwrap();
    x.add(&m.matmul(&l.w2.t().unwrap()).unwrap()).unwrap()
}

fn rope_tables(t: usize, d: usize, theta: f64) -> (Tensor, Tensor) {
    let (mut c, mut s) = (vec![0f32; t * d], vec![0f32; t * d]);
    for p in 0..t {
        for j in 0..d {
            let a = p as f64 * theta.powf(-2.0 * (j % (d / 2)) as f64 / d as f64);
            c[p * d + j] = a.cos() as f32;
            s[p * d + j] = a.sin() as f32;
        }
    }
    (Tensor::from_vec(c, [t, d], Device::Cpu).unwrap(), Tensor::from_vec(s, [t, d], Device::Cpu).unwrap())
}

/// Independent 512-bit FMA chains for `iters` rounds of 12 (one thread); returns the lanes' sum
/// so the chains cannot be folded away.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains(iters: usize, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-7));
    let mut acc: [__m512; 12] = std::array::from_fn(|i| _mm512_set1_ps(seed + i as f32));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// f32 FMA peak of `threads` threads running 512-bit FMA chains at once (GFLOP/s; the best of
/// three runs, as a ceiling should be on a machine shared with others), or None without
/// AVX-512F: the ceiling the GEMM columns are measured against.
fn fma_peak(threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let iters = 10_000_000;
        let run = || {
            let t = Instant::now();
            let sums: Vec<f32> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads).map(|i| s.spawn(move || unsafe { fma_chains(iters, i as f32) })).collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            std::hint::black_box(sums);
            (threads * iters * 12 * 16 * 2) as f64 / t.elapsed().as_secs_f64() / 1e9
        };
        return Some((0..3).map(|_| run()).fold(0.0, f64::max));
    }
    None
}

/// Benchmark the CPU engine: the f32 FMA peak (512-bit FMA chains, one thread and all), f32 GEMM
/// through Tensor::matmul next to ferrolm's sgemm, the same with A always packed, and
/// matrixmultiply::sgemm (one thread each) on the same shapes, and forward + backward of a
/// 2-layer Llama-style block stack. Prints markdown tables (GFLOP/s; the median of repeated
/// runs).
#[derive(Parser)]
#[command(
    name = "bench_cpu",
    after_help = concat!(
        "Environment:\n",
        "  RAYON_NUM_THREADS      threads of the CPU kernels, GEMM included [default: one per core]\n",
        "  FERROLM_CPU_SGEMM      `matrixmultiply`: Tensor::matmul's f32 GEMM is matrixmultiply [default: AVX-512 where found]",
    )
)]
struct Args {}

fn main() {
    Args::parse();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("ferrolm-tensor CPU bench ({threads} hardware threads, {} in the kernels' pool)\n", rayon::current_num_threads());
    let rng = &mut Rng::new(0);
    match (fma_peak(1), fma_peak(threads)) {
        (Some(one), Some(all)) => {
            println!("f32 FMA peak (independent 512-bit FMA chains): {one:.1} GFLOP/s on one thread, {all:.1} on {threads}\n")
        }
        _ => println!("f32 FMA peak: not measured (no AVX-512F)\n"),
    }
    println!("GEMM kernel: {} (`FERROLM_CPU_SGEMM=matrixmultiply` selects matrixmultiply)\n", sgemm_kernel());
    println!(
        "| GEMM (m x k x n) | Tensor::matmul GFLOP/s | ferrolm sgemm (one thread) GFLOP/s | same, A always packed GFLOP/s | matrixmultiply::sgemm (one thread) GFLOP/s | ratio to matrixmultiply |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    // (m, k, n, A transposed, B transposed, note); B transposed is a Linear's `x @ W^T`.
    let shapes: &[(usize, usize, usize, bool, bool, &str)] = &[
        (64, 64, 64, false, false, ""),
        (256, 256, 256, false, false, ""),
        (1024, 1024, 1024, false, false, ""),
        (2048, 256, 256, false, true, " (x @ W_q^T)"),
        (2048, 256, 688, false, true, " (x @ W_up^T)"),
        (2048, 688, 256, false, true, " (h @ W_down^T)"),
        (2048, 688, 256, false, false, " (dY @ W_up, input grad)"),
        (2048, 256, 4096, false, true, " (x @ W_lm^T)"),
        (256, 2048, 688, true, false, " (x^T @ dY, weight grad)"),
        (2048, 1024, 256, false, true, " (A's rows 4 KiB apart: packed)"),
        (64, 32, 256, false, true, " (attention Q K^T tile)"),
        (64, 256, 32, false, false, " (attention P V tile)"),
    ];
    for &(m, k, n, ta, tb, note) in shapes {
        let (e, ours, packed, theirs) = gemm_row(m, k, n, ta, tb, rng);
        let packed = packed.map_or("-".to_string(), |g| format!("{g:.1}"));
        println!("| {m} x {k} x {n}{note} | {e:.1} | {ours:.1} | {packed} | {theirs:.1} | {:.2} |", ours / theirs);
    }

    // 2-layer block stack, forward + backward.
    let layers: Vec<Layer> = (0..2).map(|_| layer(rng)).collect();
    let (cos, sin) = rope_tables(T, HD, 10000.0);
    let x = Tensor::randn([B, T, DM], 1.0, DType::F32, Device::Cpu, rng).unwrap();
    let fwd = || {
        let mut h = x.clone();
        for l in &layers {
            h = block(&h, l, &cos, &sin);
        }
        h.sqr().unwrap().mean_all().unwrap()
    };
    let t_fwd = median_secs(3, 2.0, || {
        let _g = no_grad();
        std::hint::black_box(fwd());
    });
    let t_fb = median_secs(3, 4.0, || {
        fwd().backward().unwrap();
    });
    // matmul FLOPs per layer forward: q,o (DM x DM), k,v (DM x HKV*HD), MLP 3 x (DM x FF), attention (causal half).
    let n = (B * T) as f64;
    let per_layer = 2.0 * n * (2.0 * (DM * DM) as f64 + 2.0 * (DM * HKV * HD) as f64 + 3.0 * (DM * FF) as f64)
        + 2.0 * 2.0 * (B * HQ * T * T * HD) as f64 / 2.0;
    let flops = 2.0 * per_layer;
    println!("\n| 2-layer block stack (B={B}, T={T}, d={DM}, heads {HQ}/{HKV} kv, ff {FF}, f32) | ms | GFLOP/s (matmul+attention FLOPs) |");
    println!("|---|---:|---:|");
    println!("| forward (no_grad) | {:.1} | {:.1} |", t_fwd * 1e3, flops / t_fwd / 1e9);
    println!("| forward + backward | {:.1} | {:.1} |", t_fb * 1e3, 3.0 * flops / t_fb / 1e9);
}
