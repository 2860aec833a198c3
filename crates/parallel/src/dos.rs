//! The performance model of Deep Optimizer States (arXiv 2410.21316) as ferrolm derives it: how
//! long the optimizer phase of an offloaded step takes when one subgroup in `k` is updated on
//! the GPU and the rest on the CPU, and which `k` is fastest. Pure functions, shared by the
//! offload engine (`--offload-gpu-every auto`), the planner and the auto-configurator.
//!
//! The paper's own equations were not available to us; this is our derivation from its
//! mechanism and the authors' implementation (docs/OFFLOAD.md, which also reviews where the
//! implementation in `offload.rs` departs from it).
//!
//! A rank's optimizer shard of `E` elements is split into `n = ceil(E / S)` subgroups. Subgroup
//! `i` is updated on the GPU iff `(i + 1) % k == 0` (`k = 1`: every subgroup; `k = None`: none,
//! ZeRO-Offload). Per element, with `p` bytes per working parameter and `g` bytes per gradient:
//!
//! | subgroup | during backward | in the update phase |
//! |---|---|---|
//! | CPU | gradient D2H, `g` B | CPU AdamW; parameter H2D, `p` B |
//! | GPU | gradient stays on the GPU | state H2D 12 B (master, m, v), GPU AdamW, state D2H 12 B |
//!
//! The update phase is a pipeline over subgroups whose stages use different resources (CPU
//! cores, the H2D and D2H directions of the link, the GPU), so in steady state it takes as long
//! as its busiest resource, plus the part of the first and last transfers nothing overlaps:
//!
//! ```text
//! T_cpu = E_cpu / R_cpu · (1 + interference · [link busy])
//! T_h2d = (12·E_gpu + p·E_cpu) / B_h2d        T_d2h = 12·E_gpu / B_d2h        T_gpu = E_gpu / R_gpu
//! T_update = max(T_cpu, T_h2d, T_d2h, T_gpu) + fill + drain
//! fill  = max(0, 12·S / B_h2d − (k − 1)·S / R_cpu)      (the first GPU subgroup's prefetch, hidden
//!                                                       behind the k − 1 CPU updates before it)
//! drain = 12·S / B_d2h if the last subgroup is a GPU one, else p·S / B_h2d
//! T_grad_exposed = max(0, g·E_cpu / B_d2h − T_backward)  (gradient streaming not hidden by backward)
//! T_offload = T_update + T_grad_exposed
//! ```
//!
//! Balancing `T_cpu` against `T_h2d` for a fraction `f = 1/k` on the GPU gives the closed form
//! `f* = (1/R_cpu − p/B_h2d) / (1/R_cpu − p/B_h2d + 12/B_h2d)`; [`choose_k`] searches the
//! integers around it (and `None`) with the full model, fill and drain included.

/// What the model needs, all measured or published.
#[derive(Clone, Debug)]
pub struct DosInputs {
    /// Elements of this rank's optimizer shard.
    pub elems: u64,
    /// Elements per subgroup (`--offload-subgroup-size`).
    pub subgroup: u64,
    /// CPU AdamW throughput, elements per second (all cores of this rank).
    pub cpu_adam_elems_per_s: f64,
    /// GPU AdamW throughput, elements per second.
    pub gpu_adam_elems_per_s: f64,
    /// Host-to-device and device-to-host bandwidth of pinned copies, bytes per second.
    pub h2d_bytes_per_s: f64,
    pub d2h_bytes_per_s: f64,
    /// Bytes per working parameter copied back (2 for bf16, 4 for f32).
    pub param_bytes: u64,
    /// Bytes per gradient element streamed to the host (4: fp32 gradients).
    pub grad_bytes: u64,
    /// Backward time the gradient stream may hide behind, seconds.
    pub backward_s: f64,
    /// Slow-down of CPU AdamW while DMA shares host memory bandwidth (0: none).
    pub interference: f64,
}

