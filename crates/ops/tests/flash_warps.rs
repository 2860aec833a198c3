//! How the flash kernels' block size is chosen: `FERROLM_FLASH_WARPS` (4 or 8, default 8), and
//! `with_flash_warps` over it on one thread. Its own test binary: it sets the variable.
use ferrolm_ops::attention::{flash_warps, with_flash_warps};

#[test]
fn the_variable_and_the_override() {
    std::env::remove_var("FERROLM_FLASH_WARPS");
    assert_eq!(flash_warps().unwrap(), 8);
    std::env::set_var("FERROLM_FLASH_WARPS", "4");
    assert_eq!(flash_warps().unwrap(), 4);
    assert_eq!(with_flash_warps(8, || flash_warps().unwrap()).unwrap(), 8, "the override wins on its thread");
    assert_eq!(flash_warps().unwrap(), 4, "and ends with the closure");
    let other = std::thread::spawn(|| with_flash_warps(8, || std::thread::spawn(|| flash_warps().unwrap()).join().unwrap()).unwrap());
    assert_eq!(other.join().unwrap(), 4, "another thread keeps the variable's choice");
    std::env::set_var("FERROLM_FLASH_WARPS", "5");
    let e = flash_warps().unwrap_err().to_string();
    assert!(e.contains("FERROLM_FLASH_WARPS=5") && e.contains("4 or 8"), "{e}");
    let e = with_flash_warps(6, || ()).unwrap_err().to_string();
    assert!(e.contains("4 or 8"), "{e}");
    std::env::remove_var("FERROLM_FLASH_WARPS");
}
