//! Every collective of `ThreadComm`, sync and async, against a serial reference computed here
//! (fixed rank order, accumulation in f32 for f32/bf16 and f64 for f64), for odd sizes, every
//! rank, world sizes 1-4, split sub-groups and the device mesh.
use ferrolm_parallel::{Collective, CommOptions, Communicator, ReduceOp, ThreadComm};
use ferrolm_tensor::{bf16, DType, Device, Tensor};
use ferrolm_testing::Need;
use std::time::Duration;

fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(20))
}

/// Rank `r`'s input: values whose f32 sums depend on the order of addition.
fn input(r: usize, len: usize, dtype: DType, device: Device) -> Tensor {
    let v: Vec<f64> = (0..len).map(|i| ((r * 131 + i * 17) % 97) as f64 * 0.37 - 11.3 + (i as f64) * 1e-3 + r as f64 * 3.0).collect();
    Tensor::from_vec(v, [len], Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(device).unwrap()
}

/// The serial reference of `op` over `inputs` (the values each rank holds, exact in f64).
fn reference(op: Collective, dtype: DType, inputs: &[Vec<f64>], rank: usize) -> Vec<f64> {
    let n = inputs.len();
    let round = |x: f64| match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => f64::from(bf16::from_f32(x as f32)),
        _ => x,
    };
    let reduce = |rop: ReduceOp| -> Vec<f64> {
        (0..inputs[0].len())
            .map(|i| {
                if dtype == DType::F64 {
                    let mut a = inputs[0][i];
                    for x in &inputs[1..] {
                        a = if rop == ReduceOp::Max { a.max(x[i]) } else { a + x[i] };
                    }
                    if rop == ReduceOp::Avg {
                        a /= n as f64;
                    }
                    a
                } else {
                    let mut a = inputs[0][i] as f32;
                    for x in &inputs[1..] {
                        a = if rop == ReduceOp::Max { a.max(x[i] as f32) } else { a + x[i] as f32 };
                    }
                    if rop == ReduceOp::Avg {
                        a /= n as f32;
                    }
                    round(a as f64)
                }
            })
            .collect()
    };
    match op {
        Collective::AllReduce(rop) => reduce(rop),
        Collective::AllGather => inputs.concat(),
        Collective::ReduceScatter(rop) => {
            let all = reduce(rop);
            let b = all.len() / n;
            all[rank * b..(rank + 1) * b].to_vec()
        }
        Collective::Broadcast { root } => inputs[root].clone(),
    }
}

fn ops(n: usize) -> Vec<Collective> {
    vec![
        Collective::AllReduce(ReduceOp::Sum),
        Collective::AllReduce(ReduceOp::Avg),
        Collective::AllReduce(ReduceOp::Max),
        Collective::AllGather,
        Collective::ReduceScatter(ReduceOp::Sum),
        Collective::ReduceScatter(ReduceOp::Avg),
        Collective::Broadcast { root: n - 1 },
    ]
}

/// Per-rank input length for `op`: reduce-scatter inputs hold `n` blocks of `len`.
fn len_for(op: Collective, len: usize, n: usize) -> usize {
    if let Collective::ReduceScatter(_) = op {
        len * n
    } else {
        len
    }
}

fn run_op(comm: &dyn Communicator, op: Collective, x: &Tensor) -> ferrolm_parallel::Work {
    match op {
        Collective::AllReduce(r) => comm.all_reduce_async(x, r),
        Collective::AllGather => comm.all_gather_async(x),
        Collective::ReduceScatter(r) => comm.reduce_scatter_async(x, r),
        Collective::Broadcast { root } => comm.broadcast_async(x, root),
    }
    .unwrap()
}

fn run_op_sync(comm: &dyn Communicator, op: Collective, x: &Tensor) -> Tensor {
    match op {
        Collective::AllReduce(r) => comm.all_reduce(x, r),
        Collective::AllGather => comm.all_gather(x),
        Collective::ReduceScatter(r) => comm.reduce_scatter(x, r),
        Collective::Broadcast { root } => comm.broadcast(x, root),
    }
    .unwrap()
}

