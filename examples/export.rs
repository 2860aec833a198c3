//! A checkpoint's Hugging Face model without its training state (`--help` lists the flags; the
//! logic is `ferrolm::cli::export`).
//!
//!   cargo run --release --example export -- --model RUN --out DIR
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::export::run)
}
