//! How the flash kernels' block size is chosen: `FERROLM_FLASH_WARPS` (4 or 8, default 8, read
//! once), and `with_flash_warps` over it on one thread. Its own test binary: it sets the variable
//! before anything reads it.
use ferrolm_ops::attention::{flash_warps, parse_flash_warps, with_flash_warps};

#[test]
fn the_variable_and_the_override() {
    std::env::set_var("FERROLM_FLASH_WARPS", "4");
    assert_eq!(flash_warps().unwrap(), 4);
    assert_eq!(with_flash_warps(8, || flash_warps().unwrap()).unwrap(), 8, "the override wins on its thread");
    assert_eq!(flash_warps().unwrap(), 4, "and ends with the closure");
    let other = std::thread::spawn(|| with_flash_warps(8, || std::thread::spawn(|| flash_warps().unwrap()).join().unwrap()).unwrap());
    assert_eq!(other.join().unwrap(), 4, "another thread keeps the variable's choice");
    let unwound = std::panic::catch_unwind(|| with_flash_warps(8, || panic!("inside")));
    assert!(unwound.is_err());
    assert_eq!(flash_warps().unwrap(), 4, "a closure that panics still ends the override");
    let e = with_flash_warps(6, || ()).unwrap_err().to_string();
    assert!(e.contains("4 or 8"), "{e}");

    for (v, want) in [(None, Ok(8)), (Some(""), Ok(8)), (Some("8"), Ok(8)), (Some(" 4 "), Ok(4))] {
        assert_eq!(parse_flash_warps(v), want, "{v:?}");
    }
    for v in ["5", "eight", "16"] {
        let e = parse_flash_warps(Some(v)).unwrap_err();
        assert!(e.contains(&format!("FERROLM_FLASH_WARPS={v}")) && e.contains("4 or 8"), "{e}");
    }
}