/// One `k`'s modelled update phase.
#[derive(Clone, Debug, PartialEq)]
pub struct DosEstimate {
    /// `Some(k)`: one subgroup in k on the GPU; `None`: all on the CPU.
    pub k: Option<u64>,
    pub gpu_subgroups: u64,
    pub cpu_subgroups: u64,
    pub cpu_s: f64,
    pub h2d_s: f64,
    pub d2h_s: f64,
    pub gpu_s: f64,
    /// fill + drain: the unoverlapped ends of the pipeline.
    pub ends_s: f64,
    pub update_s: f64,
    pub grad_exposed_s: f64,
    /// `update_s + grad_exposed_s`: what offload adds to a step after the backward pass.
    pub total_s: f64,
}

/// Elements of subgroup `i` (the last one may be short).
fn subgroup_len(inp: &DosInputs, i: u64) -> u64 {
    inp.subgroup.min(inp.elems - i * inp.subgroup)
}

/// Whether subgroup `i` is updated on the GPU for `k`.
pub fn on_gpu(i: u64, k: Option<u64>) -> bool {
    k.is_some_and(|k| (i + 1).is_multiple_of(k.max(1)))
}

/// The modelled update phase for `k` (`None`: all-CPU). Panics on a zero subgroup size or
/// non-positive rates, which callers validate as user input first.
pub fn estimate(inp: &DosInputs, k: Option<u64>) -> DosEstimate {
    assert!(inp.subgroup > 0, "dos: subgroup size must be positive");
    assert!(
        [inp.cpu_adam_elems_per_s, inp.gpu_adam_elems_per_s, inp.h2d_bytes_per_s, inp.d2h_bytes_per_s].iter().all(|&r| r > 0.0),
        "dos: rates must be positive"
    );
    let n = inp.elems.div_ceil(inp.subgroup);
    let (mut e_gpu, mut n_gpu) = (0u64, 0u64);
    for i in 0..n {
        if on_gpu(i, k) {
            e_gpu += subgroup_len(inp, i);
            n_gpu += 1;
        }
    }
    let e_cpu = inp.elems - e_gpu;
    let (p, g) = (inp.param_bytes as f64, inp.grad_bytes as f64);
    let h2d_s = (12.0 * e_gpu as f64 + p * e_cpu as f64) / inp.h2d_bytes_per_s;
    let d2h_s = 12.0 * e_gpu as f64 / inp.d2h_bytes_per_s;
    let link_busy = h2d_s > 0.0 || d2h_s > 0.0;
    let cpu_s = e_cpu as f64 / inp.cpu_adam_elems_per_s * if link_busy { 1.0 + inp.interference } else { 1.0 };
    let gpu_s = e_gpu as f64 / inp.gpu_adam_elems_per_s;
    let s = inp.subgroup.min(inp.elems) as f64;
    let fill = match k {
        Some(k) if n_gpu > 0 => (12.0 * s / inp.h2d_bytes_per_s - (k.max(1) - 1) as f64 * s / inp.cpu_adam_elems_per_s).max(0.0),
        _ => 0.0,
    };
    let drain = if n == 0 {
        0.0
    } else if on_gpu(n - 1, k) {
        12.0 * subgroup_len(inp, n - 1) as f64 / inp.d2h_bytes_per_s
    } else {
        p * subgroup_len(inp, n - 1) as f64 / inp.h2d_bytes_per_s
    };
    let update_s = cpu_s.max(h2d_s).max(d2h_s).max(gpu_s) + fill + drain;
    let grad_exposed_s = (g * e_cpu as f64 / inp.d2h_bytes_per_s - inp.backward_s).max(0.0);
    DosEstimate {
        k,
        gpu_subgroups: n_gpu,
        cpu_subgroups: n - n_gpu,
        cpu_s,
        h2d_s,
        d2h_s,
        gpu_s,
        ends_s: fill + drain,
        update_s,
        grad_exposed_s,
        total_s: update_s + grad_exposed_s,
    }
}

/// The closed-form balance point `f* = 1/k*` of CPU time against H2D traffic (see the module
/// doc), clamped to [0, 1]. 0 means the CPU alone is fastest.
pub fn balanced_gpu_fraction(inp: &DosInputs) -> f64 {
    let a = 1.0 / inp.cpu_adam_elems_per_s - inp.param_bytes as f64 / inp.h2d_bytes_per_s;
    if a <= 0.0 {
        return 0.0;
    }
    (a / (a + 12.0 / inp.h2d_bytes_per_s)).clamp(0.0, 1.0)
}

