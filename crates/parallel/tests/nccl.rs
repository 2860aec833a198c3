//! The NCCL path: what runs without a GPU (launcher environment, library search, the
//! world-of-one fallback), and the GPU tests, which skip without a GPU (saying so) and fail
//! instead under FERROLM_REQUIRE_GPU=1.
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_parallel::store::{Store, StoreServer};
use ferrolm_parallel::{library_candidates, nccl_version, CommOptions, Communicator, DistEnv, NcclComm, ReduceOp};
use ferrolm_tensor::{backend, DType, Device, Tensor};
use ferrolm_testing::{gate, Need};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

#[test]
fn the_launcher_environment_is_parsed_with_errors_naming_the_variable() {
    assert_eq!(DistEnv::from_lookup(&lookup(&[])).unwrap(), None, "no launcher: single process");
    let torchrun = [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29400")];
    let e = DistEnv::from_lookup(&lookup(&torchrun)).unwrap().unwrap();
    assert_eq!(e, DistEnv::local(3, 8, "node0", 29400));
    let ompi = [
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "16"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
    ];
    let e = DistEnv::from_lookup(&lookup(&ompi)).unwrap().unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank), (5, 16, 1));
    let err = |vars: &[(&str, &str)]| DistEnv::from_lookup(&lookup(vars)).unwrap_err().to_string();
    assert!(err(&[("WORLD_SIZE", "two")]).contains("WORLD_SIZE=\"two\""));
    assert!(err(&[("WORLD_SIZE", "2")]).contains("RANK is not"));
    assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("RANK=2 is not below WORLD_SIZE=2"));
    assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "1")]).contains("LOCAL_RANK"));
    assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")]).contains("MASTER_ADDR"));
    assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "99999")])
        .contains("MASTER_PORT"));
}

#[test]
fn the_nccl_search_covers_explicit_paths_and_pip_wheels() {
    let root = std::env::temp_dir().join(format!("ferrolm-nccl-search-{}", std::process::id()));
    let lib = root.join("lib/python3.12/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libnccl.so.2"), b"not really").unwrap();
    let venv = root.to_str().unwrap().to_string();
    let c = library_candidates(&lookup(&[("VIRTUAL_ENV", &venv), ("FERROLM_NCCL_LIB", "/opt/nccl/libnccl.so.2")]));
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(c[..3], ["/opt/nccl/libnccl.so.2", "libnccl.so.2", "libnccl.so"]);
    let wheel = format!("{venv}/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
    assert!(c.contains(&wheel), "{c:?}");
}

#[test]
fn nccl_is_found_or_the_error_says_how_to_provide_it() {
    match nccl_version() {
        Ok((path, v)) => assert!(v >= 21800, "{path}: NCCL {v}"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("libnccl.so.2") && e.contains("FERROLM_NCCL_LIB"), "{e}");
            eprintln!("NCCL is not installed here: {e}");
        }
    }
}

#[test]
fn without_a_launcher_the_world_is_one_rank() {
    let comm = ferrolm_parallel::init(None, CommOptions::default()).unwrap();
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let x = Tensor::from_vec(vec![1.5f32, -2.0], [2], Device::Cpu).unwrap();
    let y = comm.all_reduce_async(&x, ReduceOp::Avg).unwrap().tensor();
    assert!(y.is_pending());
    assert_eq!(y.to_vec::<f32>().unwrap(), [1.5, -2.0]);
    assert!(!y.shares_storage(&x), "a collective's result is a copy");
    let env = DistEnv::local(0, 2, "127.0.0.1", 1);
    if ferrolm_cuda::device_count() == 0 {
        let e = ferrolm_parallel::init(Some(env), CommOptions::default()).err().unwrap().to_string();
        assert!(e.contains("needs NCCL on a GPU"), "{e}");
    }
}

/// The backends of `n` GPUs with NCCL present, or None (skip) with the reason printed.
fn gpus(n: usize) -> Option<Vec<Arc<CudaBackend>>> {
    let have = ferrolm_cuda::device_count();
    if have < n {
        gate::skip(Need::Gpus(n), format!("NcclComm needs {n} CUDA GPU(s), {have} visible; nothing of the NCCL path ran"));
        return None;
    }
    gate::require(Need::Gpus(1), nccl_version().map_err(|e| format!("NCCL cannot be loaded: {e}")))?;
    Some(
        (0..n)
            .map(|i| {
                let b = CudaBackend::new(i, KernelImage::Sources(ferrolm_cuda::KERNEL_SOURCES)).unwrap();
                backend::register(b.clone());
                b
            })
            .collect(),
    )
}

