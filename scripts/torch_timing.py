"""The timing loop of the PyTorch benchmark scripts (bench_train_torch.py,
bench_finetune_torch.py): CUDA's peak-memory count reset, warm-up steps first (untimed, then a
synchronize), then timed steps, each ended by a synchronize, and their median. A sibling module:
Python finds it beside the script it runs."""
import statistics
import time


def time_steps(step, dev, warmup, steps):
    """Runs `step()` `warmup` times untimed and `steps` times timed on `dev` (a torch.device);
    returns (the median timed step in seconds, the warm-up's seconds, the last step's value)."""
    import torch

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_warm = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t_warm
    times, last = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        last = step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), warmup_s, last
