//! The auto-configurator: the size-from-budget formula against hand-computed cases, the
//! recipe's rows, the filters (nothing that breaks divisibility or memory is ranked, so nothing
//! such reaches a trial), and end to end on thread ranks: trials run, the chosen layout is the
//! fastest measured, and train_config.json round-trips into pretrain_llama.
mod common;
use common::*;
use ferrolm::autoconfig::trial::TrainConfig;
use ferrolm::autoconfig::{days_for, hyper_params, params_from_budget, shape_for_params, Budget};
use ferrolm::cli::autoconfig::{autoconfig, AutoconfigArgs};
use ferrolm::cli::parse_from;
use ferrolm::cli::pretrain::{apply_config_from, PretrainArgs};
use ferrolm::cli::ComputeDtype;
use ferrolm::planner::cost::{Link, LinkModel};
use ferrolm::planner::layouts::{search, Candidate, OffloadRates, SearchSpace};
use ferrolm::planner::{Cluster, ModelShape};
use ferrolm_parallel::offload::GpuEvery;

#[test]
fn size_from_budget_matches_hand_computed_cases() {
    // NeMo launcher README's example: 20 DGX nodes (160 GPUs), 5 days, 300B tokens, 140 TFLOP/s:
    // 5 * 86400 * 160 * 140e12 / (8 * 300e9) = 4.032e9.
    let b = Budget { days: 5.0, gpus: 160, tflops_per_gpu: 140.0, tokens: 300e9 };
    let p = params_from_budget(&b).unwrap();
    assert!((p - 4.032e9).abs() < 1e3, "{p}");
    assert!((days_for(p, 300e9, 160, 140.0) - 5.0).abs() < 1e-9);
    // GPT-3 175B on 1024 GPUs at 140 TFLOP/s for 300B tokens: 175e9*8*300e9/(86400*1024*140e12) = 34.0 days
    // (the GTC talk: "35 days on 128 DGX A100 nodes").
    assert!((days_for(175e9, 300e9, 1024, 140.0) - 4.2e23 / (86400.0 * 1024.0 * 140e12)).abs() < 1e-9);
    assert!((days_for(175e9, 300e9, 1024, 140.0) - 33.9).abs() < 0.1);
    // One GPU-day at 100 TFLOP/s over 1e9 tokens: 86400e14 / 8e9 = 1.08e9 parameters.
    let one = params_from_budget(&Budget { days: 1.0, gpus: 1, tflops_per_gpu: 100.0, tokens: 1e9 }).unwrap();
    assert!((one - 1.08e9).abs() < 1.0, "{one}");
    assert!(params_from_budget(&Budget { days: 0.0, ..b.clone() }).is_err());
    assert!(params_from_budget(&Budget { tokens: -1.0, ..b }).is_err());
    // The table's nearest shapes.
    assert_eq!(shape_for_params(6.7e9, 32000).name, "7b");
    assert_eq!(shape_for_params(4.032e9, 32000).name, "5b"); // the README recommends a 5B GPT-3 here
    assert_eq!(shape_for_params(2.5e9, 32000).name, "2.7b");
    assert_eq!(shape_for_params(1.3e9, 32000).name, "1.3b");
    assert_eq!(shape_for_params(200e9, 32000).name, "175b");
}

