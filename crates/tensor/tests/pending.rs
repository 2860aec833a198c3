//! Pending values (a collective's result still in flight): waited on at first use, errors
//! surface at that use, and backward does not force the wait while other work is ready.
use ferrolm_tensor::{CpuStorage, DType, Device, Storage, Tensor};
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<&'static str>>>;

/// A pending copy of `x` whose fill logs "wait" when it runs.
fn pending_copy(x: &Tensor, log: &Log) -> Tensor {
    let data = x.to_cpu_storage().unwrap();
    let log = log.clone();
    let empty = Storage::Cpu(CpuStorage::zeros(x.numel(), x.dtype()));
    Tensor::pending(
        empty,
        x.shape().clone(),
        Box::new(move |s| {
            log.lock().unwrap().push("wait");
            *s = Storage::Cpu(data);
            Ok(())
        }),
    )
    .unwrap()
}

#[test]
fn pending_value_waits_on_first_read_only() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let log: Log = Arc::default();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], Device::Cpu).unwrap();
    let p = pending_copy(&x, &log);
    assert!(p.is_pending());
    // Views and shape queries do not wait.
    let v = p.reshape([3, 1]).unwrap();
    assert_eq!(v.dims(), [3, 1]);
    assert!(log.lock().unwrap().is_empty());
    let y = v.add_scalar(1.0).unwrap();
    assert_eq!(*log.lock().unwrap(), ["wait"]);
    assert!(!p.is_pending());
    assert_eq!(y.to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0]);
    assert_eq!(p.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    assert_eq!(log.lock().unwrap().len(), 1, "the fill runs once");
}

#[test]
fn failed_fill_is_an_error_at_every_use() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let empty = Storage::Cpu(CpuStorage::zeros(2, DType::F32));
    let p =
        Tensor::pending(empty, [2], Box::new(|_| Err(ferrolm_tensor::Error::new("all_reduce", "rank 1 timed out after 600 s")))).unwrap();
    assert!(p.is_pending());
    for _ in 0..2 {
        let e = p.add_scalar(1.0).unwrap_err().to_string();
        assert!(e.contains("rank 1 timed out"), "{e}");
        assert!(!p.is_pending(), "a failed fill is no longer in flight");
    }
    assert!(p.wait().is_err());
}

#[test]
fn fill_of_the_wrong_size_is_an_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let empty = Storage::Cpu(CpuStorage::zeros(2, DType::F32));
    let p = Tensor::pending(
        empty,
        [2],
        Box::new(|s| {
            *s = Storage::Cpu(CpuStorage::zeros(3, DType::F32));
            Ok(())
        }),
    )
    .unwrap();
    let e = p.wait().unwrap_err().to_string();
    assert!(e.contains("promised"), "{e}");
}

/// y = comm(x1 * 2) + exp(x2 * 3), where comm's backward returns a pending gradient. The
/// exp branch is older, so plain newest-first order would wait on the pending gradient
/// first; the engine runs the exp branch's backward while the gradient is in flight.
#[test]
fn backward_defers_pending_gradients_while_other_work_is_ready() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let log: Log = Arc::default();
    let x1 = Tensor::from_vec(vec![0.5f64, -1.0], [2], Device::Cpu).unwrap();
    let x2 = Tensor::from_vec(vec![0.25f64, 2.0], [2], Device::Cpu).unwrap();
    x1.set_requires_grad(true).unwrap();
    x2.set_requires_grad(true).unwrap();

    let u2 = x2.mul_scalar(3.0).unwrap();
    let l2 = log.clone();
    let v2 = Tensor::from_op(
        u2.exp().unwrap(),
        "logged_identity",
        &[&u2.exp().unwrap()],
        Box::new(move |g| {
            l2.lock().unwrap().push("other branch");
            Ok(vec![Some(g.clone())])
        }),
    );
    let u1 = x1.mul_scalar(2.0).unwrap();
    let l1 = log.clone();
    let v1 = Tensor::from_op(u1.detach(), "comm", &[&u1], Box::new(move |g| Ok(vec![Some(pending_copy(g, &l1))])));
    let y = v1.add(&v2).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(*log.lock().unwrap(), ["other branch", "wait"], "the pending gradient was waited on before other ready work");
    assert_eq!(x1.grad().unwrap().to_vec::<f64>().unwrap(), [2.0, 2.0]);
    let want: Vec<f64> = [0.25f64, 2.0].iter().map(|v| 3.0 * (3.0 * v).exp()).collect();
    let got = x2.grad().unwrap().to_vec::<f64>().unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12 * b.abs(), "{got:?} vs {want:?}");
    }
}

/// Several contributions to one gradient are summed in arrival order, pending or not: the
/// result equals the eager sum bit for bit.
#[test]
fn pending_contributions_sum_like_eager_ones() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = |pend: bool| {
        let log: Log = Arc::default();
        let x = Tensor::from_vec(vec![0.1f32, 0.7, -0.3], [3], Device::Cpu).unwrap();
        x.set_requires_grad(true).unwrap();
        let branch = |k: f64| {
            let u = x.mul_scalar(k).unwrap();
            let l = log.clone();
            Tensor::from_op(
                u.detach(),
                "comm",
                &[&u],
                Box::new(move |g| Ok(vec![Some(if pend { pending_copy(g, &l) } else { g.clone() })])),
            )
        };
        let y = branch(0.3).add(&branch(1.7)).unwrap().mul(&branch(-2.9)).unwrap().sum_all().unwrap();
        y.backward().unwrap();
        x.grad().unwrap().to_vec::<f32>().unwrap()
    };
    assert_eq!(run(true), run(false));
}

