"""``python -m train.bench.nla``: the PowerCLIP NLA core's speed and memory, measured in one run.

(a) one loss step (``PowerCLIPLoss`` forward + backward, same batch B x K x d) at M = 15 over M = 5
    (target: <= 1.5x);
(b) the exact loss (closed-form T2R + R2T enumerated over the 2^M region subsets, same composition) over the
    NLA loss at M = 12 (target: >= 50x slower);
(c) peak memory of the chunked pair similarities for Bi = Bj = 1024, M = 10, K = 16, d = 512 (target:
    <= 2 GiB), forward only and forward + backward, each in a fresh subprocess;
(d) the fused pair path (``pair_similarities(fused=True)``, the default) against the reference path through
    ``nla_t1`` / ``nla_t2`` under autograd, with and without ``torch.utils.checkpoint``: forward + backward at
    the (a) batch and M = 10, as reference time over fused time.

How memory is measured (CPU): PyTorch's CPU allocator keeps no statistics and ``tracemalloc`` does not see
it, so the process's resident set is read from ``/proc/self/status``: free heap pages are handed back to the
kernel (``malloc_trim``), the kernel's high-water mark is reset (``echo 5 > /proc/self/clear_refs``), the
work runs, and the peak growth is ``VmHWM - VmRSS`` at the reset. That counts every page the work touched,
PyTorch's temporaries included, and nothing allocated before. Where the reset is not allowed (non-Linux,
some sandboxes) the growth of ``ru_maxrss`` in a fresh process is used instead and the output says so. On
CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``) is used.

The helpers here (batches, the exact loss, timing, peak memory) are shared with ``train.eval.nla_report``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from adapters.losses.contrastive import clip_loss, triplet_rows
from extract.common.cli import JobFailed, Parser, help_description, run_job
from extract.common.config import positive_int
from extract.common.memory import reset_peak, status_kib, trim_heap
from adapters.losses.nla import (NLAConfig, PowerCLIPLoss, PowerCLIPLossConfig, pair_scale, pair_similarities,
                          r2t_exact)

GIB = 1 << 30
MIB = 1 << 20


# --------------------------------------------------------------------------------------------- batches
def random_tree(n_leaves: int, gen: torch.Generator, max_nodes: int | None = None) -> torch.Tensor:
    """A random binary constituency-style tree over ``n_leaves`` ordered leaves: node_leaves [K, P] (bool).

    Built bottom-up by merging a random pair of adjacent spans until one remains, so every node is a
    contiguous span and K = 2P - 1 (leaves first, the root last); ``max_nodes`` keeps the first K nodes.
    """
    spans = [(p, p + 1) for p in range(n_leaves)]
    nodes = list(spans)
    while len(spans) > 1:
        k = int(torch.randint(len(spans) - 1, (1,), generator=gen))
        merged = (spans[k][0], spans[k + 1][1])
        spans[k:k + 2] = [merged]
        nodes.append(merged)
    nodes = nodes[:max_nodes] if max_nodes else nodes
    out = torch.zeros(len(nodes), n_leaves, dtype=torch.bool)
    for j, (a, b) in enumerate(nodes):
        out[j, a:b] = True
    return out


def make_batch(b: int, m: int, k: int, d: int, *, seed: int = 0, device: str | torch.device = "cpu",
               requires_grad: bool = True) -> dict[str, torch.Tensor]:
    """A PowerCLIP loss batch of random unit vectors: global features [b, d], regions [b, M, d] (unit),
    nodes [b, K, d] = sums of unit leaf embeddings over a random binary tree (K nodes from ceil((K+1)/2)
    leaves), node sizes [b, K]; every region and node valid. Leaf tensors require grad when asked."""
    g = torch.Generator().manual_seed(seed)
    p = (k + 2) // 2
    tree = random_tree(p, g, max_nodes=k)  # [K', P], K' = min(K, 2P - 1) = K
    leaves = F.normalize(torch.randn(b, p, d, generator=g), dim=-1)
    out = {"image_features": F.normalize(torch.randn(b, d, generator=g), dim=-1),
           "text_features": F.normalize(torch.randn(b, d, generator=g), dim=-1),
           "regions": F.normalize(torch.randn(b, m, d, generator=g), dim=-1),
           "region_mask": torch.ones(b, m, dtype=torch.bool),
           "nodes": torch.einsum("kp,bpd->bkd", tree.float(), leaves),
           "node_mask": torch.ones(b, len(tree), dtype=torch.bool),
           "node_sizes": tree.sum(-1).float().expand(b, -1).contiguous()}
    out = {key: v.to(device) for key, v in out.items()}
    if requires_grad:
        for key in ("image_features", "text_features", "regions", "nodes"):
            out[key].requires_grad_()
    return out


# ------------------------------------------------------------------------------------------------ losses
def exact_loss(batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig, logit_scale: float = 100.0) -> torch.Tensor:
    """The PowerCLIP objective of :class:`adapters.losses.nla.PowerCLIPLoss` (one rank) with the exact similarities
    in place of the NLAs: T2R by its closed form ``mean_B sum_m relu(Q_{m,B})`` (= ``t2r_exact``, tested),
    R2T by enumerating the 2^M subsets (``r2t_exact``; memory B^2 2^M K under autograd). The naive baseline
    of PowerCLIP Fig. 9, made as cheap as exactness allows."""
    b = batch
    clip = clip_loss(b["image_features"], b["text_features"], logit_scale)
    q = torch.einsum("imd,jkd->ijmk", b["regions"].float(), b["nodes"].float())  # [Bi, Bj, M, K]
    rm, nm = b["region_mask"][:, None, :], b["node_mask"][None, :, :]
    relu = (q.clamp_min(0) * rm[..., None]).sum(-2)  # [Bi, Bj, K]
    nmf = nm.float()
    t2r = (relu * nmf).sum(-1) / nmf.sum(-1).clamp_min(1)
    r2t = r2t_exact(q, rm, nm)
    s = cfg.w_t2r * t2r + cfg.w_r2t * r2t
    if cfg.normalize:
        s = s / pair_scale(b["region_mask"], b["node_mask"], b.get("node_sizes"))
    pos = torch.arange(len(s), device=s.device)
    return clip + cfg.lam * (triplet_rows(s, pos, cfg.margin, hardest=cfg.hardest)
                             + triplet_rows(s.T, pos, cfg.margin, hardest=cfg.hardest))


def nla_loss(batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig, logit_scale: float = 100.0) -> torch.Tensor:
    b = batch
    return PowerCLIPLoss(cfg)(b["image_features"], b["text_features"], logit_scale, b["regions"], b["region_mask"],
                              b["nodes"], b["node_mask"], b.get("node_sizes"))["loss"]


LOSSES: dict[str, Callable] = {"nla": nla_loss, "exact": exact_loss}


def loss_step(kind: str, batch: dict[str, torch.Tensor], cfg: PowerCLIPLossConfig) -> float:
    """One forward + backward of the ``kind`` loss; returns the loss value. Gradients are cleared first."""
    for v in batch.values():
        if v.grad is not None:
            v.grad = None
    loss = LOSSES[kind](batch, cfg)
    loss.backward()
    return float(loss.detach())


# ------------------------------------------------------------------------------------- timing / memory
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: str | torch.device = "cpu", *, repeats: int = 5,
              warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def rss_method() -> str:
    """How :func:`peak_growth` measures CPU memory in this process ('hwm-reset' or 'unavailable')."""
    return "hwm-reset" if reset_peak() else "unavailable"


@contextmanager
def peak_growth(device: str | torch.device = "cpu"):
    """``with peak_growth(dev) as peak: work()`` then ``peak["bytes"]``: the peak memory the work added on
    top of what was allocated before it (CUDA: allocator peak; CPU: resident-set high-water mark, see the
    module docstring). ``peak["bytes"]`` is None where it cannot be measured honestly in-process."""
    device = torch.device(device)
    out: dict[str, object] = {"bytes": None, "method": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out.update(bytes=torch.cuda.max_memory_allocated(device) - base, method="cuda-allocator")
        return
    trim_heap()
    ok = reset_peak()
    base = status_kib("VmRSS") if ok else None
    yield out
    if ok and base is not None:
        out.update(bytes=max(0, (status_kib("VmHWM") or base) - base) * 1024, method="hwm-reset")
    else:
        out["method"] = "unavailable"


def machine_load() -> dict:
    """1-minute load average against the CPU count; timings taken while other processes compete for the
    cores (OpenMP threads then wait on each other) can be off by an order of magnitude."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return {"load_1min": None, "cpus": os.cpu_count(), "busy": None}
    cpus = os.cpu_count() or 1
    return {"load_1min": load, "cpus": cpus, "busy": load > 0.75 * cpus}


