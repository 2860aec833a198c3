//! Optimizer-offload benchmark (docs/OFFLOAD.md): the CPU AdamW that offload runs
//! (`ferrolm_tensor::cpu_adam`) measured against this machine's memory bandwidth, and the Deep
//! Optimizer States model (`ferrolm_parallel::dos`) fed with that measured CPU throughput for a 7B
//! Llama on one H100.
//!
//!   cargo run --release --example bench_offload -- [--elems 33554432] [--reps 5] [--k 13,7]
//!
//! Measured here: memory bandwidth (a copy and a STREAM-style triad over arrays far larger than
//! the caches, on every core) and CPU AdamW throughput. AdamW moves a known number of bytes per
//! parameter (`cpu_adam::bytes_per_param`: reads g, w, m, v; writes w, m, v and the bf16 copy =
//! 30 B), so its GB/s beside the triad's says how close it runs to the memory bound.
//! Not measured (no GPU here), and labelled as such in the output: the H100's PCIe and AdamW
//! rates, which come from the flags (defaults: a measured-class PCIe Gen5 x16 figure and the HBM3
//! datasheet bandwidth).
use clap::Parser;
use ferrolm::AnyResult;
use ferrolm_parallel::dos::{choose_k, estimate, DosInputs};
use ferrolm_parallel::zero::ShardSpec;
use ferrolm_tensor::backend::AdamWHyper;
use ferrolm_tensor::{bf16, cpu_adam};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(name = "bench_offload", about = "CPU AdamW against memory bandwidth, and the DOS model for a 7B Llama on one H100")]
struct Args {
    /// Elements per measured array (default 32 Mi: 128 MiB per f32 array)
    #[arg(long, default_value = "33554432")]
    elems: usize,
    /// Timed repetitions (the fastest is kept)
    #[arg(long, default_value = "5")]
    reps: usize,
    /// Model parameters of the modelled run (Llama-2-7B: 6,738,415,616)
    #[arg(long, default_value = "6738415616")]
    params: u64,
    /// Elements per subgroup in the model
    #[arg(long, default_value = "100000000")]
    subgroup: u64,
    /// Pinned PCIe bandwidth per direction, GB/s (55: measured-class PCIe Gen5 x16; the link's
    /// theoretical rate is 63 GB/s)
    #[arg(long, default_value = "55")]
    pcie_gbs: f64,
    /// GPU memory bandwidth for the fused AdamW, GB/s (H100 SXM HBM3 datasheet: 3350)
    #[arg(long, default_value = "3350")]
    hbm_gbs: f64,
    /// GPU memory, GB (H100: 80)
    #[arg(long, default_value = "80")]
    gpu_gb: f64,
    /// Backward time the gradient stream can hide behind, s (0: none hidden, the worst case)
    #[arg(long, default_value = "0")]
    backward_s: f64,
    /// Use this CPU AdamW rate (elements/s) in the model instead of the one measured here, e.g.
    /// a real H100 host's
    #[arg(long)]
    cpu_adam_elems_per_s: Option<f64>,
    /// More k to model beside the sweep's (1-6, 8, 10, 12, 16, 24, 32), e.g. the k a run chose:
    /// --k 13,7
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    k: Vec<u64>,
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` on `threads()` equal chunks of the index range 0..n in parallel.
fn par_chunks(n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let t = threads();
    let per = n.div_ceil(t);
    std::thread::scope(|s| {
        for i in 0..t {
            let r = (i * per).min(n)..((i + 1) * per).min(n);
            let f = &f;
            s.spawn(move || f(r));
        }
    });
}

/// A raw pointer that may cross threads: each thread writes only its own disjoint chunk.
#[derive(Clone, Copy)]
struct Ptr(*mut f32);
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}
impl Ptr {
    /// The chunk `r` (a method, so that closures capture the whole `Ptr`, not its raw field).
    ///
    /// # Safety
    /// `r` lies inside the allocation and no other thread touches it meanwhile.
    unsafe fn chunk<'a>(self, r: &std::ops::Range<usize>) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(r.start), r.len())
    }
}

fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: pages touched, threads started
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into())
}

fn main() -> AnyResult<()> {
    let a = Args::parse();
    let n = a.elems;
    let (b, c) = (vec![1.0f32; n], vec![2.0f32; n]);
    let mut dst = vec![0.0f32; n];
    // Copy: reads n*4, writes n*4 bytes.
    let d = Ptr(dst.as_mut_ptr());
    let t_copy = best_of(a.reps, || {
        par_chunks(n, |r| {
            // SAFETY: each thread writes only its own chunk `r` of dst, which outlives the scope.
            let out = unsafe { d.chunk(&r) };
            out.copy_from_slice(&b[r]);
        })
    });
    // Triad a = b + s c: reads 2 n*4, writes n*4 bytes (STREAM's accounting, no write-allocate).
    let t_triad = best_of(a.reps, || {
        par_chunks(n, |r| {
            // SAFETY: as above.
            let out = unsafe { d.chunk(&r) };
            for ((o, x), y) in out.iter_mut().zip(&b[r.clone()]).zip(&c[r]) {
                *o = x + 3.0 * y;
            }
        })
    });
    std::hint::black_box(&dst);
    let copy_gbs = 8.0 * n as f64 / t_copy / 1e9;
    let triad_gbs = 12.0 * n as f64 / t_triad / 1e9;
    drop((b, c, dst));

    let (mut w, mut m, mut v, g) = (vec![0.1f32; n], vec![0f32; n], vec![0f32; n], vec![0.01f32; n]);
    let mut out = vec![bf16::ZERO; n];
    let mut step = 0;
    let t_adam = best_of(a.reps, || {
        step += 1;
        let h = AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, step };
        cpu_adam::adamw_step(&mut w, &mut m, &mut v, &g, Some(&mut out), &h, 0.01).expect("equal lengths");
    });
    std::hint::black_box((&w, &out));
    let adam_rate = n as f64 / t_adam;
    let adam_gbs = adam_rate * cpu_adam::bytes_per_param(true) as f64 / 1e9;

    println!("## CPU AdamW against memory bandwidth (measured)\n");
    println!("device: {} ({} threads); {} elements per array\n", cpu_name(), threads(), n);
    // The triad's stores are ordinary ones: each also reads its line first (write-allocate), 16 B
    // per element really move; memcpy's large-copy path streams its stores past the cache.
    let triad_wa_gbs = 16.0 * n as f64 / t_triad / 1e9;
    let peak = copy_gbs.max(triad_wa_gbs);
    println!("| what | time (s) | params/s | GB/s | of the best bandwidth |");
    println!("|---|---|---|---|---|");
    println!("| memcpy (8 B/elem) | {t_copy:.4} | - | {copy_gbs:.1} | {:.0}% |", 100.0 * copy_gbs / peak);
    println!("| triad a = b + s*c, STREAM accounting (12 B/elem) | {t_triad:.4} | - | {triad_gbs:.1} | {:.0}% |", 100.0 * triad_gbs / peak);
    println!(
        "| the same triad with write-allocate (16 B/elem) | {t_triad:.4} | - | {triad_wa_gbs:.1} | {:.0}% |",
        100.0 * triad_wa_gbs / peak
    );
    println!(
        "| cpu_adam AdamW + bf16 copy ({} B/param) | {t_adam:.4} | {adam_rate:.3e} | {adam_gbs:.1} | {:.0}% |",
        cpu_adam::bytes_per_param(true),
        100.0 * adam_gbs / peak
    );

    // ---- the model for a 7B on one H100 ----------------------------------------------------
    let cpu_rate = a.cpu_adam_elems_per_s.unwrap_or(adam_rate);
    // The fused GPU AdamW moves bf16 param r/w (4), fp32 grad (4), master, m, v r/w (24): 32 B.
    let gpu_rate = a.hbm_gbs * 1e9 / 32.0;
    let inp = DosInputs {
        elems: a.params,
        subgroup: a.subgroup,
        cpu_adam_elems_per_s: cpu_rate,
        gpu_adam_elems_per_s: gpu_rate,
        h2d_bytes_per_s: a.pcie_gbs * 1e9,
        d2h_bytes_per_s: a.pcie_gbs * 1e9,
        param_bytes: 2,
        grad_bytes: 4,
        backward_s: a.backward_s,
        interference: 0.0,
    };
    let states = ShardSpec::zero(0, 1)?.state_bytes(a.params, 2) as f64 / 1e9;
    // Offloaded: bf16 params and gradients stay; a GPU subgroup in flight adds its master/m/v
    // (12 B), fp32 gradient (4 B) and bf16 parameter scratch (2 B) per element.
    let on_gpu_offloaded = (a.params * 2 * 2) as f64 / 1e9;
    let in_flight = (18 * a.subgroup.min(a.params)) as f64 / 1e9;
    println!("\n## DOS model: {:.2}B-parameter Llama, one H100 (modelled, not measured)\n", a.params as f64 / 1e9);
    println!(
        "inputs: CPU AdamW {cpu_rate:.3e} params/s ({}); GPU AdamW {gpu_rate:.3e} params/s (HBM {} GB/s datasheet / 32 B); \
         PCIe {} GB/s per direction ({}); subgroup {}; backward hiding the gradient stream {} s\n",
        if a.cpu_adam_elems_per_s.is_some() { "from --cpu-adam-elems-per-s" } else { "measured above, this machine" },
        a.hbm_gbs,
        a.pcie_gbs,
        if a.pcie_gbs == 63.0 {
            "PCIe Gen5 x16 theoretical"
        } else {
            "measured-class figure for PCIe Gen5 x16 (theoretical 63), not measured here"
        },
        a.subgroup,
        a.backward_s
    );
    let fits = states <= a.gpu_gb;
    let no_offload = a.params as f64 / gpu_rate;
    println!(
        "| configuration | model states on the GPU (GB) | fits in {} GB | update phase (s) | + exposed grads (s) | total (s) |",
        a.gpu_gb
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| no offload (bf16 + fp32 master/m/v on the GPU) | {states:.1} | {} | {} | 0 | {} |",
        if fits { "yes" } else { "no" },
        if fits { format!("{no_offload:.3}") } else { format!("({no_offload:.3} if it fit)") },
        if fits { format!("{no_offload:.3}") } else { "does not fit".into() }
    );
    let row = |name: &str, e: &ferrolm_parallel::dos::DosEstimate| {
        let mem = on_gpu_offloaded + if e.gpu_subgroups > 0 { in_flight } else { 0.0 };
        let fits = if mem <= a.gpu_gb { "yes" } else { "no" };
        println!("| {name} | {mem:.1} | {fits} | {:.3} | {:.3} | {:.3} |", e.update_s, e.grad_exposed_s, e.total_s);
    };
    let all_cpu = estimate(&inp, None);
    row("all-CPU offload (k = inf)", &all_cpu);
    let best = choose_k(&inp);
    let kname = best.k.map_or("inf".to_string(), |k| k.to_string());
    row(&format!("DOS, the model's k = {kname}"), &best);
    println!("\nspeed-up of DOS over all-CPU offload (modelled): {:.2}x\n", all_cpu.total_s / best.total_s);
    println!("### the model's sweep over k\n");
    println!("| k | GPU subgroups | CPU (s) | H2D (s) | D2H (s) | GPU (s) | ends (s) | update (s) | total (s) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let subgroups = a.params.div_ceil(a.subgroup);
    let mut ks: Vec<u64> = [1u64, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32].iter().copied().filter(|&k| k <= subgroups).collect();
    ks.extend(&a.k);
    ks.sort_unstable();
    ks.dedup();
    let mut ks: Vec<Option<u64>> = ks.into_iter().map(Some).collect();
    ks.push(None);
    for k in ks {
        let e = estimate(&inp, k);
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {:.4} | {:.3} | {:.3} | {:.3} |",
            k.map_or("inf".into(), |k| k.to_string()),
            e.gpu_subgroups,
            e.cpu_s,
            e.h2d_s,
            e.d2h_s,
            e.gpu_s,
            e.ends_s,
            e.update_s,
            e.total_s
        );
    }
    Ok(())
}
