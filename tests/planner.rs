//! The performance model's one home (`ferrolm::planner`): `plan` and `autoconfig` build their
//! GPU cluster through the one constructor with the same defaults, both price gradient
//! collectives at `--grad-reduce-dtype` (4 bytes per element for f32, 2 for bf16), the figures
//! docs/PARALLEL.md quotes for AMSP's layouts hold, and bad cluster values are refused naming
//! the flag.
mod common;
use clap::error::ErrorKind;
use common::tmp;
use ferrolm::cli::autoconfig::{autoconfig, AutoconfigArgs};
use ferrolm::cli::plan::PlanArgs;
use ferrolm::cli::{error_report, parse_from};
use ferrolm::planner::layouts::Candidate;
use ferrolm::planner::{step, Cluster, GpuClusterSpec, GpuDefaults, ADAMW_BYTES_PER_ELEM, NCCL_BYTES_PER_COMMUNICATOR};
use ferrolm_parallel::zero::{GradReduceDtype, ShardSpec};

fn plan(flags: &[&str]) -> PlanArgs {
    parse_from(["plan"].iter().chain(flags)).unwrap()
}

/// The autoconfig report of a modelled GPU run with `flags`.
fn autoconfig_gpu(tag: &str, flags: &[&str]) -> ferrolm::autoconfig::Report {
    let out = tmp(tag);
    let o = format!("--out={}", out.display());
    let a: AutoconfigArgs = parse_from(["autoconfig", "--target=gpu", &o].iter().chain(flags)).unwrap();
    let r = autoconfig(&a).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    r
}

/// Every field of two clusters, compared (Cluster has no PartialEq: it holds f64 rates).
fn same_cluster(a: &Cluster, b: &Cluster) {
    assert_eq!((a.gpus, a.gpus_per_node, a.link), (b.gpus, b.gpus_per_node, b.link));
    let fa =
        [a.mem_bytes, a.flops, a.peak_flops, a.margin, a.interference, a.update_s_per_elem, a.comm_cpu_s_per_byte, a.comm_buffer_bytes];
    let fb =
        [b.mem_bytes, b.flops, b.peak_flops, b.margin, b.interference, b.update_s_per_elem, b.comm_cpu_s_per_byte, b.comm_buffer_bytes];
    assert_eq!(fa, fb);
}

#[test]
fn both_tools_build_the_cluster_through_one_constructor_with_one_set_of_defaults() {
    let d = GpuDefaults::DEFAULT;
    let one = Cluster::gpu(&GpuClusterSpec { gpus: 64, ..Default::default() }).unwrap();
    // The defaults, each as documented.
    assert_eq!((one.gpus_per_node, one.mem_bytes), (d.gpus_per_node, 80.0 * (1u64 << 30) as f64));
    assert_eq!((one.link.intra.bytes_per_s, one.link.inter.bytes_per_s), (150e9, 25e9));
    assert_eq!((one.link.intra.alpha_s, one.link.inter.alpha_s), (5e-6, 15e-6));
    assert_eq!((one.peak_flops, one.flops, one.interference, one.margin), (312e12, 0.6 * 312.0 * 1e12, 0.2, 0.1));
    assert_eq!(one.update_s_per_elem, ADAMW_BYTES_PER_ELEM / 2000e9);
    assert_eq!(one.comm_buffer_bytes, NCCL_BYTES_PER_COMMUNICATOR);

    let p = plan(&["--model=7b", "--gpus=64"]).cluster().unwrap();
    same_cluster(&p, &one);
    let a = autoconfig_gpu("planner-defaults", &["--model=7b", "--gpus=64"]);
    same_cluster(&a.cluster, &one);

    // The same flags move both the same way; --inter-bw is the old spelling of --inter-gb-s.
    let flags = ["--inter-gb-s=12.5", "--interference=0.1", "--hbm-gb-s=3350", "--gpus-per-node=4", "--intra-latency=2"];
    let p = plan(&[&["--model=7b", "--gpus=64"][..], &flags].concat()).cluster().unwrap();
    let a = autoconfig_gpu("planner-flags", &[&["--model=7b", "--gpus=64"][..], &flags].concat()).cluster;
    same_cluster(&p, &a);
    assert_eq!((p.link.inter.bytes_per_s, p.interference, p.gpus_per_node, p.link.intra.alpha_s), (12.5e9, 0.1, 4, 2e-6));
    assert_eq!(p.update_s_per_elem, ADAMW_BYTES_PER_ELEM / 3350e9);
    let old = plan(&["--model=7b", "--gpus=64", "--inter-bw=12.5"]).cluster().unwrap();
    assert_eq!(old.link.inter.bytes_per_s, 12.5e9);
    // A node holds no more GPUs than the cluster.
    assert_eq!(plan(&["--model=7b", "--gpus=4"]).cluster().unwrap().gpus_per_node, 4);
}

