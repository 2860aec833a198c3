// Compiles kernels/*.cu into the CUDA kernel image embedded in the binary.
// The CUDA backend arrives with the CUDA issue; until then this only tracks kernels/.
fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=build.rs");
}
