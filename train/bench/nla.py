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

The batches and the two losses are ``train.eval.nla_batches``'s; timing, peak memory (how CPU memory is measured)
and the machine's load are ``train.measure``'s, shared with ``train.eval.nla_report``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Callable, Sequence

import torch

from extract.common.cli import JobFailed, Parser, help_description, run_job
from extract.common.config import positive_int
from extract.common.memory import status_kib
from adapters.losses.nla import NLAConfig, PowerCLIPLossConfig, pair_similarities
from train.eval.nla_batches import loss_step, make_batch
from train.measure import GIB, MIB, load_warning, machine_load, peak_growth, sync


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
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
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
