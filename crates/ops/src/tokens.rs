//! i32 token ids (a batch's inputs or targets) with, when they came from the host, the host copy
//! they were uploaded from. The embedding and the cross-entropy validate ids with a host copy on
//! the host (range, ignore index, the count of counted targets) and never read the device
//! tensor back; ids without one (a bare tensor) are checked on the device, which costs a host
//! wait for the check's result on a GPU. The training loop uploads every batch with its copy,
//! so a micro-batch makes no host wait.
use ferrolm_tensor::{bail, Device, Result, Shape, Tensor};
use std::borrow::Cow;
use std::sync::Arc;

/// i32 ids on a device, with the host copy they were uploaded from when there is one.
#[derive(Clone, Debug)]
pub struct Tokens {
    tensor: Tensor,
    /// The tensor's elements in row-major order.
    host: Option<Arc<[i32]>>,
}

impl Tokens {
    /// Uploads host ids to `device` and keeps them.
    pub fn upload(host: Vec<i32>, shape: impl Into<Shape>, device: Device) -> Result<Tokens> {
        let tensor = Tensor::from_vec(host.clone(), shape, device)?;
        Ok(Tokens { tensor, host: Some(host.into()) })
    }

    /// Ids that live only in `tensor` (checked on the device where they are used).
    pub fn device(tensor: &Tensor) -> Tokens {
        Tokens { tensor: tensor.clone(), host: None }
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The host copy, if the ids were uploaded from the host.
    pub fn host(&self) -> Option<&[i32]> {
        self.host.as_deref()
    }

    /// The ids on the host: the host copy, or the tensor read back (a host wait on a GPU).
    pub fn host_ids(&self) -> Result<Cow<'_, [i32]>> {
        match &self.host {
            Some(h) => Ok(Cow::Borrowed(h)),
            None => Ok(Cow::Owned(self.tensor.to_vec::<i32>()?)),
        }
    }

    /// The same ids in another shape (the host copy is row-major, so it stays valid).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tokens> {
        Ok(Tokens { tensor: self.tensor.reshape(shape)?, host: self.host.clone() })
    }

    /// With a host copy: every id must lie in [0, vocab) (checked there). Without: Ok, the
    /// caller checks on the device.
    pub(crate) fn check_ids(&self, vocab: usize) -> Result<()> {
        if let Some(h) = &self.host {
            check_ids(h, vocab)?;
        }
        Ok(())
    }

    /// With a host copy: the number of targets that are not `ignore`, each in [0, classes)
    /// (checked there). Without: None, the caller checks and counts on the device.
    pub(crate) fn count_targets(&self, classes: usize, ignore: i32) -> Result<Option<usize>> {
        self.host.as_deref().map(|h| count_targets(h, classes, ignore)).transpose()
    }
}

impl From<&Tensor> for Tokens {
    fn from(t: &Tensor) -> Tokens {
        Tokens::device(t)
    }
}

impl From<&Tokens> for Tokens {
    fn from(t: &Tokens) -> Tokens {
        t.clone()
    }
}

/// Every id in [0, vocab) (the embedding's message).
pub fn check_ids(ids: &[i32], vocab: usize) -> Result<()> {
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= vocab) {
        bail!("embedding", "token id {bad} out of range for a vocabulary of {vocab}");
    }
    Ok(())
}

/// Every target in [0, classes) or `ignore` (else the cross-entropy's message): the number
/// that are not `ignore`.
pub fn count_targets(t: &[i32], classes: usize, ignore: i32) -> Result<usize> {
    if let Some(bad) = t.iter().find(|&&x| x != ignore && (x < 0 || x as usize >= classes)) {
        bail!("cross_entropy", "target {bad} out of range for {classes} classes (ignore_index is {ignore})");
    }
    Ok(t.iter().filter(|&&x| x != ignore).count())
}
