//! A frozen linear layer over a 4-bit weight (QLoRA's base): y = x Wᵀ, where W is the
//! dequantization of a `Quant4` (NF4 / FP4, double quantization; crates/ops/src/nf4) made just
//! before the GEMM and dropped right after it. The backward gives dX = dY W only, dequantizing W
//! once more: the layer has no parameter, no gradient and no optimizer state, and no dequantized
//! weight outlives its GEMM, so a model's base costs its 4.127 bits a parameter plus one layer's
//! weight in the compute dtype at a time (on CUDA the pool hands the freed block of one layer's
//! weight to the next: that block is the scratch). On the CPU the weight dequantizes from the
//! host copy; on CUDA `nf4_dequant_*` does it in one launch.
//!
//! `QuantOp` is the layer as a `LinearOp` (module.rs), LoRA's adapted forward included, so a
//! model's `Linear` can take it as its op: `crate::qlora` puts it in a model's linear layers.
use crate::module::{adapted, BaseWeight, LinearOp, WeightFn};
use ferrolm_ops::nf4::{dequantize_cuda, DeviceQuant4, Quant4};
use ferrolm_tensor::{bail, bf16, no_grad, DType, Device, Result, Tensor};
use std::sync::Arc;

/// A frozen 4-bit linear layer: `weight` (out, in) stored as a `Quant4`.
#[derive(Clone)]
pub struct QuantLinear {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    host: Quant4,
    device_copy: Option<DeviceQuant4>,
    device: Device,
}

impl QuantLinear {
    /// The layer `name` (for errors) over `q`, a 2-D (out, in) weight, computing on `device`
    /// (the codes are uploaded once).
    pub fn new(name: &str, q: Quant4, device: Device) -> Result<QuantLinear> {
        q.check(name)?;
        if q.shape.len() != 2 {
            bail!("quant_linear", "{name}: a linear weight is (out, in), got shape {:?}", q.shape);
        }
        let device_copy = match device {
            Device::Cpu => None,
            d => Some(DeviceQuant4::upload(&q, name, d)?),
        };
        Ok(QuantLinear { inner: Arc::new(Inner { name: name.to_string(), host: q, device_copy, device }) })
    }

    /// (out, in).
    pub fn shape(&self) -> (usize, usize) {
        (self.inner.host.shape[0], self.inner.host.shape[1])
    }

    /// The quantized weight.
    pub fn quant(&self) -> &Quant4 {
        &self.inner.host
    }

    /// The weight dequantized to `dtype` on the layer's device (out, in), a new tensor.
    pub fn weight(&self, dtype: DType) -> Result<Tensor> {
        self.inner.weight(dtype)
    }

    /// y = x Wᵀ for x (..., in) of a float dtype; records dX = dY W for the backward when x
    /// requires a gradient.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (out, cin) = self.shape();
        let r = x.rank();
        if r == 0 || x.dim(r - 1) != cin {
            bail!("quant_linear", "{}: expects x (..., {cin}), got {:?}", self.inner.name, x.shape());
        }
        let dtype = x.dtype();
        let y = {
            let _g = no_grad();
            let w = self.inner.weight(dtype)?; // (out, in), dropped after the GEMM
            x.linear(&w)?
        };
        let inner = self.inner.clone();
        let xdims = x.dims().to_vec();
        let backward = move |dy: &Tensor| {
            let _g = no_grad();
            let n = dy.numel() / out;
            let w = inner.weight(dtype)?; // dequantized again for dX = dY W
            let dx = dy.contiguous()?.reshape([n, out])?.matmul(&w)?.reshape(xdims.clone())?;
            Ok(vec![Some(dx)])
        };
        Ok(Tensor::from_op(y, "quant_linear", &[x], Box::new(backward)))
    }
}

