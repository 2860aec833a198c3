//! ferrolm-dist: the distributed runtime's communication layer (module docs in lib.rs are
//! completed once every piece is in).
pub mod comm;
pub mod cost;
pub mod mesh;
pub mod ops;
mod reduce;
pub mod simlink;
pub mod store;
pub mod thread;

pub use comm::{Collective, CommOptions, CommStats, Communicator, Completion, KindStats, ReduceOp, Work};
pub use mesh::DeviceMesh;
pub use simlink::SimLink;
pub use thread::ThreadComm;