#[test]
fn recipe_follows_its_sources() {
    let small = hyper_params(125e6, 2048);
    assert_eq!(small.lr, 6e-4);
    assert_eq!(small.global_batch_tokens, 1 << 19); // 0.5M tokens, 256 sequences of 2048
    let seven = hyper_params(6.7e9, 2048);
    assert_eq!((seven.lr, seven.warmup_steps), (3e-4, 2000));
    assert!((seven.min_lr - 3e-5).abs() < 1e-15);
    assert_eq!(seven.global_batch_tokens, 2048 * 2048);
    assert_eq!((seven.beta1, seven.beta2, seven.eps, seven.weight_decay, seven.init_std), (0.9, 0.95, 1e-5, 0.1, 0.02));
    // A run of it: the budget's tokens in steps of the global batch, LLaMA's 2000-step warmup
    // (at most a tenth of a short run), ferrolm's AdamW eps, the dtype.
    let run = hyper_params(6.7e9, 2048).for_run(2048, 2048 * 2048, Some(1e12), ferrolm::DType::BF16);
    assert_eq!((run.steps, run.warmup_steps, run.eps), (238419, 2000, 1e-8));
    assert!(run.precision.starts_with("bf16"));
    let short = hyper_params(1e6, 32).for_run(32, 512, None, ferrolm::DType::F32);
    assert_eq!((short.steps, short.warmup_steps, short.precision.as_str()), (39063, 2000, "f32"));
    let shorter = hyper_params(1e6, 32).for_run(32, 512, Some(1e6), ferrolm::DType::F32);
    assert_eq!((shorter.steps, shorter.warmup_steps), (1954, 195));
    assert_eq!(hyper_params(65e9, 2048).lr, 1.5e-4);
    assert!((seven.chinchilla_tokens - 134e9).abs() < 1e6);
    assert!(seven.rows.iter().all(|r| !r.source.is_empty()));
}

fn gpu_cluster(gpus: usize, mem_gib: f64) -> Cluster {
    Cluster {
        gpus,
        gpus_per_node: 8,
        mem_bytes: mem_gib * (1u64 << 30) as f64,
        link: LinkModel::two_level(Link::new(5e-6, 150e9), Link::new(15e-6, 25e9), 8),
        flops: 140e12,
        peak_flops: 312e12,
        margin: 0.1,
        interference: 0.2,
        update_s_per_elem: 28.0 / 2e12,
        comm_cpu_s_per_byte: 0.0,
        comm_buffer_bytes: ferrolm::planner::NCCL_BYTES_PER_COMMUNICATOR,
    }
}

fn space(seq: usize, global: usize) -> SearchSpace {
    SearchSpace {
        seq,
        global_batch_tokens: global,
        micro_batches: vec![1, 2, 3, 4, 8],
        partial_checkpointing: true,
        max_tp: 8,
        offload: None,
        ladder_layers: None,
        elem_bytes: 2,
        grad_reduce: Default::default(),
        workspace_bytes: 1e9,
        flops_by_micro_batch: Vec::new(),
    }
}

#[test]
fn filters_keep_every_ranked_layout_valid_and_fitting() {
    // 12 heads: tp 8 cannot split them; a global batch of 96 sequences does not divide over
    // dp 64 at any micro-batch size, nor over dp 16 at 4 or 8.
    let mut m = ModelShape::preset("7b").unwrap();
    m.heads = 12;
    m.kv_heads = 4;
    m.head_dim = m.hidden / 12;
    let c = gpu_cluster(64, 40.0);
    let s = space(2048, 96 * 2048);
    let (ranked, rejected) = search(&m, &c, &s);
    assert!(!ranked.is_empty());
    let cap = c.mem_bytes * (1.0 - c.margin);
    for k in &ranked {
        assert_eq!(m.heads % k.tp, 0, "{}", k.name());
        assert!(m.kv_heads.is_multiple_of(k.tp) || k.tp.is_multiple_of(m.kv_heads), "{}", k.name());
        assert_eq!(8 % k.tp, 0, "{}", k.name());
        assert_eq!(k.tp * k.dp, 64);
        assert_eq!(s.global_batch_tokens % (k.micro_batch * s.seq * k.dp), 0, "{}", k.name());
        assert_eq!(k.micro_batch * s.seq * k.dp * k.grad_accum, s.global_batch_tokens);
        assert!(k.mem.total() <= cap, "{}: {} > {cap}", k.name(), k.mem.total());
        k.spec.validate(k.dp, 8 / k.tp).unwrap();
    }
    assert!(ranked.windows(2).all(|w| w[0].step_s <= w[1].step_s), "ranked fastest first");
    assert!(rejected.iter().any(|r| r.layout == "tp8" && r.reason.contains("12 heads")), "{rejected:?}");
    assert!(rejected.iter().any(|r| r.reason.contains("not a multiple")));
    assert!(rejected.iter().any(|r| r.reason.contains("over 36.00 GiB")), "some layout must be over 40 GiB less the margin");
    assert!(ranked.iter().all(|k| k.tp != 8));
    // At 1 GiB nothing fits: everything is rejected, nothing ranked.
    let (none, rej) = search(&m, &gpu_cluster(64, 1.0), &s);
    assert!(none.is_empty() && !rej.is_empty());
}

