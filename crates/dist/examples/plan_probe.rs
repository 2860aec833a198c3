use ferrolm_dist::cost::{Link, LinkModel};
use ferrolm_dist::plan::*;
fn main() {
    for name in ["7b", "13b", "30b"] {
        let m = ModelShape::preset(name).unwrap();
        let c = Cluster {
            gpus: 1024,
            gpus_per_node: 8,
            mem_bytes: 80e9,
            link: LinkModel::two_level(Link::new(5e-6, 150e9), Link::new(15e-6, 12.5e9), 8),
            flops: 0.6 * 312e12,
            peak_flops: 312e12,
            margin: 0.1,
        };
        let w = Workload {
            seq: 4096,
            micro_batch: 1,
            global_batch_tokens: 4 << 20,
            tp: 1,
            elem_bytes: 2,
            checkpointed_layers: if name == "30b" { 60 } else { 0 },
        };
        let r = search(&m, &c, &w);
        println!("{name}: {} params", m.params());
        for e in r.iter().take(6) {
            println!(
                "  {} fits {} mem {:.1} GB comm {:?} exposed {:.3} step {:.3} mfu {:.3}",
                e.spec,
                e.fits,
                e.mem.total() / 1e9,
                e.comm.map(|x| (x * 1000.0).round() / 1000.0),
                e.exposed,
                e.step,
                e.mfu
            );
        }
    }
}
