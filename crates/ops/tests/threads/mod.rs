//! A test's vocabulary-parallel group (`VocabShards`) on one device: ranks are threads that meet
//! at a barrier and reduce on the host in rank order. Shared by head_loss.rs and head_loss_cuda.rs.
use ferrolm_ops::VocabShards;
use ferrolm_tensor::{DType, Result, Tensor};
use std::sync::{Arc, Barrier, Mutex};

pub struct Threads {
    pub rank: usize,
    pub start: usize,
    pub vocab: usize,
    pub barrier: Arc<Barrier>,
    pub slots: Arc<Mutex<Vec<Option<Vec<f64>>>>>,
}

impl Threads {
    /// `ranks` threads' groups over a vocabulary of `vocab` rows split in equal parts.
    pub fn group(ranks: usize, vocab: usize) -> Vec<Threads> {
        let (barrier, slots) = (Arc::new(Barrier::new(ranks)), Arc::new(Mutex::new(vec![None; ranks])));
        (0..ranks)
            .map(|rank| Threads { rank, start: rank * vocab / ranks, vocab, barrier: barrier.clone(), slots: slots.clone() })
            .collect()
    }

    /// `f` of each of the `ranks` groups over `vocab` rows, each on its own thread; the results
    /// in rank order.
    pub fn each<R: Send>(ranks: usize, vocab: usize, f: impl Fn(Threads) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = Threads::group(ranks, vocab).into_iter().map(|sh| s.spawn(move || f(sh))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn reduce(&self, x: &Tensor, f: fn(f64, f64) -> f64) -> Result<Tensor> {
        self.slots.lock().unwrap()[self.rank] = Some(x.to_vec_f64()?);
        self.barrier.wait();
        let all: Vec<Vec<f64>> = self.slots.lock().unwrap().iter().map(|s| s.clone().unwrap()).collect();
        self.barrier.wait();
        let out: Vec<f64> = (0..all[0].len()).map(|i| all.iter().skip(1).fold(all[0][i], |a, r| f(a, r[i]))).collect();
        match x.dtype() {
            DType::F64 => Tensor::from_vec(out, x.dims().to_vec(), x.device()),
            _ => Tensor::from_vec(out.into_iter().map(|v| v as f32).collect::<Vec<f32>>(), x.dims().to_vec(), x.device())?
                .to_dtype(x.dtype()),
        }
    }
}

impl VocabShards for Threads {
    fn start(&self) -> usize {
        self.start
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn all_reduce_max(&self, x: &Tensor) -> Result<Tensor> {
        self.reduce(x, f64::max)
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.reduce(x, |a, b| a + b)
    }
}