fn opts() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(60))
}

#[test]
fn nccl_world_of_one_runs_every_collective_on_the_gpu() {
    let Some(be) = gpus(1) else { return };
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let store = Arc::new(Store::connect(&server.addr().to_string(), 0, 1, Duration::from_secs(30)).unwrap());
    let comm: Arc<dyn Communicator> = NcclComm::init(0, 1, store, be[0].clone(), opts()).unwrap();
    let dev = Device::Cuda(0);
    let v: Vec<f32> = (0..1023).map(|i| i as f32 * 0.5 - 7.0).collect();
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::from_vec(v.clone(), [1023], Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap();
        let want = x.to_vec_f64().unwrap();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let y = comm.all_reduce_async(&x, op).unwrap().tensor();
            assert!(y.is_pending());
            assert_eq!(y.to_vec_f64().unwrap(), want, "{op} {dtype}");
        }
        assert_eq!(comm.all_gather(&x).unwrap().to_vec_f64().unwrap(), want);
        assert_eq!(comm.reduce_scatter(&x, ReduceOp::Sum).unwrap().to_vec_f64().unwrap(), want);
        assert_eq!(comm.broadcast(&x, 0).unwrap().to_vec_f64().unwrap(), want);
        // A kernel reading the pending result runs after the collective on the compute stream.
        let z = comm.all_reduce_async(&x, ReduceOp::Sum).unwrap().tensor().mul_scalar(2.0).unwrap();
        let want2: Vec<f64> = want.iter().map(|a| a * 2.0).collect();
        assert_eq!(z.to_vec_f64().unwrap(), want2);
    }
    // Results dropped unread, while new buffers are allocated from the same pool.
    let big = Tensor::ones([1 << 20], DType::F32, dev).unwrap();
    for _ in 0..50 {
        drop(comm.all_reduce_async(&big, ReduceOp::Sum).unwrap());
        let _ = big.add_scalar(1.0).unwrap();
    }
    assert_eq!(comm.all_reduce(&big, ReduceOp::Sum).unwrap().sum_all().unwrap().item().unwrap(), (1 << 20) as f64);
    let sub = comm.split(0, 0).unwrap();
    assert_eq!((sub.size(), sub.name()), (1, "world/split0"));
    sub.barrier().unwrap();
    comm.barrier().unwrap();
    assert!(comm.stats().all_reduce.calls >= 50);
}

#[test]
fn nccl_two_ranks_on_two_gpus_match_the_reference() {
    let Some(bes) = gpus(2) else { return };
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        for (r, be) in bes.into_iter().enumerate() {
            let addr = addr.clone();
            s.spawn(move || {
                let store = Arc::new(Store::connect(&addr, r, 2, Duration::from_secs(30)).unwrap());
                let comm: Arc<dyn Communicator> = NcclComm::init(r, 2, store, be, opts()).unwrap();
                let dev = Device::Cuda(r);
                let x = Tensor::from_vec(vec![1.0f32 + r as f32, 10.0, 100.0, -1.0], [4], dev).unwrap();
                assert_eq!(comm.all_reduce(&x, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap(), [3.0, 20.0, 200.0, -2.0]);
                assert_eq!(comm.all_reduce(&x, ReduceOp::Max).unwrap().to_vec::<f32>().unwrap(), [2.0, 10.0, 100.0, -1.0]);
                let g = comm.all_gather(&x).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(g, [1.0, 10.0, 100.0, -1.0, 2.0, 10.0, 100.0, -1.0]);
                let rs = comm.reduce_scatter(&x, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(rs, if r == 0 { [3.0, 20.0] } else { [200.0, -2.0] });
                assert_eq!(comm.broadcast(&x, 1).unwrap().to_vec::<f32>().unwrap(), [2.0, 10.0, 100.0, -1.0]);
                let solo = comm.split(r, 0).unwrap();
                assert_eq!(solo.world_ranks(), [r]);
                comm.barrier().unwrap();
            });
        }
    });
}