def load_warning(load: dict, threads: int) -> str | None:
    if not load["busy"]:
        return None
    return (f"warning: the machine is busy (load {load['load_1min']:.1f} on {load['cpus']} CPUs): timings are "
            f"unreliable{'; --threads 1 suffers least from the contention' if threads > 1 else ''}")


# ------------------------------------------------------------------------------------ the three figures
def paired_ratio(fn_num: Callable[[], object], fn_den: Callable[[], object], device, rounds: int) -> dict:
    """Time two calls alternately (after one warm-up each), ``rounds`` times: both see the same machine
    state, so the median of the per-round ratios survives load from other processes that would skew two
    separate medians. Returns the ratio and each call's fastest time."""
    device = torch.device(device)
    fn_num(), fn_den()
    num, den = [], []
    for _ in range(max(1, rounds)):
        for fn, acc in ((fn_num, num), (fn_den, den)):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            acc.append(time.perf_counter() - t)
    ratios = sorted(a / b for a, b in zip(num, den))
    return {"ratio": ratios[len(ratios) // 2], "seconds_num": min(num), "seconds_den": min(den)}


def figure_m_ratio(b: int, k: int, d: int, m_low: int, m_high: int, cfg: PowerCLIPLossConfig, device,
                   repeats: int) -> dict:
    """(a) NLA loss step time at m_high over m_low, same batch size."""
    lo = make_batch(b, m_low, k, d, seed=m_low, device=device)
    hi = make_batch(b, m_high, k, d, seed=m_high, device=device)
    r = paired_ratio(lambda: loss_step("nla", hi, cfg), lambda: loss_step("nla", lo, cfg), device, repeats)
    return {"B": b, "K": k, "d": d, "M_low": m_low, "M_high": m_high, "seconds_low": r["seconds_den"],
            "seconds_high": r["seconds_num"], "ratio": r["ratio"], "target": 1.5, "met": r["ratio"] <= 1.5}


def figure_exact_ratio(b: int, k: int, d: int, m: int, cfg: PowerCLIPLossConfig, device, repeats: int) -> dict:
    """(b) exact loss step time over the NLA loss step time, same batch."""
    batch = make_batch(b, m, k, d, seed=1, device=device)
    r = paired_ratio(lambda: loss_step("exact", batch, cfg), lambda: loss_step("nla", batch, cfg), device,
                     max(1, repeats // 2))
    return {"B": b, "K": k, "d": d, "M": m, "seconds_nla": r["seconds_den"], "seconds_exact": r["seconds_num"],
            "ratio": r["ratio"], "target": 50.0, "met": r["ratio"] >= 50.0}


def _memory_child(spec: dict) -> dict:
    """Runs inside a fresh process: peak growth of pair_similarities without and with gradients."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    cfg = NLAConfig()
    out = {"method": None}
    for grad in (False, True):
        batch = make_batch(spec["bi"], spec["m"], spec["k"], spec["d"], seed=0, device=device, requires_grad=grad)
        args = (batch["regions"], batch["region_mask"], batch["nodes"], batch["node_mask"], cfg)
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with peak_growth(device) as peak:
            t2r, r2t = pair_similarities(*args, chunk_size=spec["chunk_size"])
            if grad:
                (t2r.sum() + r2t.sum()).backward()
        if peak["bytes"] is None and not grad:  # no HWM reset: the fresh process's ru_maxrss growth (kB)
            peak.update(bytes=max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024,
                        method="ru_maxrss-fresh-process")
        out["grad" if grad else "forward"] = peak["bytes"]
        out["method"] = out["method"] or peak["method"]
        del batch, args, t2r, r2t
    out["process_peak_rss_bytes"] = (status_kib("VmHWM") or 0) * 1024 or None
    return out


def figure_memory(bi: int, m: int, k: int, d: int, chunk_size: int, device, threads: int) -> dict:
    """(c) peak memory of chunked pair similarities (Bi = Bj), each measurement in a fresh subprocess."""
    spec = {"bi": bi, "m": m, "k": k, "d": d, "chunk_size": chunk_size, "device": str(device), "threads": threads}
    code = ("import json, sys; from train.bench.nla import _memory_child; "
            "print('RESULT ' + json.dumps(_memory_child(json.loads(sys.argv[1]))))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env,
                          cwd=root)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    full = bi * bi * m * k * 4
    fwd = res["forward"]
    return {"Bi": bi, "Bj": bi, "M": m, "K": k, "d": d, "chunk_size": chunk_size, "method": res["method"],
            "forward_peak_bytes": fwd, "grad_peak_bytes": res["grad"],
            "process_peak_rss_bytes": res["process_peak_rss_bytes"],
            "unchunked_q_bytes": full, "target_bytes": 2 * GIB,
            "met": None if fwd is None else fwd <= 2 * GIB}


def figure_fused(b: int, m: int, k: int, d: int, cfg: PowerCLIPLossConfig, device, repeats: int) -> dict:
    """(d) forward + backward of the pair similarities: reference path (checkpointed / plain) over fused."""
    batch = make_batch(b, m, k, d, device=device)

    def step(**kw):
        def f():
            for key in ("regions", "nodes"):
                batch[key].grad = None
            t2r, r2t = pair_similarities(batch["regions"], batch["region_mask"], batch["nodes"], batch["node_mask"],
                                         cfg.nla, chunk_size=cfg.chunk_size, **kw)
            (t2r.sum() + r2t.sum()).backward()
        return f

    ckpt = paired_ratio(step(fused=False, checkpoint=True), step(fused=True), device, repeats)
    plain = paired_ratio(step(fused=False, checkpoint=False), step(fused=True), device, repeats)
    return {"B": b, "M": m, "K": k, "d": d, "seconds_fused": min(ckpt["seconds_den"], plain["seconds_den"]),
            "seconds_checkpointed": ckpt["seconds_num"], "seconds_plain": plain["seconds_num"],
            "speedup_vs_checkpointed": ckpt["ratio"], "speedup_vs_plain": plain["ratio"]}


# ------------------------------------------------------------------------------------------------- CLI
def build_parser() -> Parser:
    p = Parser(prog="python -m train.bench.nla", description=help_description(__doc__))
    p.add_argument("--only", default="a,b,c,d", help="comma list of figures to measure: a (M ratio), b (exact vs "
                                                     "NLA), c (memory), d (fused vs reference path)")
    p.add_argument("--batch", type=positive_int, default=128, help="(a), (d) batch size B")
    p.add_argument("--k", type=positive_int, default=16, help="tree nodes per text K")
    p.add_argument("--dim", type=positive_int, default=512, help="embedding width d")
    p.add_argument("--m-low", type=positive_int, default=5, help="(a) the smaller M")
    p.add_argument("--m-high", type=positive_int, default=15, help="(a) the larger M")
    p.add_argument("--exact-m", type=positive_int, default=12, help="(b) regions M")
    p.add_argument("--exact-batch", type=positive_int, default=32,
                   help="(b) batch size: the exact loss keeps B^2 2^M K floats for its backward (B = 32, M = 12: "
                        "0.27 GB; B = 128 would need 4.3 GB)")
    p.add_argument("--mem-batch", type=positive_int, default=1024, help="(c) Bi = Bj")
    p.add_argument("--mem-m", type=positive_int, default=10, help="(c), (d) regions M")
    p.add_argument("--chunk-size", type=positive_int, default=PowerCLIPLossConfig().chunk_size,
                   help="pair-similarity chunk (rows of the batch at a time)")
    p.add_argument("--repeats", type=positive_int, default=7,
                   help="alternating timed rounds per ratio (the median per-round ratio is reported; (b) uses half)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures to this JSON file")
    return p


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - {"a", "b", "c", "d"}
    if unknown:
        raise ValueError(f"--only: unknown figure(s) {', '.join(sorted(unknown))}; choose from a, b, c, d")
    cfg = replace(PowerCLIPLossConfig(), chunk_size=args.chunk_size)
    out: dict = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "config": asdict(cfg)}
    print(f"PowerCLIP NLA benchmark on {device} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"loss = CLIP + {cfg.lam} x triplet, tau {cfg.nla.tau_t1}/{cfg.nla.tau_t2}, alpha {cfg.nla.alpha}")
    out["load_before"] = load = machine_load()
    if device.type == "cpu" and (msg := load_warning(load, torch.get_num_threads())):
        print(msg)
    if "a" in only:
        a = out["a"] = figure_m_ratio(args.batch, args.k, args.dim, args.m_low, args.m_high, cfg, device,
                                      args.repeats)
        print(f"(a) NLA loss step (fwd+bwd), B={a['B']} K={a['K']} d={a['d']}: M={a['M_low']} "
              f"{a['seconds_low'] * 1e3:.1f} ms, M={a['M_high']} {a['seconds_high'] * 1e3:.1f} ms -> "
              f"{a['ratio']:.2f}x (target <= 1.5x: {'met' if a['met'] else 'MISSED'})")
        if not a["met"]:
            print(f"    the loss alone is Theta(B^2 M K d) (one GEMM) + Theta(B^2 M K) (one softplus per tau), "
                  f"so its cost grows with M; M={a['M_high']}/M={a['M_low']} = {a['M_high'] / a['M_low']:.1f}x is "
                  "the ceiling, reached when the fixed per-pair work is negligible")
    if "b" in only:
        b = out["b"] = figure_exact_ratio(args.exact_batch, args.k, args.dim, args.exact_m, cfg, device,
                                          args.repeats)
        print(f"(b) loss step at M={b['M']}, B={b['B']} K={b['K']} d={b['d']}: exact {b['seconds_exact']:.3f} s, "
              f"NLA {b['seconds_nla'] * 1e3:.1f} ms -> exact/NLA {b['ratio']:.0f}x "
              f"(target >= 50x: {'met' if b['met'] else 'MISSED'})")
    if "c" in only:
        c = out["c"] = figure_memory(args.mem_batch, args.mem_m, args.k, args.dim, args.chunk_size, device,
                                     torch.get_num_threads())

        def fmt(x):
            return "n/a" if x is None else f"{x / MIB:.0f} MiB"

        verdict = "unmeasured" if c["met"] is None else ("met" if c["met"] else "MISSED")
        print(f"(c) pair similarities Bi=Bj={c['Bi']} M={c['M']} K={c['K']} d={c['d']}, chunk {c['chunk_size']} "
              f"[{c['method']}, fresh process]: forward peak +{fmt(c['forward_peak_bytes'])} "
              f"(target <= 2 GiB: {verdict}); forward+backward peak +{fmt(c['grad_peak_bytes'])}; "
              f"the unchunked q alone would be {fmt(c['unchunked_q_bytes'])}")
    if "d" in only:
        f = out["d"] = figure_fused(args.batch, args.mem_m, args.k, args.dim, cfg, device, args.repeats)
        print(f"(d) pair similarities fwd+bwd, B={f['B']} M={f['M']} K={f['K']} d={f['d']}: fused "
              f"{f['seconds_fused'] * 1e3:.1f} ms; reference path {f['speedup_vs_checkpointed']:.2f}x slower with "
              f"checkpointing ({f['seconds_checkpointed'] * 1e3:.1f} ms), {f['speedup_vs_plain']:.2f}x without "
              f"({f['seconds_plain'] * 1e3:.1f} ms)")
    out["load_after"] = load = machine_load()
    if device.type == "cpu" and (msg := load_warning(load, torch.get_num_threads())):
        print(msg.replace("is busy", "was busy"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


class MeasurementFailed(JobFailed):
    """The memory measurement's subprocess failed (its stderr is in the message): status 2."""

    exit_code = 2


def main(argv: Sequence[str] | None = None) -> int:
    def job(args: argparse.Namespace) -> None:
        try:
            run(args)
        except RuntimeError as e:
            raise MeasurementFailed(str(e)) from None

    return run_job(job, build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