#[test]
fn ladder_hides_tensor_parallel_all_reduces_and_offload_frees_device_memory() {
    let m = ModelShape::preset("13b").unwrap();
    let c = gpu_cluster(16, 80.0);
    let mut s = space(4096, 256 * 4096);
    s.partial_checkpointing = false;
    let (plain, _) = search(&m, &c, &s);
    s.ladder_layers = Some(m.layers);
    let (ladder, _) = search(&m, &c, &s);
    let tp4 = |v: &[Candidate]| v.iter().find(|k| k.tp == 4).cloned().unwrap();
    let (p, l) = (tp4(&plain), tp4(&ladder));
    assert!(p.tp_comm_s > 0.0 && l.tp_comm_s < p.tp_comm_s, "{} vs {}", l.tp_comm_s, p.tp_comm_s);
    s.ladder_layers = None;
    s.offload = Some(OffloadRates {
        cpu_adam_elems_per_s: 1e9,
        gpu_adam_elems_per_s: 7e10,
        h2d_bytes_per_s: 25e9,
        d2h_bytes_per_s: 25e9,
        subgroup: 100_000_000,
    });
    let (with, _) = search(&m, &c, &s);
    let off = with.iter().find(|k| k.offload_k.is_some() && k.spec.optim == 1).expect("an offloaded layout");
    // On the device, that layout's optimizer states would take 20 bytes per local element (m,
    // v, two masks, the f32 master); offloaded, two subgroups' 12 bytes.
    let local: u64 = m.bucket_params(off.tp).iter().sum();
    assert_eq!(off.mem.optim, 2.0 * 12.0 * 1e8);
    assert!(off.mem.optim < local as f64 * 20.0 / 10.0, "{} vs {}", off.mem.optim, local as f64 * 20.0);
    assert!(off.offload_s > 0.0);
}