/// A `QuantLinear` as the op of a model's `Linear`: the `weight` argument is not read (the layer
/// may hold a placeholder), the 4-bit weight is dequantized per pass. Under LoRA the adapted
/// forward is (res +) x Wᵀ + u (s B)ᵀ, the sums in `linear_adapted`'s order: the base product
/// through `QuantLinear::forward` (W never saved for the backward), the adapter's through
/// ordinary GEMMs, so A and B get their gradients as over a dense frozen weight.
pub struct QuantOp(pub QuantLinear);

impl LinearOp for QuantOp {
    fn forward(&self, x: &Tensor, _weight: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
    fn forward_adapted(&self, x: &Tensor, _weight: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        self.0.forward_adapted(x, u, b, scale, res)
    }
    fn quantized(&self) -> Option<&QuantLinear> {
        Some(&self.0)
    }
}

impl QuantLinear {
    /// (res +) x Wᵀ + u (s B)ᵀ as one op, in `module::linear_adapted`'s order of sums (the base
    /// GEMM accumulates into res, the adapter's into that), W dequantized for the GEMM and
    /// dropped. One autograd node keeps x, u and B only (no intermediate sum, no W); its
    /// backward dequantizes W again for dX and gives dU = G s B, dB = s Gᵀ u, dres = G.
    pub fn forward_adapted(&self, x: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        let (out_features, in_features) = self.shape();
        let inner = self.inner.clone();
        let get: WeightFn = Arc::new(move |dtype| inner.weight(dtype));
        let w = BaseWeight::Frozen { name: &self.inner.name, out_features, in_features, get };
        adapted(x, w, u, b, scale, res)
    }
}

impl Inner {
    fn weight(&self, dtype: DType) -> Result<Tensor> {
        let q = &self.host;
        if let Some(d) = &self.device_copy {
            return match dtype {
                DType::F32 | DType::BF16 => dequantize_cuda(d, dtype),
                other => dequantize_cuda(d, DType::F32)?.to_dtype(other),
            };
        }
        match dtype {
            DType::BF16 => Tensor::from_vec::<bf16>(q.dequantize_bf16(), q.shape.clone(), self.device),
            DType::F32 => Tensor::from_vec(q.dequantize_f32(), q.shape.clone(), self.device),
            other => Tensor::from_vec(q.dequantize_f32(), q.shape.clone(), self.device)?.to_dtype(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_ops::nf4::{OrigDtype, QuantSpec};
    use ferrolm_tensor::Rng;

    fn layer(out: usize, cin: usize, r: &mut Rng) -> QuantLinear {
        let w = Tensor::randn([out, cin], 0.05, DType::F32, Device::Cpu, r).unwrap().to_vec_f32().unwrap();
        let q = Quant4::quantize("w", &w, &[out, cin], OrigDtype::F32, QuantSpec::QLORA).unwrap();
        QuantLinear::new("w", q, Device::Cpu).unwrap()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1e-6 + y.abs())).fold(0.0, f32::max)
    }

    /// Loss and dX against the plain linear over the dequantized f32 weight; the layer has no
    /// parameter, so nothing else gets a gradient.
    #[test]
    fn loss_and_dx_equal_the_dequantized_f32_linear() {
        let mut r = Rng::new(53);
        let ql = layer(64, 96, &mut r);
        let x = Tensor::randn([2, 3, 96], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
        let c = Tensor::randn([2, 3, 64], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
        let xq = x.detach();
        xq.set_requires_grad(true).unwrap();
        let loss = ql.forward(&xq).unwrap().mul(&c).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
        let w = Tensor::from_vec(ql.quant().dequantize_f32(), [64, 96], Device::Cpu).unwrap();
        let xr = x.detach();
        xr.set_requires_grad(true).unwrap();
        let want = xr.linear(&w).unwrap().mul(&c).unwrap().sum_all().unwrap();
        want.backward().unwrap();
        assert_eq!(loss.to_vec_f32().unwrap(), want.to_vec_f32().unwrap(), "the forward is the same GEMM");
        let (g, gr) = (xq.grad().unwrap().to_vec_f32().unwrap(), xr.grad().unwrap().to_vec_f32().unwrap());
        assert_eq!(xq.grad().unwrap().dims(), &[2, 3, 96]);
        assert!(max_rel(&g, &gr) < 1e-5, "dX differs: {}", max_rel(&g, &gr));
    }

    #[test]
    fn bf16_compute_rounds_the_dequantized_weight_once() {
        let mut r = Rng::new(7);
        let ql = layer(32, 64, &mut r);
        let x = Tensor::randn([5, 64], 1.0, DType::BF16, Device::Cpu, &mut r).unwrap();
        let y = ql.forward(&x).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let w = Tensor::from_vec::<bf16>(ql.quant().dequantize_bf16(), [32, 64], Device::Cpu).unwrap();
        assert_eq!(y.to_vec_f32().unwrap(), x.linear(&w).unwrap().to_vec_f32().unwrap());
    }

    /// LoRA over the 4-bit base: the loss and the gradients of A, B, x and the residual equal
    /// `linear_adapted` over the dequantized f32 weight; the placeholder weight is not read.
    #[test]
    fn lora_over_the_4bit_op_equals_lora_over_the_dequantized_weight() {
        use crate::module::linear_adapted;
        let (out, cin, rank, s) = (48usize, 64usize, 4usize, 0.5f64);
        let mut r = Rng::new(11);
        let ql = layer(out, cin, &mut r);
        let w = ql.weight(DType::F32).unwrap();
        let leaf = |shape: &[usize], r: &mut Rng| {
            let t = Tensor::randn(shape.to_vec(), 0.3, DType::F32, Device::Cpu, r).unwrap();
            t.set_requires_grad(true).unwrap();
            t
        };
        let (x0, a0, b0, res0) =
            (leaf(&[2, 3, cin], &mut r), leaf(&[rank, cin], &mut r), leaf(&[out, rank], &mut r), leaf(&[2, 3, out], &mut r));
        let c = Tensor::randn([2, 3, out], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
        let run = |quant: bool| {
            let (x, a, b, res) = (x0.detach(), a0.detach(), b0.detach(), res0.detach());
            for t in [&x, &a, &b, &res] {
                t.set_requires_grad(true).unwrap();
            }
            let u = x.linear(&a).unwrap();
            let y = if quant {
                let placeholder = Tensor::zeros([out, cin], DType::F32, Device::Cpu).unwrap();
                QuantOp(ql.clone()).forward_adapted(&x, &placeholder, &u, &b, s, Some(&res)).unwrap()
            } else {
                linear_adapted(&x, &w, &u, &b, s, Some(&res)).unwrap()
            };
            let loss = y.mul(&c).unwrap().sum_all().unwrap();
            loss.backward().unwrap();
            let g = |t: &Tensor| t.grad().unwrap().to_vec_f32().unwrap();
            (loss.to_vec_f32().unwrap(), [g(&x), g(&a), g(&b), g(&res)])
        };
        let ((lq, gq), (ld, gd)) = (run(true), run(false));
        assert!(max_rel(&lq, &ld) < 1e-6, "loss {lq:?} against {ld:?}");
        for (name, (q, d)) in ["x", "A", "B", "res"].iter().zip(gq.iter().zip(&gd)) {
            assert!(max_rel(q, d) < 1e-4, "d{name}: rel {}", max_rel(q, d));
        }
    }

    #[test]
    fn a_weight_that_is_not_a_matrix_or_an_input_of_the_wrong_width_is_refused() {
        let q = Quant4::quantize("v", &[0.5; 64], &[64], OrigDtype::F32, QuantSpec::QLORA).unwrap();
        let e = QuantLinear::new("model.v", q, Device::Cpu).err().unwrap().to_string();
        assert!(e.contains("model.v: a linear weight is (out, in)"), "{e}");
        let mut r = Rng::new(1);
        let ql = layer(32, 64, &mut r);
        let x = Tensor::randn([5, 63], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
        let e = ql.forward(&x).err().unwrap().to_string();
        assert!(e.contains("w: expects x (..., 64)"), "{e}");
    }
}
