//! The key/value cache of generation: each layer's keys and values of the tokens seen so far.
//! The model fills it (`CausalLm::forward_with_cache`); generation (`crate::generate`) owns it.
use ferrolm_tensor::{Error, Result, Tensor};

/// Keys and values of the tokens seen so far, per layer: (B, KV, S, D) each.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
    batch: usize,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }
    /// Number of positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn clear(&mut self) {
        *self = Self::default();
    }
    pub(crate) fn prepare(&mut self, n_layers: usize, batch: usize) -> Result<()> {
        if self.len == 0 {
            self.layers = vec![None; n_layers];
            self.batch = batch;
        } else if self.layers.len() != n_layers || self.batch != batch {
            return Err(Error::new(
                "KvCache",
                format!(
                    "cache holds {} layers x batch {}, model call has {n_layers} layers x batch {batch}; clear() it first",
                    self.layers.len(),
                    self.batch
                ),
            ));
        }
        Ok(())
    }
    pub(crate) fn layer(&mut self, i: usize) -> &mut Option<(Tensor, Tensor)> {
        &mut self.layers[i]
    }
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
