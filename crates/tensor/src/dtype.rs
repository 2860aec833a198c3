//! Element types. Floats compute; `I32` carries token ids and labels (so -100 can mean "ignore").
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F64,
    I32,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 => 2,
            DType::F64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I32 => "i32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor's storage lives. CUDA storage is provided by the `ferrolm-cuda` backend,
/// which registers itself at run time (see `backend::register`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| crate::Error::new("device", format!("unknown device {s:?}: expected cpu, cuda or cuda:N"))),
        }
    }
}

/// f64 -> bf16 with one correct round-to-nearest-even. `half::bf16::from_f64` (2.7) misrounds
/// inputs just above a tie (half-rs issue #151: it narrows the mantissa in two steps), which
/// made CPU casts disagree with the GPU's `__float2bfloat16_rn` by one ulp. Here the f64 is first
/// rounded to f32 with round-to-odd (inexact results keep a sticky odd last bit), after which the
/// usual f32 -> bf16 RNE is exact: f32 carries 16 more mantissa bits than bf16.
pub fn bf16_from_f64(x: f64) -> half::bf16 {
    if x.is_nan() {
        return half::bf16::NAN;
    }
    let a = x.abs();
    let mut t = a as f32;
    if t as f64 != a && t.to_bits() & 1 == 0 {
        let b = t.to_bits();
        t = f32::from_bits(if t as f64 > a { b - 1 } else { b + 1 });
    }
    let r = half::bf16::from_f32(t);
    if x.is_sign_negative() {
        -r
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::bf16_from_f64;
    use half::bf16;

    #[test]
    fn bf16_from_f64_rounds_once_to_nearest_even() {
        // f32-exact inputs must agree with the (correct) f32 conversion, over a sweep of every
        // 7th pattern of [0.5, 1) and a few binades either side.
        for u in (0x3e00_0000u32..0x4100_0000).step_by(7) {
            let x = f32::from_bits(u);
            assert_eq!(bf16_from_f64(x as f64).to_bits(), bf16::from_f32(x).to_bits(), "{x:e} ({u:#x})");
            assert_eq!(bf16_from_f64(-(x as f64)).to_bits(), bf16::from_f32(-x).to_bits());
        }
        // Just above / below / at a tie between 1.0 (0x3f80) and the next bf16 (0x3f81).
        let tie = 1.0 + 2f64.powi(-8);
        assert_eq!(bf16_from_f64(tie).to_bits(), 0x3f80, "tie goes to even");
        assert_eq!(bf16_from_f64(tie + 2f64.powi(-40)).to_bits(), 0x3f81, "above the tie rounds up");
        assert_eq!(bf16_from_f64(tie - 2f64.powi(-40)).to_bits(), 0x3f80, "below the tie rounds down");
        // 0x3f528003 (the value that exposed half's from_f64) rounds up.
        assert_eq!(bf16_from_f64(f32::from_bits(0x3f52_8003) as f64).to_bits(), 0x3f53);
        // Overflow, underflow, specials.
        assert!(bf16_from_f64(1e300).is_infinite() && bf16_from_f64(-1e300).is_infinite());
        assert_eq!(bf16_from_f64(1e-300).to_bits(), 0);
        assert_eq!(bf16_from_f64(-1e-300).to_bits(), 0x8000);
        assert!(bf16_from_f64(f64::NAN).is_nan());
        assert!(bf16_from_f64(f64::INFINITY).is_infinite());
    }
}