/// Checks every collective on `comm` (sync, then async launched together and read in reverse).
fn check_all(comm: &dyn Communicator, device: Device, dtypes: &[DType]) {
    let (n, r) = (comm.size(), comm.rank());
    for &dtype in dtypes {
        for len in [1usize, 7, 1023] {
            let cases: Vec<(Collective, Tensor, Vec<f64>)> = ops(n)
                .into_iter()
                .map(|op| {
                    let l = len_for(op, len, n);
                    let inputs: Vec<Vec<f64>> =
                        (0..n).map(|p| input(comm.world_ranks()[p], l, dtype, Device::Cpu).to_vec_f64().unwrap()).collect();
                    (op, input(comm.world_ranks()[r], l, dtype, device), reference(op, dtype, &inputs, r))
                })
                .collect();
            for (op, x, want) in &cases {
                let got = run_op_sync(comm, *op, x);
                assert_eq!(got.device(), device);
                assert_eq!(got.to_vec_f64().unwrap(), *want, "sync {op} {dtype} len {len} rank {r} of {n} ({})", comm.name());
            }
            let works: Vec<_> = cases.iter().map(|(op, x, _)| run_op(comm, *op, x)).collect();
            for ((op, _, want), w) in cases.iter().zip(works).rev() {
                let got = w.tensor();
                assert_eq!(got.to_vec_f64().unwrap(), *want, "async {op} {dtype} len {len} rank {r} of {n}");
                assert!(w.is_done());
            }
        }
    }
}

