//! Pinned host buffers are never freed or reused while a copy into or out of them is in flight.
//! The copies run on a side stream; on the CPU emulator in race mode (a random delay before every
//! queued item), so a drop that does not wait loses an H2D copy (the device keeps its NaN
//! poison), and a reuse or read that does not wait sees stale bytes. On a GPU the same checks run
//! with real asynchronous copies.
use ferrolm_cuda::{CudaBackend, CudaStorage, CudaStream};
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{CpuStorage, DType, Layout, Shape, Storage};
use std::sync::{Arc, RwLockReadGuard};

mod common;
use common::{gpu, gpu_exclusive, Gpu};

fn cs(s: &Storage) -> &CudaStorage {
    match s {
        Storage::Device(d) => d.as_any().downcast_ref::<CudaStorage>().expect("CUDA storage"),
        Storage::Cpu(_) => panic!("expected device storage"),
    }
}
fn down(be: &CudaBackend, s: &Storage, n: usize) -> Vec<f32> {
    match be.to_cpu((s, &Layout::contiguous(Shape::from(vec![n])))).unwrap() {
        CpuStorage::F32(v) => v,
        other => panic!("expected f32, got {:?}", other.dtype()),
    }
}

/// The backend, in race mode on the emulator while alive (seed 7); nothing on a GPU.
struct Race(Gpu<RwLockReadGuard<'static, ()>>);
impl Race {
    fn on(be: Gpu<RwLockReadGuard<'static, ()>>) -> Self {
        be.emulator_race(Some(7));
        Race(be)
    }
}
impl std::ops::Deref for Race {
    type Target = CudaBackend;
    fn deref(&self) -> &CudaBackend {
        &self.0
    }
}
impl Drop for Race {
    fn drop(&mut self) {
        self.0.emulator_race(None);
    }
}

/// The backend in race mode and a side stream for the copies; `None` (skip) without a device.
fn racing() -> Option<(Race, Option<Arc<CudaStream>>)> {
    let be = Race::on(gpu()?);
    let stream = Some(be.new_stream().unwrap());
    Some((be, stream))
}

#[test]
fn a_buffer_dropped_under_an_h2d_copy_completes_it_first() {
    let Some((be, stream)) = racing() else { return };
    let n = 4099;
    let dev = be.full(n, DType::F32, f64::NAN).unwrap();
    let mut hb = be.alloc_pinned(n * 4).unwrap();
    for (i, x) in hb.as_f32_mut().unwrap().iter_mut().enumerate() {
        *x = i as f32 * 0.5;
    }
    be.copy_from_pinned(&mut hb, cs(&dev), stream.as_ref()).unwrap();
    drop(hb); // must wait for (on the emulator: run) the copy before freeing the memory
    be.synchronize().unwrap();
    let got = down(&be, &dev, n);
    assert!(got.iter().enumerate().all(|(i, &x)| x == i as f32 * 0.5), "the copy out of a dropped buffer was lost");
}

#[test]
fn a_buffer_is_not_reused_or_read_before_its_copy_completes() {
    let Some((be, stream)) = racing() else { return };
    let n = 1000;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let (da, db) = (be.from_cpu(&CpuStorage::F32(a.clone())).unwrap(), be.from_cpu(&CpuStorage::F32(b.clone())).unwrap());
    let mut hb = be.alloc_pinned(n * 4).unwrap();
    // D2H of a, then reuse of the buffer for D2H of b: the first must land before the second.
    be.copy_to_pinned(cs(&da), &mut hb, stream.as_ref()).unwrap();
    be.copy_to_pinned(cs(&db), &mut hb, stream.as_ref()).unwrap();
    assert_eq!(hb.as_f32().unwrap(), &b[..], "the later copy must win: copies into one buffer stay in order");
    // H2D out of the buffer, then the host writes into it: the copy must read the old bytes.
    let dst = be.full(n, DType::F32, f64::NAN).unwrap();
    be.copy_from_pinned(&mut hb, cs(&dst), stream.as_ref()).unwrap();
    hb.as_f32_mut().unwrap().fill(7.0);
    be.synchronize().unwrap();
    assert_eq!(down(&be, &dst, n), b, "the host overwrote a buffer while a copy was reading it");
    // A sub-range copy: bytes 40.. of a into a 100-element buffer.
    let mut part = be.alloc_pinned(100 * 4).unwrap();
    be.copy_to_pinned_at(cs(&da), 40, &mut part, stream.as_ref()).unwrap();
    assert_eq!(part.as_f32().unwrap(), &a[10..110]);
    assert!(be.copy_to_pinned_at(cs(&da), (n - 99) * 4, &mut part, None).is_err(), "a range past the end must be an error");
}

#[test]
fn copies_of_independent_buffers_complete_at_synchronize() {
    let Some(be) = gpu().map(Race::on) else { return };
    let n = 64;
    let dev = be.full(2 * n, DType::F32, f64::NAN).unwrap();
    let mut bufs: Vec<_> = (0..2).map(|_| be.alloc_pinned(n * 4).unwrap()).collect();
    for (k, hb) in bufs.iter_mut().enumerate() {
        hb.as_f32_mut().unwrap().fill(k as f32 + 1.0);
        be.copy_from_pinned_at(hb, cs(&dev), k * n * 4, None).unwrap();
    }
    be.synchronize().unwrap();
    assert!(bufs.iter().all(|b| !b.in_flight()));
    let got = down(&be, &dev, 2 * n);
    assert!(got[..n].iter().all(|&x| x == 1.0) && got[n..].iter().all(|&x| x == 2.0), "{got:?}");
}

#[test]
fn a_detached_copy_keeps_its_source_alive_until_waited_for() {
    let Some((be, stream)) = racing() else { return };
    let n = 2048;
    let want: Vec<f32> = (0..n).map(|i| i as f32 + 0.25).collect();
    let src = be.from_cpu(&CpuStorage::F32(want.clone())).unwrap();
    let mut hb = be.alloc_pinned(n * 4).unwrap();
    let raw = cs(&src) as *const CudaStorage;
    // SAFETY (test): `src` moves into the box below but stays at the same heap address (the
    // storage is boxed inside `Storage::Device`), and the copy is issued before anything drops it.
    be.copy_to_pinned_detached(unsafe { &*raw }, 0, &mut hb, stream.as_ref(), Box::new(src)).unwrap();
    // Were the source freed now, this allocation of the same size would reuse its block and
    // poison it with NaN (FERROLM_CUDA_POISON=1) before the delayed copy reads it.
    let other = be.full(n, DType::F32, f64::NAN).unwrap();
    let got = hb.as_f32().unwrap();
    assert!(got == &want[..], "the detached copy read memory its source no longer owned (first: {})", got[0]);
    drop(other);
}

/// `copy_to_pinned_after_event`: a D2H copy of memory that another stream writes (here a chain
/// of H2D copies on a producer stream; in training a collective's result on the communicator's
/// stream) waits on the producer's event on the copy stream, so it sees the last write. Neither
/// the host nor the compute stream is involved. On the emulator in race mode, five seeds; then
/// the mutation: with the event wait removed (`emulator_skip_copy_wait`), the copy runs ahead of
/// the producer and race mode shows it.
#[test]
fn a_copy_behind_an_event_sees_the_producers_data_only_through_the_wait() {
    let Some(be) = gpu_exclusive() else { return };
    let n = 1024;
    let writes = 48;
    let (producer, copier) = (be.new_stream().unwrap(), be.new_stream().unwrap());
    let mut stage: Vec<_> = (0..writes).map(|_| be.alloc_pinned(n * 4).unwrap()).collect();
    for (k, b) in stage.iter_mut().enumerate() {
        b.as_f32_mut().unwrap().fill(k as f32 + 1.0);
    }
    let want = vec![writes as f32; n];
    // One run: a NaN-poisoned buffer written `writes` times on the producer stream, then read
    // from byte 4 * 16 on by the copy behind the producer's event. Returns what the host got.
    let mut run = |seed: Option<u64>, skip_wait: bool| -> Vec<f32> {
        be.emulator_race(seed);
        be.emulator_skip_copy_wait(skip_wait);
        let dev = be.full(n + 16, DType::F32, f64::NAN).unwrap();
        be.synchronize().unwrap();
        for b in stage.iter_mut() {
            be.copy_from_pinned_at(b, cs(&dev), 16 * 4, Some(&producer)).unwrap();
        }
        let ready = be.record_event(&producer).unwrap();
        let mut hb = be.alloc_pinned(n * 4).unwrap();
        let (ptr, bytes) = (cs(&dev).device_ptr(), (n + 16) * 4);
        // SAFETY: `dev` is a live allocation of `bytes` bytes kept alive below until `hb` has
        // been read; its writes are the producer's copies, all before `ready`.
        unsafe { be.copy_to_pinned_after_event(&ready, ptr, bytes, 16 * 4, &mut hb, &copier, Box::new(())) }.unwrap();
        let got = hb.as_f32().unwrap().to_vec();
        be.synchronize().unwrap();
        be.emulator_skip_copy_wait(false);
        be.emulator_race(None);
        drop(dev);
        got
    };
    assert_eq!(run(None, false), want, "ordered run");
    if !be.is_emulated() {
        return;
    }
    for seed in 1..=5 {
        assert_eq!(run(Some(seed), false), want, "race seed {seed}: the copy did not wait for the producer");
    }
    let caught: Vec<bool> = (1..=3).map(|seed| run(Some(seed), true) != want).collect();
    assert!(caught.iter().all(|&c| c), "race mode missed the removed event wait for seeds {caught:?}");
    let mut part = be.alloc_pinned(8).unwrap();
    let ev = be.record_event(&copier).unwrap();
    // SAFETY: the range check fails before anything is enqueued.
    let e = unsafe { be.copy_to_pinned_after_event(&ev, 0, 4, 0, &mut part, &copier, Box::new(())) };
    assert!(e.is_err(), "8 bytes of a 4-byte range must be an error");
}
