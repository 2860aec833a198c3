//! The flat parameter store: parameters live in contiguous, padded buffers, one per dtype and
//! layer bucket, and the model holds views into them. ZeRO then becomes "which range of each
//! buffer does this rank own" and optimizer offload "where do its master weights and moments
//! live"; neither needs to know the model's structure.
use crate::causal_lm::CausalLm;
use crate::module::ParamKind;
use ferrolm_tensor::{no_grad, DType, Device, Error, Result, Tensor};

/// One parameter's place in its bucket.
#[derive(Clone, Debug)]
pub struct Slot {
    /// Fully qualified transformers name.
    pub name: String,
    /// Offset in elements into the bucket's flat buffer.
    pub offset: usize,
    /// This rank's (possibly tensor-parallel-sharded) shape.
    pub shape: Vec<usize>,
    pub kind: ParamKind,
}

impl Slot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parameters of one layer (or the embedding, or the head) in one flat buffer.
pub struct ParamBucket {
    /// "embed", "layers.N" or "head".
    pub name: String,
    pub dtype: DType,
    /// (padded,) the model's parameters are views into it.
    pub flat: Tensor,
    /// Elements used by parameters; `flat` has `padded` >= `numel`, the tail zero.
    pub numel: usize,
    pub padded: usize,
    pub slots: Vec<Slot>,
}

impl ParamBucket {
    /// The view of slot `i` (shares the flat buffer's storage).
    pub fn view(&self, i: usize) -> Result<Tensor> {
        let s = &self.slots[i];
        let _g = no_grad();
        self.flat.narrow(0, s.offset, s.numel())?.reshape(s.shape.clone())
    }
}

pub struct ParamBuckets {
    pub buckets: Vec<ParamBucket>,
    pub device: Device,
}

/// The bucket a parameter belongs to (`crate::spec::bucket_of`): its block, the embedding, or
/// the head.
pub use crate::spec::bucket_of;

impl ParamBuckets {
    /// Moves every trainable parameter of `model` (`CausalLm::visit_trainable_mut`: the LoRA
    /// adapters when it has them) into flat buffers (bucket sizes padded to a multiple of `align`
    /// elements) and replaces it by a view: values, names, shapes and `requires_grad` are
    /// unchanged, gradients still arrive per parameter.
    pub fn from_model(model: &mut dyn CausalLm, align: usize) -> Result<ParamBuckets> {
        if align == 0 {
            return Err(Error::new("ParamBuckets", "alignment must be positive"));
        }
        let device = model.device();
        // Pass 1: layout, in the visitor's (forward) order.
        let mut buckets: Vec<(String, DType, Vec<Slot>, usize)> = Vec::new();
        for (name, t, kind) in model.trainable_parameters() {
            let key = bucket_of(&name);
            let dtype = t.dtype();
            let b = match buckets.iter_mut().position(|b| b.0 == key && b.1 == dtype) {
                Some(i) => &mut buckets[i],
                None => {
                    buckets.push((key, dtype, Vec::new(), 0));
                    buckets.last_mut().expect("pushed")
                }
            };
            b.2.push(Slot { name, offset: b.3, shape: t.dims().to_vec(), kind });
            b.3 += t.numel();
        }
        // Pass 2: copy the values into flat buffers.
        let _g = no_grad();
        let params: std::collections::HashMap<String, Tensor> = model.trainable_parameters().into_iter().map(|(n, t, _)| (n, t)).collect();
        let mut out = Vec::with_capacity(buckets.len());
        for (name, dtype, slots, numel) in buckets {
            let padded = numel.div_ceil(align).max(1) * align;
            let flat = Tensor::zeros([padded], dtype, device)?;
            for s in &slots {
                flat.narrow(0, s.offset, s.numel())?.reshape(s.shape.clone())?.assign(&params[&s.name])?;
            }
            out.push(ParamBucket { name, dtype, flat, numel, padded, slots });
        }
        let store = ParamBuckets { buckets: out, device };
        // Pass 3: the model's parameters become leaf views of the flat buffers.
        store.attach(model)?;
        Ok(store)
    }

    /// Points `model`'s trainable parameters at the store's views (fresh leaves that require
    /// grad).
    pub fn attach(&self, model: &mut dyn CausalLm) -> Result<()> {
        let mut views = std::collections::HashMap::new();
        for b in &self.buckets {
            for (i, s) in b.slots.iter().enumerate() {
                views.insert(s.name.clone(), b.view(i)?.detach());
            }
        }
        model.visit_trainable_mut(&mut |p, t| {
            let v = views.remove(p.name).ok_or_else(|| Error::new("ParamBuckets", format!("no slot for parameter {}", p.name)))?;
            v.set_requires_grad(true)?;
            *t = v;
            Ok(())
        })
    }

    /// (bucket index, slot index) of a parameter.
    pub fn find(&self, name: &str) -> Option<(usize, usize)> {
        self.buckets.iter().enumerate().find_map(|(b, k)| k.slots.iter().position(|s| s.name == name).map(|i| (b, i)))
    }

    /// Elements in all buckets, padding included.
    pub fn padded_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.padded).sum()
    }
    /// Elements of parameters (no padding).
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }
}