#[test]
fn end_to_end_trials_pick_the_fastest_measured_and_round_trip_into_pretrain() {
    let dir = tmp("autoconfig-e2e");
    let (train, _, _) = shards(&dir);
    let data = train[0].parent().unwrap().to_path_buf();
    let out = dir.join("ac");
    let args: AutoconfigArgs = parse_from([
        "autoconfig",
        "--model=tiny",
        "--seq-len=32",
        "--global-batch-tokens=512",
        "--micro-batches=2,4",
        "--trials=3",
        "--trial-steps=2",
        "--mem-cap-mib=512",
        &format!("--data={}", data.display()),
        &format!("--out={}", out.display()),
    ])
    .unwrap();
    let r = autoconfig(&args).unwrap();
    assert_eq!(r.measured.len(), 3);
    // Trials are the top of the modelled ranking, in that order before re-ranking.
    let top: Vec<String> = r.ranked.iter().take(3).map(|c| c.name()).collect();
    for (c, m) in &r.measured {
        assert!(top.contains(&c.name()), "{} is not in the modelled top 3 {top:?}", c.name());
        assert!(m.step_s > 0.0 && m.loss.is_finite());
    }
    let fastest = r.measured.iter().max_by(|a, b| a.1.tokens_per_s.total_cmp(&b.1.tokens_per_s)).unwrap();
    assert_eq!(r.chosen.name(), fastest.0.name());
    assert_eq!(r.json["chosen"], r.chosen.name());
    assert_eq!(r.json["measured_tokens_per_s"].as_f64().unwrap(), fastest.1.tokens_per_s);

    // The file fills pretrain_llama's flags; a flag given wins.
    let file = TrainConfig::load(&r.config_path).unwrap();
    assert_eq!((file.tp, file.dp, file.batch_size, file.grad_accum), (r.chosen.tp, r.chosen.dp, r.chosen.micro_batch, r.chosen.grad_accum));
    let p = |extra: &[&str]| -> PretrainArgs {
        let base = ["pretrain_llama", "--config-from", r.config_path.to_str().unwrap()];
        apply_config_from(parse_from(base.iter().copied().chain(extra.iter().copied())).unwrap()).unwrap()
    };
    let a = p(&[]);
    let par = &a.train.parallel;
    assert_eq!((par.tp, par.dp), (file.tp, file.dp));
    assert_eq!(
        (par.shard_params, par.shard_grads, par.shard_optim),
        (Some(file.shard_params), Some(file.shard_grads), Some(file.shard_optim))
    );
    assert_eq!((a.train.batch_size, a.train.grad_accum, a.train.seq_len, a.train.lr), (file.batch_size, file.grad_accum, 32, file.lr));
    assert_eq!(Some(a.config.clone()), file.config);
    assert_eq!(file.dtype.as_deref(), Some("f32"), "a CPU target sizes and runs in f32");
    assert_eq!(file.grad_reduce_dtype.as_deref(), Some("f32"), "the layouts were priced with f32 gradients");
    assert_eq!(a.train.parallel.grad_reduce_dtype.to_string(), "f32");
    assert_eq!(a.train.device.dtype, Some(ComputeDtype::F32));
    assert_eq!(p(&["--batch-size=3"]).train.batch_size, 3);
    recipe_is_what_trains(&r, &a, &file);
    assert_eq!(p(&["--warmup-steps", "7"]).train.options().warmup_steps, 7, "a flag given wins over the file");
    assert_eq!(p(&["--warmup-steps=9"]).train.options().warmup_steps, 9);
    // No MFU on thread ranks: they have no peak.
    let table = ferrolm::cli::autoconfig::layout_table(&args.request().unwrap(), &r, 3);
    assert!(table.lines().count() > 1 && table.lines().skip(1).all(|l| l.trim_end().ends_with(" -")), "an MFU on the CPU:\n{table}");
    assert!(file.predicted.as_ref().is_some_and(|p| p["mfu"].is_null()), "{:?}", file.predicted);

    // And it trains with that layout.
    let run = dir.join("run");
    let args = parse_from::<PretrainArgs, _, _>([
        "pretrain_llama",
        "--device=cpu",
        "--config-from",
        r.config_path.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps=2",
        "--eval-every=0",
        "--save-every=0",
        "--out",
        run.to_str().unwrap(),
    ])
    .unwrap();
    ferrolm::cli::pretrain::run(args).unwrap();
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().filter(|l| l.contains("\"loss\"")).count() >= 2, "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_from_rejects_bad_files_naming_them() {
    let dir = tmp("autoconfig-bad");
    let run = |text: &str| -> String {
        let f = dir.join("train_config.json");
        std::fs::write(&f, text).unwrap();
        let a: PretrainArgs = parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap()]).unwrap();
        format!("{:#}", apply_config_from(a).unwrap_err())
    };
    let good = r#""tp":1,"dp":2,"shard_params":1,"shard_grads":1,"shard_optim":2,"ranks_per_node":2,"batch_size":2,"grad_accum":1,"seq_len":32,"lr":0.001,"activation_checkpointing":false"#;
    assert!(run(&format!("{{{good},\"tpp\":2}}")).contains("unknown field `tpp`"));
    assert!(run(&format!("{{{}}}", good.replace("\"dp\":2", "\"dp\":0"))).contains("dp must be at least 1"));
    assert!(run(&format!("{{{}}}", good.replace("\"lr\":0.001", "\"lr\":\"fast\""))).contains("train_config.json"));
    assert!(run(&format!("{{{good},\"offload_gpu_every\":\"often\"}}")).contains("offload_gpu_every"));
    assert!(run("{").contains("is not a train_config.json"));
    // A flag given on the command line wins even at its default value (dp 1, batch 16, lr 2e-3):
    // the file says dp 2, batch 2 and lr 1e-3.
    let f = dir.join("train_config.json");
    std::fs::write(&f, format!("{{{good}}}")).unwrap();
    let given = ["pretrain_llama", "--config-from", f.to_str().unwrap(), "--dp", "1", "--batch-size=16", "--lr", "2e-3"];
    let a = apply_config_from(parse_from(given).unwrap()).unwrap();
    assert_eq!((a.train.parallel.dp, a.train.batch_size, a.train.lr), (1, 16, 2e-3));
    let a = apply_config_from(parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap()]).unwrap()).unwrap();
    assert_eq!((a.train.parallel.dp, a.train.batch_size, a.train.lr), (2, 2, 1e-3), "not given: from the file");
    // The offload keys become pretrain_llama's offload flags.
    for (every, want) in [("\"inf\"", GpuEvery::Never), ("\"auto\"", GpuEvery::Auto), ("2", GpuEvery::Every(2))] {
        let f = dir.join("train_config.json");
        std::fs::write(&f, format!("{{{good},\"offload_optimizer\":true,\"offload_gpu_every\":{every}}}")).unwrap();
        let a = apply_config_from(parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap()]).unwrap()).unwrap();
        assert!(a.train.parallel.offload_optimizer);
        assert_eq!(a.train.parallel.offload_gpu_every, want, "{every}");
    }
    // The gradient dtype the layout was priced in fills --grad-reduce-dtype; a bad one is named.
    std::fs::write(&f, format!("{{{good},\"grad_reduce_dtype\":\"bf16\"}}")).unwrap();
    let a = apply_config_from(parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap()]).unwrap()).unwrap();
    assert_eq!(a.train.parallel.grad_reduce_dtype.to_string(), "bf16");
    let given = ["pretrain_llama", "--config-from", f.to_str().unwrap(), "--grad-reduce-dtype=f32"];
    assert_eq!(apply_config_from(parse_from(given).unwrap()).unwrap().train.parallel.grad_reduce_dtype.to_string(), "f32");
    assert!(run(&format!("{{{good},\"grad_reduce_dtype\":\"f16\"}}")).contains("grad_reduce_dtype"));
    // The dtype the layout was sized for fills --dtype, unless --dtype is given; a bad one is named.
    std::fs::write(&f, format!("{{{good},\"dtype\":\"bf16\"}}")).unwrap();
    let a = apply_config_from(parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap()]).unwrap()).unwrap();
    assert_eq!(a.train.device.dtype, Some(ComputeDtype::Bf16));
    let a = apply_config_from(parse_from(["pretrain_llama", "--config-from", f.to_str().unwrap(), "--dtype=f32"]).unwrap()).unwrap();
    assert_eq!(a.train.device.dtype, Some(ComputeDtype::F32));
    assert!(run(&format!("{{{good},\"dtype\":\"f16\"}}")).contains("dtype must be \"f32\" or \"bf16\", got \"f16\""));
    let missing: PretrainArgs = parse_from(["pretrain_llama", "--config-from", "/nonexistent/tc.json"]).unwrap();
    assert!(format!("{:#}", apply_config_from(missing).unwrap_err()).contains("/nonexistent/tc.json"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_lists_every_flag_with_its_default() {
    use ferrolm::cli::Tool;
    let mut cmd = AutoconfigArgs::cli();
    let help = cmd.render_long_help().to_string();
    assert!(help.contains("Environment:") && help.contains("train_config.json"));
    for arg in cmd.get_arguments().filter(|a| a.get_id() != "help" && a.get_id() != "version") {
        let flag = format!("--{}", arg.get_long().unwrap());
        assert!(help.contains(&flag), "--help does not list {flag}");
        let takes_value = arg.get_action().takes_values();
        let doc = arg.get_long_help().or(arg.get_help()).map(|s| s.to_string()).unwrap_or_default();
        if takes_value && arg.get_default_values().is_empty() {
            assert!(doc.contains("[default:"), "{flag} neither has a default nor says what it defaults to: {doc:?} / {:?}", arg.get_help());
        }
    }
    // Bad flags are clap's errors, naming the flag.
    let e = parse_from::<AutoconfigArgs, _, _>(["autoconfig", "--days=3"]).unwrap_err().to_string();
    assert!(e.contains("--tflops-per-gpu"), "{e}");
    let e = parse_from::<AutoconfigArgs, _, _>(["autoconfig", "--target=tpu"]).unwrap_err().to_string();
    assert!(e.contains("tpu"), "{e}");
}

/// Trials run on CPU thread ranks only: asked for on a modelled GPU cluster, they are refused
/// by name before anything is prepared or written; on thread ranks the request carries them
/// with their data.
#[test]
fn trials_belong_to_thread_ranks() {
    use ferrolm::autoconfig::Machines;
    let out = common::tmp("autoconfig-trials-gpu").join("out");
    let o = out.to_str().unwrap();
    let a: AutoconfigArgs = parse_from(["autoconfig", "--model", "7b", "--gpus", "16", "--trials", "2", "--out", o]).unwrap();
    let e = format!("{:#}", a.request().unwrap_err());
    assert!(e.contains("--trials") && e.contains("--target cpu"), "{e}");
    assert!(!out.exists(), "a refused request wrote {}", out.display());
    let a: AutoconfigArgs = parse_from(["autoconfig", "--model", "7b", "--gpus", "16", "--out", o]).unwrap();
    assert!(matches!(a.request().unwrap().machines, Machines::Gpus { offload: None, .. }));
    let (train, _, _) = shards(&common::tmp("autoconfig-trials-cpu"));
    let data = train[0].parent().unwrap().to_str().unwrap().to_string();
    let a: AutoconfigArgs =
        parse_from(["autoconfig", "--model", "tiny", "--trials", "2", "--trial-steps", "4", "--data", &data, "--out", o]).unwrap();
    match a.request().unwrap().machines {
        Machines::Threads { trials: Some(t), .. } => assert!(t.count == 2 && t.steps == 4 && !t.data.train.is_empty(), "{t:?}"),
        m => panic!("trials on thread ranks were dropped: {m:?}"),
    }
}

#[test]
fn planner_counts_nccl_buffers_per_communicator() {
    use ferrolm::planner::step::evaluate;
    use ferrolm::planner::{Workload, NCCL_BYTES_PER_COMMUNICATOR};
    use ferrolm_parallel::zero::groups::communicators;
    use ferrolm_parallel::zero::ShardSpec;
    let m = ModelShape::preset("7b").unwrap();
    let w = Workload {
        seq: 2048,
        micro_batch: 1,
        global_batch_tokens: 64 * 2048,
        tp: 2,
        elem_bytes: 2,
        grad_bytes: 4,
        checkpointed_layers: 0,
        loss_chunks: Default::default(),
    };
    let with = gpu_cluster(16, 80.0);
    let without = Cluster { comm_buffer_bytes: 0.0, ..with.clone() };
    for spec in [ShardSpec::zero(3, 8).unwrap(), ShardSpec::mics(2), ShardSpec { params: 2, grads: 2, optim: 4 }] {
        let (a, b) = (evaluate(&m, &with, &w, spec).unwrap(), evaluate(&m, &without, &w, spec).unwrap());
        let n = communicators(2, 8, spec, m.kv_heads);
        // The world, the tp and dp groups at least; the engine's sub-groups where they differ.
        assert!(n >= 3, "{spec}: {n} communicators");
        assert_eq!(a.mem.total() - b.mem.total(), n as f64 * NCCL_BYTES_PER_COMMUNICATOR, "{spec}");
        assert_eq!(a.mem.workspace, n as f64 * NCCL_BYTES_PER_COMMUNICATOR, "{spec}");
    }
    // A lone GPU holds no communicator.
    let one = Cluster { gpus: 1, ..with.clone() };
    let w1 = Workload { tp: 1, global_batch_tokens: 2048, ..w.clone() };
    assert_eq!(evaluate(&m, &one, &w1, ShardSpec::zero(0, 1).unwrap()).unwrap().mem.workspace, 0.0);
}

/// Every row of the recipe autoconfig prints is what `pretrain_llama --config-from` trains (the
/// options `a` the file gave, ferrolm's AdamW, the model config the file names).
fn recipe_is_what_trains(r: &ferrolm::cli::autoconfig::Report, a: &PretrainArgs, file: &TrainConfig) {
    use ferrolm::nn::optim::AdamWConfig;
    let (h, o) = (&r.hyper, a.train.options());
    let adamw = ferrolm::train::Trainer::adamw_config(&o);
    let row = |name: &str| h.rows.iter().find(|x| x.name == name).unwrap_or_else(|| panic!("no row {name}")).value.clone();
    let names: Vec<&str> = h.rows.iter().map(|x| x.name).collect();
    let checked = [
        "peak lr",
        "schedule",
        "warmup",
        "global batch",
        "weight decay",
        "AdamW betas",
        "AdamW eps",
        "init std",
        "gradient clipping",
        "precision",
        "tokens",
    ];
    assert_eq!(names, checked, "a row this test does not hold to what trains");
    assert_eq!((o.lr, o.min_lr), (h.lr, h.min_lr), "peak lr and the cosine's floor");
    assert_eq!(row("peak lr"), format!("{:.1e}", o.lr));
    assert_eq!(o.warmup_steps, h.warmup_steps, "warmup");
    assert_eq!(row("warmup"), format!("{} steps", o.warmup_steps));
    assert!(o.warmup_steps < o.steps, "the warmup fits the recipe's run");
    assert_eq!(Some(o.steps), file.steps);
    assert_eq!(row("tokens"), format!("{:.3e}: {} steps", h.chinchilla_tokens, o.steps), "no budget: Chinchilla's tokens");
    let global = o.batch_size * o.grad_accum * a.train.parallel.dp * o.seq_len;
    assert_eq!(global, h.global_batch_tokens, "global batch");
    assert_eq!(row("global batch"), format!("{} x {} = {global} tokens", global / o.seq_len, o.seq_len));
    assert_eq!((adamw.weight_decay, o.weight_decay), (h.weight_decay, h.weight_decay), "weight decay");
    assert_eq!(row("weight decay"), format!("{}", o.weight_decay));
    assert_eq!((adamw.beta1, adamw.beta2, adamw.eps), (h.beta1, h.beta2, h.eps), "AdamW");
    assert_eq!(row("AdamW betas"), format!("({}, {})", adamw.beta1, adamw.beta2));
    assert_eq!(row("AdamW eps").parse::<f64>().unwrap(), AdamWConfig::default().eps);
    assert_eq!(o.grad_clip, h.grad_clip);
    assert_eq!(row("gradient clipping").parse::<f64>().unwrap(), o.grad_clip);
    let cfg = ferrolm::nn::LlamaConfig::from_file(file.config.as_ref().expect("the CPU target writes config.json")).unwrap();
    assert_eq!(cfg.initializer_range, h.init_std, "init std");
    assert_eq!(row("init std").parse::<f64>().unwrap(), cfg.initializer_range);
    assert_eq!(a.train.device.dtype, Some(ComputeDtype::F32));
    assert_eq!(row("precision"), "f32", "the precision row is the dtype that trains");
}
