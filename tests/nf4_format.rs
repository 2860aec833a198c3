//! The 4-bit format (crates/ops/src/nf4) against bitsandbytes 0.50, bit for bit, on the fixtures
//! of scripts/make_nf4_fixtures.py (tests/fixtures/nf4/format.*): from the same weight, the same
//! packed codes, absmax codes, nested scales, offset and dequantized values, for f32 and bf16
//! weights with a block of zeros, a constant block, odd lengths, several nested blocks (the last
//! partial), FP4, and NF4 without double quantization.
use ferrolm_nn::safetensors_io::{stored_to_f32, visit_stored};
use ferrolm_ops::nf4::{dynamic_map, Absmax, OrigDtype, Quant4, QuantSpec, QuantType};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nf4")
}

/// name -> (safetensors dtype, bytes).
fn stored(path: &Path) -> BTreeMap<String, (String, Vec<u8>)> {
    let mut m = BTreeMap::new();
    visit_stored(path, &mut |s| {
        m.insert(s.name.to_string(), (s.dtype.to_string(), s.data.to_vec()));
        Ok(())
    })
    .unwrap();
    m
}

fn f32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Panics at the first differing element, with its index and both values.
fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: {} values, bitsandbytes has {}", got.len(), want.len());
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: element {i} of {} is {:?}, bitsandbytes has {:?}", got.len(), got[i], want[i]);
    }
}

#[test]
fn quantize_and_dequantize_match_bitsandbytes_bit_for_bit() {
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("format.json")).unwrap()).unwrap();
    let t = stored(&fixtures().join("format.safetensors"));
    let cases = meta["cases"].as_array().unwrap();
    assert!(cases.len() >= 7, "the fixture lost cases");
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let get = |part: &str| t.get(&format!("{name}.{part}")).unwrap_or_else(|| panic!("{name}.{part} missing"));
        let shape: Vec<usize> = c["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let dtype = OrigDtype::parse(c["dtype"].as_str().unwrap()).unwrap();
        let spec = QuantSpec {
            quant_type: QuantType::parse(c["quant_type"].as_str().unwrap()).unwrap(),
            blocksize: c["blocksize"].as_u64().unwrap() as usize,
            double_quant: c["double_quant"].as_bool().unwrap(),
        };
        let (idt, ibytes) = get("input");
        let input = stored_to_f32(idt, ibytes).unwrap();
        let q = Quant4::quantize(name, &input, &shape, dtype, spec).unwrap();
        q.check(name).unwrap();
        same(&format!("{name}: packed codes"), &q.packed, &get("packed").1);
        q.check_quant_map(name, &stored_to_f32("F32", &get("quant_map").1).unwrap()).unwrap();
        match &q.absmax {
            Absmax::Nested(n) => {
                assert!(spec.double_quant);
                same(&format!("{name}: absmax codes"), &n.codes, &get("absmax").1);
                let scales: Vec<u32> = n.absmax.iter().map(|v| v.to_bits()).collect();
                same(&format!("{name}: nested absmax"), &scales, &f32s(&get("nested_absmax").1));
                same(&format!("{name}: offset"), &[n.offset.to_bits()], &f32s(&get("offset").1));
                let map: Vec<u32> = dynamic_map().iter().map(|v| v.to_bits()).collect();
                same(&format!("{name}: nested quant map"), &map, &f32s(&get("nested_quant_map").1));
            }
            Absmax::Plain(a) => {
                assert!(!spec.double_quant);
                let a: Vec<u32> = a.iter().map(|v| v.to_bits()).collect();
                same(&format!("{name}: absmax"), &a, &f32s(&get("absmax").1));
            }
        }
        let (ddt, dbytes) = get("dequant");
        match dtype {
            OrigDtype::F32 => {
                let got: Vec<u32> = q.dequantize_f32().iter().map(|v| v.to_bits()).collect();
                same(&format!("{name}: dequantized f32"), &got, &f32s(dbytes));
            }
            OrigDtype::BF16 => {
                assert_eq!(ddt, "BF16");
                let got: Vec<u16> = q.dequantize_bf16().iter().map(|v| v.to_bits()).collect();
                let want: Vec<u16> = dbytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                same(&format!("{name}: dequantized bf16"), &got, &want);
            }
            OrigDtype::F16 => unreachable!("no f16 case"),
        }
    }
}

#[test]
fn a_zero_block_a_constant_block_and_an_odd_tail_code_as_bitsandbytes_does() {
    // What the bit-for-bit test relies on, spelled out on the fixture: a block of zeros codes to
    // NF4's 0 (code 7) with absmax 0; a constant block to 1.0 (code 15); an odd count pads 0.0.
    let t = stored(&fixtures().join("format.safetensors"));
    let packed = &t["f32_zero_const.packed"].1;
    assert!(packed[32..64].iter().all(|&b| b == 0x77), "the zero block's codes");
    assert!(packed[64..96].iter().all(|&b| b == 0xFF), "the constant block's codes");
    let odd = &t["f32_odd.packed"].1;
    assert_eq!(odd.len(), 46);
    assert_eq!(odd[45] & 0x0F, 7, "the padded nibble of an odd count is NF4's 0");
}
