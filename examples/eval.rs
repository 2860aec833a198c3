//! Mean next-token loss of a checkpoint on a text file (`--help` lists the flags; the logic is
//! `ferrolm::cli::eval`).
//!
//!   cargo run --release --example eval -- --model DIR --text FILE --seq-len T
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::eval::run)
}