/// Gives back `data` each time it is asked, counting the calls.
struct CountingRefill {
    data: Vec<f32>,
    calls: Mutex<usize>,
}
impl ferrolm_tensor::Refill for CountingRefill {
    fn refill(&self) -> ferrolm_tensor::Result<Storage> {
        *self.calls.lock().unwrap() += 1;
        Ok(Storage::Cpu(CpuStorage::F32(self.data.clone())))
    }
}

/// A released tensor gives its bytes back to the accounting, refills on the next read (through
/// every view), and a prefetch replaces the refill.
#[test]
fn released_storage_refills_on_read() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let data: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let flat = Tensor::from_vec(data.clone(), [1000], Device::Cpu).unwrap();
    let view = flat.narrow(0, 10, 20).unwrap().reshape([4, 5]).unwrap();
    let refill = Arc::new(CountingRefill { data: data.clone(), calls: Mutex::new(0) });
    let before = ferrolm_tensor::live_bytes();
    flat.release(refill.clone()).unwrap();
    assert!(flat.is_released() && view.is_released());
    assert!(!flat.is_pending(), "released bytes are not a fill in flight");
    assert_eq!(before - ferrolm_tensor::live_bytes(), 4000, "release frees the bytes");
    let s = view.sum_all().unwrap().item().unwrap();
    assert_eq!(s, (10..30).sum::<i32>() as f64);
    assert_eq!(*refill.calls.lock().unwrap(), 1);
    assert!(!flat.is_released());
    assert_eq!(ferrolm_tensor::live_bytes(), before);

    // Released again, then prefetched: the read runs the prefetch's fill, not the refill.
    flat.release(refill.clone()).unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    let d2 = data.clone();
    let prefetched = flat
        .prefetch(Box::new(move |s| {
            l.lock().unwrap().push("wait");
            *s = Storage::Cpu(CpuStorage::F32(d2));
            Ok(())
        }))
        .unwrap();
    assert!(prefetched);
    assert!(flat.is_pending() && !flat.is_released(), "a prefetch is a fill in flight");
    assert_eq!(view.to_vec::<f32>().unwrap()[0], 10.0);
    assert_eq!(*log.lock().unwrap(), ["wait"]);
    assert_eq!(*refill.calls.lock().unwrap(), 1, "prefetched bytes need no refill");
    // Prefetching a cell that is not released is a no-op.
    assert!(!flat.prefetch(Box::new(|_| Ok(()))).unwrap());
    // A refill of the wrong size is an error, not garbage.
    let bad = Arc::new(CountingRefill { data: vec![0.0; 3], calls: Mutex::new(0) });
    flat.release(bad).unwrap();
    assert!(view.sum_all().unwrap_err().to_string().contains("promised"));
}

/// live_bytes is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A weight gradient deferred as local work runs while communication launched after it is in
/// flight: the engine launches the collective (the input gradient's all-reduce), then computes
/// the deferred weight gradient, then waits for the collective.
#[test]
fn deferred_weight_gradients_run_while_communication_is_in_flight() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let log: Log = Arc::default();
    let w = Tensor::from_vec(vec![2.0f64, 3.0], [2], Device::Cpu).unwrap();
    w.set_requires_grad(true).unwrap();
    let x = Tensor::from_vec(vec![1.0f64, -1.0], [2], Device::Cpu).unwrap();
    x.set_requires_grad(true).unwrap();
    // "comm": identity forward, its backward launches a pending (logged) copy.
    let l1 = log.clone();
    let xf = Tensor::from_op(x.detach(), "comm", &[&x], Box::new(move |g| Ok(vec![Some(pending_copy(g, &l1))])));
    // "linear": y = xf * w; backward: dx now, dw deferred (logged when computed).
    let (xs, ws, l2) = (xf.clone(), w.clone(), log.clone());
    let y = Tensor::from_op(
        xf.mul(&w).unwrap().detach(),
        "linear",
        &[&xf, &w],
        Box::new(move |g| {
            let dx = g.mul(&ws)?;
            let (g, xs, l2) = (g.clone(), xs.clone(), l2.clone());
            let dw = Tensor::deferred(g.shape().clone(), g.dtype(), g.device(), move || {
                l2.lock().unwrap().push("weight gradient");
                g.mul(&xs)
            })?;
            Ok(vec![Some(dx), Some(dw)])
        }),
    );
    y.sum_all().unwrap().backward().unwrap();
    // The weight gradient was computed during backward, the collective not waited on (x's
    // gradient is handed over pending): the work overlapped the communication.
    assert_eq!(*log.lock().unwrap(), ["weight gradient"]);
    assert!(x.grad().unwrap().is_pending());
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), [1.0, -1.0]);
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), [2.0, 3.0]);
    assert_eq!(*log.lock().unwrap(), ["weight gradient", "wait"]);
    assert!(!w.grad().unwrap().is_pending());
}
