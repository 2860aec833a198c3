//! Poisoned outputs: memory filled with NaN (or, for integer words, a sentinel) before a kernel
//! runs, so that an element the kernel does not write fails the comparison that follows instead
//! of passing on whatever the memory held.
use ferrolm_tensor::{DType, Device, Tensor};
use std::sync::Arc;

/// The word integer outputs are filled with before a kernel runs.
pub const SENTINEL: u32 = 0xdead_beef;

/// The variable that makes the CUDA backend fill every new device buffer with NaN.
pub const CUDA_POISON: &str = "FERROLM_CUDA_POISON";

/// Asks the CUDA backend (GPU or emulator) to fill every new device buffer with NaN
/// (`FERROLM_CUDA_POISON=1`). Call it before the device starts: the backend reads it then.
pub fn poison_new_device_memory() {
    std::env::set_var(CUDA_POISON, "1");
}

/// A tensor of `dims` in `dtype` on `device` whose every element is NaN.
pub fn nan_filled(dims: &[usize], dtype: DType, device: Device) -> Tensor {
    Tensor::full(dims.to_vec(), f64::NAN, dtype, device).expect("a NaN-filled tensor")
}

/// An f32 gradient destination of `w`'s shape on `w`'s device, filled with NaN and set as `w`'s
/// gradient destination: the backward must write every element of it. Returns the destination.
pub fn grad_dest(w: &Tensor) -> Tensor {
    let dest = nan_filled(w.dims(), DType::F32, w.device());
    let d = dest.clone();
    w.set_grad_dest(Some(Arc::new(move || Ok(Some(d.clone())))));
    dest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_destination_is_all_nan_f32_and_is_the_gradients_destination() {
        let w = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], Device::Cpu).unwrap();
        w.set_requires_grad(true).unwrap();
        let dest = grad_dest(&w);
        assert_eq!((dest.dims(), dest.dtype()), (&[2usize, 3][..], DType::F32));
        assert!(dest.to_vec_f64().unwrap().iter().all(|x| x.is_nan()));
        assert!(w.grad_dest().unwrap().is_some_and(|d| d.same_view(&dest)), "the destination w's backward writes");
    }
}