/// The fastest `k` under the full model: every `k` from 1 to the number of subgroups, and
/// `None` (all-CPU). Ties go to the larger `k` (less GPU memory, less PCIe traffic).
pub fn choose_k(inp: &DosInputs) -> DosEstimate {
    let n = inp.elems.div_ceil(inp.subgroup.max(1)).max(1);
    let mut best = estimate(inp, None);
    for k in (1..=n).rev() {
        let e = estimate(inp, Some(k));
        if e.total_s < best.total_s * (1.0 - 1e-9) {
            best = e;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> DosInputs {
        DosInputs {
            elems: 1_000,
            subgroup: 100,
            cpu_adam_elems_per_s: 1_000.0,
            gpu_adam_elems_per_s: 1e9,
            h2d_bytes_per_s: 24_000.0,
            d2h_bytes_per_s: 24_000.0,
            param_bytes: 2,
            grad_bytes: 4,
            backward_s: 0.0,
            interference: 0.0,
        }
    }

    #[test]
    fn all_cpu_is_cpu_time_plus_the_parameter_copy_back() {
        let e = estimate(&inputs(), None);
        assert_eq!((e.gpu_subgroups, e.cpu_subgroups), (0, 10));
        assert!((e.cpu_s - 1.0).abs() < 1e-12);
        assert!((e.h2d_s - 2_000.0 / 24_000.0).abs() < 1e-12);
        // The last subgroup's parameters go back after its update: 200 B at 24 kB/s.
        assert!((e.update_s - (1.0 + 200.0 / 24_000.0)).abs() < 1e-12);
        // Gradients: 4 kB at 24 kB/s, none hidden.
        assert!((e.grad_exposed_s - 4_000.0 / 24_000.0).abs() < 1e-12);
    }

    #[test]
    fn every_second_subgroup_on_the_gpu_by_hand() {
        let e = estimate(&inputs(), Some(2));
        assert_eq!((e.gpu_subgroups, e.cpu_subgroups), (5, 5));
        // CPU 500 elements at 1000/s; H2D 12*500 + 2*500 = 7000 B; D2H 6000 B.
        assert!((e.cpu_s - 0.5).abs() < 1e-12);
        assert!((e.h2d_s - 7_000.0 / 24_000.0).abs() < 1e-12);
        // fill: 1200 B / 24 kB/s = 0.05 s minus one CPU subgroup (0.1 s) -> 0; drain: the last
        // subgroup (index 9) is a GPU one: 1200 B D2H.
        assert!((e.ends_s - 0.05).abs() < 1e-12);
        assert!((e.update_s - 0.55).abs() < 1e-12);
    }

    #[test]
    fn the_chosen_k_is_the_minimum_and_near_the_closed_form() {
        let inp = inputs();
        let best = choose_k(&inp);
        let n = 10;
        for k in 1..=n {
            assert!(best.total_s <= estimate(&inp, Some(k)).total_s + 1e-12);
        }
        assert!(best.total_s <= estimate(&inp, None).total_s);
        // f* = (1e-3 - 2/24000) / (1e-3 - 2/24000 + 12/24000) = 0.647 -> k* in {1, 2}.
        let f = balanced_gpu_fraction(&inp);
        assert!((f - (1e-3 - 2.0 / 24e3) / (1e-3 + 10.0 / 24e3)).abs() < 1e-12);
        assert!(matches!(best.k, Some(1) | Some(2)), "{best:?}");
    }

    #[test]
    fn a_slow_link_keeps_everything_on_the_cpu() {
        let inp = DosInputs { h2d_bytes_per_s: 10.0, d2h_bytes_per_s: 10.0, ..inputs() };
        assert_eq!(balanced_gpu_fraction(&inp), 0.0);
        assert_eq!(choose_k(&inp).k, None);
    }

    #[test]
    fn gradients_hide_behind_a_long_backward() {
        let inp = DosInputs { backward_s: 10.0, ..inputs() };
        assert_eq!(estimate(&inp, None).grad_exposed_s, 0.0);
    }
}