#[test]
fn every_collective_matches_the_serial_reference() {
    for n in 1..=4 {
        let out = ThreadComm::run(n, opts(), |comm| {
            assert_eq!(comm.size(), n);
            check_all(comm.as_ref(), Device::Cpu, &[DType::F32, DType::BF16, DType::F64]);
            Ok(comm.rank())
        })
        .unwrap();
        assert_eq!(out, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn split_groups_match_the_reference_and_interleave_with_the_parent() {
    ThreadComm::run(4, opts(), |world| {
        let r = world.rank();
        // Odd and even ranks, ordered by descending world rank.
        let g = world.split(r % 2, 10 - r).unwrap();
        assert_eq!(g.size(), 2);
        let want: Vec<usize> = if r % 2 == 0 { vec![2, 0] } else { vec![3, 1] };
        assert_eq!(g.world_ranks(), want.as_slice());
        assert_eq!(g.world_ranks()[g.rank()], r);
        // A parent collective launched between two group collectives.
        let x = input(r, 5, DType::F32, Device::Cpu);
        let a = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
        let w = world.all_reduce_async(&x, ReduceOp::Sum).unwrap();
        let b = g.all_gather_async(&x).unwrap();
        let vals = |ranks: &[usize]| -> Vec<Vec<f64>> {
            ranks.iter().map(|&p| input(p, 5, DType::F32, Device::Cpu).to_vec_f64().unwrap()).collect()
        };
        assert_eq!(b.wait().unwrap().to_vec_f64().unwrap(), reference(Collective::AllGather, DType::F32, &vals(&want), g.rank()));
        assert_eq!(
            w.wait().unwrap().to_vec_f64().unwrap(),
            reference(Collective::AllReduce(ReduceOp::Sum), DType::F32, &vals(&[0, 1, 2, 3]), r)
        );
        assert_eq!(
            a.wait().unwrap().to_vec_f64().unwrap(),
            reference(Collective::AllReduce(ReduceOp::Sum), DType::F32, &vals(&want), g.rank())
        );
        check_all(g.as_ref(), Device::Cpu, &[DType::F32]);
        // A split of a split.
        let solo = g.split(g.rank(), 0).unwrap();
        assert_eq!((solo.size(), solo.world_ranks()), (1, &[r][..]));
        assert!(solo.name().starts_with(g.name()), "{} / {}", solo.name(), g.name());
        check_all(solo.as_ref(), Device::Cpu, &[DType::BF16]);
        g.barrier().unwrap();
        world.barrier().unwrap();
        Ok(())
    })
    .unwrap();
}

/// Ranks sleep different amounts before launching in every run; the reductions (whose f32
/// results depend on the order of addition) agree bit for bit.
#[test]
fn reductions_are_bitwise_deterministic_across_runs() {
    let runs: Vec<Vec<Vec<u32>>> = (0..3)
        .map(|k| {
            ThreadComm::run(4, opts(), |comm| {
                let r = comm.rank();
                std::thread::sleep(Duration::from_millis(((r * 7 + k * 5) % 4) as u64 * 3));
                let x = input(r, 257, DType::F32, Device::Cpu).mul_scalar(1.0 + 1e-3 * r as f64).unwrap();
                let a = comm.all_reduce(&x, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
                let b = comm.reduce_scatter(&Tensor::cat(&[x.clone(), x.clone(), x.clone(), x], 0).unwrap(), ReduceOp::Avg).unwrap();
                Ok(a.into_iter().chain(b.to_vec::<f32>().unwrap()).map(f32::to_bits).collect::<Vec<u32>>())
            })
            .unwrap()
        })
        .collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    // Every rank got the same all-reduce result.
    for r in 1..4 {
        assert_eq!(runs[0][r][..257], runs[0][0][..257]);
    }
}

#[test]
fn stats_count_the_ring_bytes_each_rank_sends() {
    let stats = ThreadComm::run(4, opts(), |comm| {
        let x = Tensor::zeros([1000], DType::F32, Device::Cpu)?;
        comm.all_reduce(&x, ReduceOp::Sum)?;
        comm.all_gather(&Tensor::zeros([10], DType::F32, Device::Cpu)?)?;
        comm.reduce_scatter(&Tensor::zeros([8], DType::BF16, Device::Cpu)?, ReduceOp::Sum)?;
        comm.broadcast(&Tensor::zeros([25], DType::F32, Device::Cpu)?, 1)?;
        Ok(comm.stats())
    })
    .unwrap();
    for (r, s) in stats.iter().enumerate() {
        assert_eq!((s.all_reduce.calls, s.all_reduce.bytes), (1, 2.0 * 3.0 / 4.0 * 4000.0));
        assert_eq!(s.all_gather.bytes, 3.0 * 40.0, "(n-1) x 40 bytes per rank");
        assert_eq!(s.reduce_scatter.bytes, 3.0 / 4.0 * 16.0);
        // Chain 1 -> 2 -> 3 -> 0: rank 0 forwards nothing.
        assert_eq!(s.broadcast.bytes, if r == 0 { 0.0 } else { 100.0 }, "rank {r}");
    }
}

/// Results stay pending while a peer is late; a pending result can feed the next collective
/// without being waited on by the launching thread.
#[test]
fn async_results_are_pending_until_read_and_chain() {
    ThreadComm::run(2, opts(), |comm| {
        let r = comm.rank();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(150));
        }
        let x = Tensor::from_vec(vec![1.0f32 + r as f32, 2.0], [2], Device::Cpu)?;
        let w = comm.all_reduce_async(&x, ReduceOp::Sum)?;
        let y = w.tensor();
        if r == 0 {
            assert!(y.is_pending() && !w.is_done(), "rank 1 has not launched yet");
        }
        let z = comm.all_gather_async(&y)?.tensor();
        assert_eq!(z.to_vec::<f32>()?, [3.0, 4.0, 3.0, 4.0]);
        // The all-gather chained behind the all-reduce: it took the result's host copy on its
        // communication thread, so y itself was never waited for (still pending, its fill not
        // run), and reading it now is at once.
        assert!(w.is_done());
        assert!(y.is_pending(), "the all-gather read y, not the all-reduce's host copy");
        assert_eq!(y.to_vec::<f32>()?, [3.0, 4.0]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn i32_tensors_gather_broadcast_and_sum() {
    ThreadComm::run(3, opts(), |comm| {
        let r = comm.rank() as i32;
        let x = Tensor::from_vec(vec![r, 10 * r], [2], Device::Cpu)?;
        assert_eq!(comm.all_gather(&x)?.to_vec::<i32>()?, [0, 0, 1, 10, 2, 20]);
        assert_eq!(comm.broadcast(&x, 2)?.to_vec::<i32>()?, [2, 20]);
        assert_eq!(comm.all_reduce(&x, ReduceOp::Sum)?.to_vec::<i32>()?, [3, 30]);
        assert!(comm.all_reduce_async(&x, ReduceOp::Avg).is_err(), "averaging integers is refused");
        Ok(())
    })
    .unwrap();
}

#[test]
fn device_mesh_names_tp_and_dp_groups_and_zero_cuts_dp() {
    use ferrolm_parallel::cost::GroupSpan;
    use ferrolm_parallel::mesh::{dp_span, DeviceMesh};
    ThreadComm::run(8, opts(), |world| {
        let r = world.rank();
        let mesh = DeviceMesh::new(world.clone(), 2, 4, 4)?;
        assert_eq!((mesh.tp_rank(), mesh.dp_rank()), (r % 2, r / 2));
        assert_eq!(mesh.tp_group().world_ranks(), [r / 2 * 2, r / 2 * 2 + 1]);
        let t = r % 2;
        assert_eq!(mesh.dp_group().world_ranks(), [t, t + 2, t + 4, t + 6]);
        // The sharded engine's groups cut the dp group (MiCS over blocks of 2): a block of two
        // consecutive dp ranks, and the ranks of one index across the blocks.
        use ferrolm_parallel::zero::{members, ShardPosition, ShardSpec, ZeroGroup};
        let (d, spec) = (r / 2, ShardSpec::mics(2));
        let split = |g: ZeroGroup| {
            let (color, key) = ShardPosition::of(d, spec).split(g, spec);
            mesh.dp_group().split_named(color, key, "zero")
        };
        let (shard, replica) = (split(ZeroGroup::Block)?, split(ZeroGroup::OptimReplicas)?);
        assert_eq!(shard.world_ranks(), [(d / 2 * 2) * 2 + t, (d / 2 * 2 + 1) * 2 + t]);
        assert_eq!(replica.world_ranks(), [(d % 2) * 2 + t, (d % 2 + 2) * 2 + t]);
        let world_of = |dps: Vec<usize>| dps.into_iter().map(|x| x * 2 + t).collect::<Vec<_>>();
        assert_eq!(shard.world_ranks(), world_of(members(ZeroGroup::Block, spec, 4, d)));
        assert_eq!(replica.world_ranks(), world_of(members(ZeroGroup::OptimReplicas, spec, 4, d)));
        // The groups work: sum of world ranks over each.
        let x = Tensor::from_vec(vec![r as f64], [1], Device::Cpu)?;
        for g in [mesh.tp_group(), mesh.dp_group(), &shard, &replica] {
            let want: usize = g.world_ranks().iter().sum();
            assert_eq!(g.all_reduce(&x, ReduceOp::Sum)?.to_vec::<f64>()?, [want as f64], "{}", g.name());
        }
        // 2 dp ranks per node: a block of 2 stays inside, 4 spans two whole nodes.
        assert_eq!(mesh.dp_span(2)?, GroupSpan { per_node: 2, nodes: 1 });
        assert_eq!(mesh.dp_span(4)?, GroupSpan { per_node: 2, nodes: 2 });
        assert!(mesh.dp_span(3).is_err());
        Ok(())
    })
    .unwrap();
    // 4 dp ranks per node: a block of 3 would straddle nodes, 8 is two whole nodes, 6 is not.
    assert!(dp_span(1, 12, 4, 3).unwrap_err().to_string().contains("straddles"));
    assert_eq!(dp_span(1, 16, 4, 8).unwrap(), GroupSpan { per_node: 4, nodes: 2 });
    assert!(dp_span(1, 12, 4, 6).is_err());
    assert!(dp_span(3, 4, 4, 2).unwrap_err().to_string().contains("must divide"));
}

#[test]
fn mesh_rejects_inconsistent_sizes() {
    let e = ThreadComm::run(4, opts(), |world| ferrolm_parallel::mesh::DeviceMesh::new(world, 3, 1, 8).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("tp 3 x dp 1 = 3 ranks, but the world has 4"), "{e}");
    let e = ThreadComm::run(2, opts(), |world| ferrolm_parallel::mesh::DeviceMesh::new(world, 2, 1, 1).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("must stay inside a node"), "{e}");
}

/// Thread ranks on the emulated CUDA device: inputs are read back to the host, results are
/// uploaded to the rank's device.
#[test]
fn emulated_cuda_tensors_are_staged_through_the_host() {
    let Some(be) = ferrolm_testing::gate::require(Need::Emulator, ferrolm_cuda::CudaBackend::emulated(0)) else { return };
    ferrolm_tensor::backend::register(be.clone());
    ThreadComm::run(3, opts(), |comm| {
        let ops = [
            Collective::AllReduce(ReduceOp::Sum),
            Collective::AllGather,
            Collective::ReduceScatter(ReduceOp::Max),
            Collective::Broadcast { root: 1 },
        ];
        for dtype in [DType::F32, DType::BF16] {
            for op in ops {
                let l = len_for(op, 7, 3);
                let inputs: Vec<Vec<f64>> = (0..3).map(|p| input(p, l, dtype, Device::Cpu).to_vec_f64().unwrap()).collect();
                let got = run_op_sync(comm.as_ref(), op, &input(comm.rank(), l, dtype, Device::Cuda(0)));
                assert_eq!(got.device(), Device::Cuda(0));
                assert_eq!(got.to_vec_f64()?, reference(op, dtype, &inputs, comm.rank()), "{op} {dtype}");
            }
        }
        // Norms and failure counts are summed on the device the communicator serves (NCCL
        // refuses host tensors): an f64 scalar on cuda:0.
        let s = ferrolm_parallel::comm::all_reduce_scalar(comm.as_ref(), comm.rank() as f64 + 0.5, Device::Cuda(0))?;
        assert_eq!(s, 0.5 + 1.5 + 2.5);
        Ok(())
    })
    .unwrap();
    drop(be);
}