#[test]
fn bf16_gradient_reduction_prices_gradients_at_two_bytes() {
    let (f32_, bf16) = (plan(&["--model=7b", "--gpus=1024"]), plan(&["--model=7b", "--gpus=1024", "--grad-reduce-dtype", "bf16"]));
    assert_eq!((f32_.workload().grad_bytes, bf16.workload().grad_bytes), (4, 2));
    assert_eq!(f32_.grad_reduce.grad_reduce_dtype, GradReduceDtype::F32, "f32 is the default, as in the training tools");
    let (m, c) = (f32_.model_shape().unwrap(), f32_.cluster().unwrap());
    let spec = ShardSpec { params: 2, grads: 2, optim: 8 };
    let a = step::evaluate(&m, &c, &f32_.workload(), spec).unwrap();
    let b = step::evaluate(&m, &c, &bf16.workload(), spec).unwrap();
    // Parameter gathers are unchanged; gradient memory halves; gradient collectives get cheaper.
    assert_eq!((a.comm[0], a.mem.params), (b.comm[0], b.mem.params));
    assert_eq!(b.mem.grads * 2.0, a.mem.grads);
    assert!(b.comm[1] < a.comm[1] && b.comm[2] < a.comm[2], "{:?} vs {:?}", b.comm, a.comm);
    assert!(b.step < a.step && b.mfu > a.mfu);

    // autoconfig prices the same candidate the same way.
    let flags = ["--model=7b", "--gpus=64", "--micro-batches=1", "--max-tp=1"];
    let f = autoconfig_gpu("planner-f32", &flags);
    let h = autoconfig_gpu("planner-bf16", &[&flags[..], &["--grad-reduce-dtype=bf16"]].concat());
    let find = |v: &[Candidate], name: &str| v.iter().find(|c| c.name() == name).cloned().unwrap();
    let c = &f.ranked[0];
    let d = find(&h.ranked, &c.name());
    assert_eq!(d.mem.grads * 2.0, c.mem.grads, "{}", c.name());
    assert!(d.step_s < c.step_s, "{}: {} vs {}", c.name(), d.step_s, c.step_s);
}

/// docs/PARALLEL.md's comparison with AMSP's layouts (1024 A800s, 12.5 GB/s between nodes):
/// with gradients reduced in bf16, as AMSP did, its own layouts model at 50.6% (7B), 52.7%
/// (13B) and 39.2% (30B, recomputed) MFU; in f32, 43.8%, 44.2%, 37.9%.
#[test]
fn amsp_layouts_keep_their_documented_figures() {
    let cases = [("7b", "0", (1, 1, 8), 50.6, 43.8), ("13b", "0", (4, 4, 8), 52.7, 44.2), ("30b", "60", (8, 8, 32), 39.2, 37.9)];
    for (model, ck, (p, g, o), bf16, f32_) in cases {
        for (dtype, want) in [("bf16", bf16), ("f32", f32_)] {
            let a =
                plan(&["--model", model, "--gpus=1024", "--inter-gb-s=12.5", "--checkpointed-layers", ck, "--grad-reduce-dtype", dtype]);
            let (_, _, ranked) = a.rank().unwrap();
            let e = ranked.iter().find(|e| e.spec == ShardSpec { params: p, grads: g, optim: o }).unwrap();
            assert!((e.mfu * 100.0 - want).abs() < 0.05, "{model} {dtype}: {:.2}% (docs: {want}%)", e.mfu * 100.0);
        }
    }
}

#[test]
fn bad_values_are_refused_naming_the_flag() {
    for bad in ["f16", "F32", ""] {
        let e = parse_from::<PlanArgs, _, _>(["plan", "--model=7b", "--gpus=8", "--grad-reduce-dtype", bad]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation, "{bad:?}");
        assert!(e.to_string().contains("--grad-reduce-dtype"), "{e}");
        let e = parse_from::<AutoconfigArgs, _, _>(["autoconfig", "--grad-reduce-dtype", bad]).unwrap_err();
        assert!(e.kind() == ErrorKind::ValueValidation && e.to_string().contains("--grad-reduce-dtype"), "{e}");
    }
    let e = parse_from::<PlanArgs, _, _>(["plan", "--model=7b", "--gpus=8", "--interference=1.5"]).unwrap_err();
    assert!(e.to_string().contains("--interference"), "{e}");
    for (flag, msg) in [("--inter-gb-s=0", "--inter-gb-s 0"), ("--inter-bw=-1", "--inter-gb-s -1"), ("--hbm-gb-s=NaN", "--hbm-gb-s NaN")] {
        let e = error_report(&plan(&["--model=7b", "--gpus=8", flag]).cluster().unwrap_err());
        assert!(e.contains(msg), "{flag}: {e}");
        let out = tmp("planner-bad");
        let a: AutoconfigArgs = parse_from(["autoconfig", "--model=7b", "--gpus=8", flag, &format!("--out={}", out.display())]).unwrap();
        let e = error_report(&autoconfig(&a).unwrap_err());
        assert!(e.contains(msg), "{flag}: {e}");
    }
}
