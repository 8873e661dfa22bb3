"""``python -m train.adapter``: train a compositional adapter head on a frozen backbone, from cached features
(or, with ``--unfreeze``, together with the backbone from raw data).

    python -m train.adapter --method comalign                                  # tiny backbone, the default toy world
    python -m train.adapter --method comalign --data toy/ --out runs/comalign  # a toy world of your own
    python -m train.adapter --base ViT-B-32 --method comalign --data pairs.csv --detector yolov9c.pt \\
        --val-data val.csv --test-data test.csv --out runs/b32-comalign
    accelerate launch --multi_gpu --num_processes 4 -m train.adapter --base ViT-L-14 --method comalign ...

From Python the same job is ``train(AdapterOptions(method="comalign", data="toy/", epochs=2))``: the command line
only parses into :class:`AdapterOptions`, and both go through :func:`resolve`'s checks.

What it does, in order:

1. Resolves ``--method`` in the registry (``adapters.registry.ADAPTERS``; an unknown name lists the choices)
   and loads the frozen backbone: absent weights fail here, in seconds, naming the file to supply. Then the
   data (default: the embedded toy world, ``extract.worlds.toyworld.ensure``, generated at ``runs/toy`` on first use)
   and the run folder (default ``runs/<base>-<method>``; a folder holding a run with other settings is refused,
   ``extract.common.run_dir.claim``).
2. Gets the feature caches the method needs (its head class names the components; ``train.adapter.data``):
   built with ``python -m extract``'s code when missing, reused by fingerprint when present; a ``--cache`` built
   for another backbone or without the needed components is an error naming both. Held-out split: a toy
   world's ``val`` split, ``--val-data``, or a seeded ``--val-fraction`` of the training images (all captions
   of a held-out image are held out).
3. Trains with AdamW (no decay on biases, gains and scalars), warm-up + cosine or StepLR (``--schedule``),
   autocast (``--precision``), gradient accumulation, on one device or several (``accelerate launch`` /
   ``torchrun``: each rank's loss sees the global batch, gathered by the head). Batches are caption rows
   gathered from the memory-mapped cache, shuffled per epoch by ``(seed, epoch)``, with no image twice in a
   batch (``train.adapter.data.epoch_batches``).
4. Evaluates on the held-out split from cached features (retrieval R@k; per-type accuracy on the toy world's hard
   negatives), logs to ``metrics.csv``, ``history.json`` and TensorBoard (``RUN/tb``), and writes
   ``RUN/checkpoints/last.safetensors`` (``--resume`` continues from it exactly: weights, optimizer, schedule, RNG,
   position in the data order and the stopping rule's state). Without ``--epochs`` the run ends when the held-out
   figures stop improving, after a cool-down of the learning rate (``train.adapter.stopping``); with it, after that
   many epochs of warm-up + cosine (or ``--schedule``).
5. Fits the head's inference-only parameters on the held-out split (``fit_inference``: ComAlign's fusion
   weights, eq. 10-11), saves ``RUN/adapter.safetensors`` (+ ``.json``), a self-describing checkpoint that
   ``python -m train.eval --model RUN/adapter.safetensors`` and serving rebuild from the file alone (trained on
   detected boxes, the run folder also carries the detector, ``RUN/detector.pt``, named with its SHA-256), and
   writes the test-split table of the frozen base vs base + adapter (``RUN/eval/results.{json,md,png}``).

Gradient accumulation (``--accum-steps K``): the gradient of the whole batch over K micro-batches
(``train.adapter.step``). The code, by role: options (``train.adapter.options``), one optimisation step
(``step``), the run's pieces (``run``), the training state and ``--resume`` (``resume``), the logs (``logs``);
this module runs them in order.

Divergence: a step whose loss or gradients are not finite is skipped (no update) and logged; ``--max-bad-steps``
of them in a row abort the run with exit status 3, keeping the last good checkpoint.

``--unfreeze`` (heads whose class sets ``supports_unfreeze``, e.g. SmartCLIP's official recipe) fine-tunes the
backbone with the head (``train.adapter.live``): no feature cache; images and captions are read from the raw
source with the same held-out rules and batch order, the backbone runs in train mode with gradients in its own
AdamW groups at ``--backbone-lr`` (default: the head class's ``backbone_lr``), ``--context-length 248``
stretches the text positions first (Long-CLIP, ``extract.models.long_context``; the first 20 stay fixed). Held-out
evaluation re-encodes the held-out split with the current backbone every epoch; the checkpoint adds
``RUN/backbone.safetensors`` (open_clip's state dict), named with its SHA-256 and context length in the adapter's
description, so ``load_scorer(RUN/adapter.safetensors)`` rebuilds the fine-tuned model from the run folder alone.
The head's learning rate defaults to its class's ``head_lr`` (when it names one) in both modes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from adapters.heads.base import to_tensors
from adapters.checkpoint import save_adapter, save_backbone_weights, save_detector
from adapters.registry import ADAPTERS
from extract.components.hard_negatives import parse_types
from extract.common.cli import progress, run_job, say
from extract.worlds.toyworld import is_toyworld
from train.adapter.data import (caption_rows_of, check_cache, epoch_batches, extraction_options, cache_config,
                                final_table_data, obtain_cache, split_images)
from train.adapter.heldout import CachedBase, attach_toyworld_negatives, encode_heldout, evaluate_heldout, \
    heldout_split
from train.adapter.logs import RunLogs
from train.adapter.options import AdapterOptions, options_json, parse_args, resolve
from train.adapter.resume import resume_key, save_state, start_or_resume
from train.adapter.run import Env, Model, Run, TrainData
from train.adapter.step import AdapterRun, compute_gradients, make_optimizer, make_scheduler, mean_over_ranks, \
    optimizer_step, share_plateau
from train.adapter.stopping import Plateau, held_out_score


# --------------------------------------------------------------------------------------------- the run, step by step
def _describe_base(opts: AdapterOptions, backbone) -> dict:
    info = backbone.describe(hash_weights=True)
    pretrained = opts.pretrained
    if pretrained and os.path.exists(pretrained):
        pretrained = os.path.abspath(pretrained)  # the checkpoint must find it from any working directory
    return {"base": opts.base, "pretrained": pretrained, "weights_sha256": info.get("weights_sha256"), "describe": info}


def _flat_metrics(result: dict) -> dict[str, float]:
    from train.eval.report import headline

    return headline(result)


def _summary_line(metrics: dict[str, float]) -> str:
    keys = [k for k in ("retrieval T2I R@1", "retrieval I2T R@1", "toyworld all") if k in metrics]
    return ", ".join(f"{k.replace('retrieval ', '')} {metrics[k]:.2f}" for k in keys)


def setup(opts: AdapterOptions) -> Env:
    """Processes and device (accelerate), then the frozen backbone: absent weights fail here, in about a second,
    before any data is read, generated or extracted."""
    from accelerate import Accelerator

    from extract.models.backbone import load_backbone

    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[opts.precision]
    cpu = opts.device is not None and torch.device(opts.device).type == "cpu"
    accelerator = Accelerator(cpu=cpu or not torch.cuda.is_available(), mixed_precision=mixed)
    device = torch.device(opts.device) if opts.device and not cpu else accelerator.device
    ctx = AdapterRun(accelerator, accelerator.process_index, accelerator.num_processes, device,
               accelerator.scaler if mixed == "fp16" else None)
    backbone = load_backbone(opts.base, opts.pretrained, device=device, precision=opts.extract_precision)
    return Env(accelerator, ctx, accelerator.is_main_process, backbone, _describe_base(opts, backbone))


def place_run(opts: AdapterOptions, env: Env) -> AdapterOptions:
    """``opts`` with its data and run folder: without ``--data`` (or ``--cache``) the embedded toy world, generated
    on first use (``extract.worlds.toyworld.ensure``); without ``--out`` ``runs/<base>-<method>``. The folder is claimed
    (``extract.common.run_dir.claim``): one holding a run with other settings is refused, unless ``--resume``."""
    from extract.worlds import toyworld
    from extract.common.run_dir import claim, default_out

    if opts.data is None and opts.cache is None:
        env.say(f"no --data: training on the embedded toy world {_length(opts)}")
        if env.is_main:  # DEFAULT_N read at call time, so a test can make the default world small
            toyworld.ensure(toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED, say=env.say)
        env.accelerator.wait_for_everyone()
        opts = dataclasses.replace(opts, data=str(toyworld.DEFAULT_PATH))
    if opts.out is None:
        opts = dataclasses.replace(opts, out=str(default_out(opts.base, opts.method)))
        env.say(f"no --out: the run folder is {opts.out}")
    claim(Path(opts.out), options_json(opts), resume=bool(opts.resume))
    env.out = Path(opts.out)
    return opts


def load_data(opts: AdapterOptions, env: Env) -> TrainData:
    """The caches (built or reused) and the held-out split, or with ``--unfreeze`` the raw source's splits
    (``train.adapter.live``); the global batch checked against the training images."""
    check_batch_fits(opts, env.ctx.world)  # from the data's index: minutes of extraction must not end in an error
    data = _live_data(opts, env) if opts.unfreeze else _cached_data(opts, env)
    data.global_batch = opts.batch_size * env.ctx.world
    n_images = len(np.unique(data.caption_image[data.train_rows]))
    if data.global_batch > n_images:
        raise ValueError(f"the global batch ({data.global_batch}) exceeds the {n_images} training images: a batch "
                         "holds each image at most once (no caption is a negative of its own image); lower --batch-size")
    data.steps_per_epoch = len(data.train_rows) // data.global_batch
    if data.steps_per_epoch == 0:
        raise ValueError(f"{len(data.train_rows)} training captions make no batch of {data.global_batch}; lower "
                         "--batch-size")
    return data


def _cached_data(opts: AdapterOptions, env: Env) -> TrainData:
    """Caches for training and the held-out split (built or reused), the split itself and the toy world's hard
    negatives of the held-out images."""
    from adapters.adapter_scorer import LiveExtractor

    head_cls = ADAPTERS.get(opts.method)
    device, workers = str(env.backbone.device), _workers(opts)
    world = Path(opts.data) if opts.data and is_toyworld(opts.data) else None

    def cache_for(data, split=None, detector=None):
        options = extraction_options(opts, data, split, device=device, workers=workers)
        if detector:  # the training cache's: a held-out toy world would otherwise detect with its own toy detector
            options.detector = detector
        return obtain_cache(options, env.backbone)

    if opts.cache:
        from extract.cache import FeatureCache

        cache = FeatureCache.open(opts.cache)
        check_cache(cache, head_cls, env.backbone, opts.extract_options)
    else:
        cache = cache_for(opts.data, "train" if world else None)
    missing = sorted((set(head_cls.image_keys) | set(head_cls.text_keys)) - set(cache.keys))
    if missing:
        raise ValueError(f"cache {cache.path} lacks arrays {missing} that {opts.method} reads")
    caption_image = cache.caption_image_index()
    extraction = cache_config(cache)
    box_source = (cache.settings.get("boxes") or {}).get("source")
    annotations = extraction.get("annotations") if box_source == "gt" and world is None else world
    extractor = LiveExtractor(env.backbone, extraction, box_source=box_source, annotations=annotations)

    if opts.val_data or world is not None:
        spec = opts.val_data or world
        val = heldout_split(cache_for(spec, "val" if is_toyworld(spec) else None, extraction.get("detector")),
                            name="val")
        train_rows = np.arange(cache.num_captions)
    else:
        train_images, val_images = split_images(cache.num_images, opts.val_fraction, opts.seed)
        val = heldout_split(cache, val_images, name=f"val ({opts.val_fraction:g} of the training images)")
        train_rows = caption_rows_of(caption_image, train_images)
    negatives_world = world if not opts.val_data else (Path(opts.val_data) if is_toyworld(opts.val_data) else None)
    if negatives_world is not None and env.is_main:
        attach_toyworld_negatives(val, negatives_world, "val", extractor)
    description = {"fingerprint": cache.fingerprint, "settings": cache.settings, "args": extraction,
                   "path": str(cache.path)}
    negatives = None
    if opts.hard_negatives != "none":
        negatives = _training_negatives(opts, env, cache, train_rows, extractor, world)
    return TrainData(train_rows, caption_image, description, cache.fingerprint, final_table_data(opts), cache=cache,
                     val=val, negatives=negatives)


def _training_negatives(opts: AdapterOptions, env: Env, cache, train_rows: np.ndarray, extractor, world):
    """--hard-negatives: every training caption's negatives, drawn from the training captions' vocabulary and encoded
    once (``train.adapter.negatives``); on a toy world none names a held-out combination."""
    from extract.common.source_args import source_options
    from train.adapter.negatives import (build_negatives, caption_texts, draw_negatives, encode_negatives,
                                         split_world, world_negatives)

    if opts.cache:
        raise ValueError("--hard-negatives reads the training captions from --data; it does not work with --cache "
                         "alone: pass --data (the cache is reused by fingerprint)")
    options = {"image_root": opts.image_root} if opts.image_root and world is None else {}
    texts = caption_texts(cache, opts.data, "train" if world else None, {**options, **source_options(opts)})
    from extract.worlds.toyworld import heldout_of

    forbid = heldout_of(world) if world is not None else frozenset()
    own, spec = split_world(opts.hard_negatives)
    if not own:
        return build_negatives(texts, train_rows, parse_types(spec), extractor.batch_text_arrays, seed=opts.seed,
                               forbid=forbid, batch_size=opts.extract_batch_size, say=env.say)
    if world is None:
        raise ValueError(f"--hard-negatives world reads a toy world's negatives.json; {opts.data} is not a toy world "
                         "folder: draw them from the parse instead (--hard-negatives all)")
    drawn = world_negatives(world, texts, cache.caption_ids(), train_rows)
    if spec:
        drawn = drawn.joined(draw_negatives(texts, train_rows, parse_types(spec), seed=opts.seed, forbid=forbid))
    return encode_negatives(drawn, train_rows, extractor.batch_text_arrays, batch_size=opts.extract_batch_size,
                            say=env.say)


def _live_data(opts: AdapterOptions, env: Env) -> TrainData:
    """--unfreeze: the raw source's splits, and (fresh runs) the frozen base's held-out arrays, computed before the
    backbone is stretched or trained."""
    from train.adapter.live import prepare_live

    live = prepare_live(opts, env.backbone, env.base_info["describe"], ADAPTERS.get(opts.method))
    val = live.heldout(opts.extract_batch_size, _workers(opts)) if env.is_main and not opts.resume else None
    negatives = None
    if opts.hard_negatives != "none":  # tokenized per batch: the backbone being trained encodes them
        from extract.worlds.toyworld import heldout_of
        from train.adapter.negatives import LiveNegatives, draw_negatives

        drawn = draw_negatives(live.train.texts, live.train_rows, parse_types(opts.hard_negatives), seed=opts.seed,
                               forbid=heldout_of(live.world) if live.world is not None else frozenset())
        env.say(drawn.summary(len(live.train_rows)))
        negatives = LiveNegatives(drawn, env.backbone.tokenizer, env.backbone.context_length,
                                  text_arrays=live.data_arrays.texts if live.data_arrays else None)
    return TrainData(live.train_rows, live.caption_image, live.extraction, f"live {live.train.name}",
                     final_table_data(opts), live=live, val=val, negatives=negatives)


def build_model(opts: AdapterOptions, env: Env, data: TrainData) -> Model:
    """The head (and with ``--unfreeze`` the backbone made trainable, its text context stretched first), AdamW and
    the schedule."""
    head_cls = ADAPTERS.get(opts.method)
    backbone = env.backbone
    if data.live is not None:
        from extract.models.long_context import extend_backbone_context

        if opts.context_length is not None:
            # Long-CLIP §3.1: first 20 positions kept (and frozen by a gradient hook), the rest stretched
            extend_backbone_context(backbone, opts.context_length, freeze_kept=True)
        backbone.unfreeze()
    # Seeded right here: extraction may have drawn from the global RNG (DataLoader seeds), and every rank must
    # start from the same weights; dropout then gets a per-rank stream.
    torch.manual_seed(opts.seed)
    head = head_cls.from_config(opts.head_config, backbone.embed_dim).to(env.ctx.device)
    torch.manual_seed(opts.seed + 1 + env.ctx.rank)
    trained, modules = head, {}
    if data.live is not None:
        from train.adapter.live import LiveModel

        trained, modules = LiveModel(backbone, head), {"backbone": backbone.model}
    optimizer = make_optimizer(head, opts, backbone.model if data.live is not None else None)
    plateau = None
    if opts.epochs is None:  # the steps an epoch really takes (a batch holds each image once): the first epoch's
        plateau = Plateau.from_options(opts, len(_batches(opts, data, 0)))
    scheduler = make_scheduler(optimizer, opts, data.steps_per_epoch * (opts.epochs or 0), data.steps_per_epoch,
                               plateau)
    key = resume_key(opts, head.config_dict(), env, data.key, len(data.train_rows))
    return Model(head, trained, modules, optimizer, scheduler, key, plateau)


def begin(run: Run) -> None:
    """Say what trains on what; on a fresh start, the frozen base's held-out figures (the history's first row)."""
    opts, env, data, model = run.opts, run.env, run.data, run.model
    if data.live is not None:
        held = f"held-out {len(data.live.val.records)} images / {len(data.live.val.texts)} captions"
    else:
        held = (f"held-out {len(data.val.image_rows)} images / {len(data.val.caption_rows)} captions"
                + (f" + {len(data.val.negatives)} hard negatives" if data.val.negatives else ""))
    n_images = len(np.unique(data.caption_image[data.train_rows]))
    trainable = sum(p.numel() for p in model.trained.parameters() if p.requires_grad)
    tuned = ""
    if data.live is not None:
        tuned = (f" (backbone lr {opts.backbone_lr:g}, head lr {opts.lr:g}"
                 + (f", text context {env.backbone.context_length}" if opts.context_length else "") + ")")
    info = env.base_info["describe"]  # what is loaded, said once (open_clip's own "no pretrained weights" is muted)
    weights = {"random": "random weights", "file": f"weights {info.get('weights_file')}"}.get(
        info.get("weights"), f"open_clip weights '{info.get('pretrained')}'")
    env.say(f"backbone: {opts.base} ({info.get('model')}, {weights})")
    plateau = run.model.plateau  # without --epochs: the steps an epoch really takes
    per_epoch = plateau.steps_per_epoch if plateau is not None else data.steps_per_epoch
    env.say(f"{opts.method} on {opts.base}{' (fine-tuning the backbone)' if data.live is not None else ''}: "
            f"{len(data.train_rows)} training captions of {n_images} images, {held}; {per_epoch} steps/epoch "
            f"{_length(opts, plateau)}, global batch {data.global_batch} on {env.ctx.world} process(es), "
            f"{trainable:,} trainable parameters{tuned}")
    if env.is_main and not opts.resume:
        base = _flat_metrics(evaluate_heldout(CachedBase(), data.val, env.ctx.device, opts.eval_batch_size))
        env.say(f"frozen base on {data.val.name}: {_summary_line(base)}")
        run.state.history.append({"epoch": 0, "step": 0, "model": "base", **base})


def train_epoch(run: Run, epoch: int) -> None:
    """The steps of one epoch from the state's position: all of them, or up to ``--stop-after-steps`` (then the
    state is saved and ``state.stopped`` set)."""
    opts, env, data, model, state = run.opts, run.env, run.data, run.model, run.state
    ctx, head_cls = env.ctx, type(model.head)
    batches = _batches(opts, data, epoch)

    def mine(rows: np.ndarray) -> np.ndarray:  # this rank's slice of a global batch
        return rows[ctx.rank * opts.batch_size:(ctx.rank + 1) * opts.batch_size]

    if data.live is not None:  # images decoded and captions tokenized by DataLoader workers, batches in this order
        from train.adapter.live import batch_loader

        loader = iter(batch_loader(data.live.train, [mine(b) for b in batches[state.batch:]], env.backbone,
                                   _workers(opts), keep_pixels=bool(data.live.data_arrays
                                                                    and data.live.data_arrays.needs_pixels)))
    keys = list(dict.fromkeys([*head_cls.image_keys, *head_cls.text_keys]))
    trained = model.trained
    if data.negatives is not None:
        from train.adapter.negatives import NegativeLoss

        trained = NegativeLoss(model.trained, opts.hard_negative_weight, data.negatives.types)
    model.trained.train()
    bar = progress(range(state.batch, len(batches)), desc=f"epoch {epoch + 1}/{opts.epochs or model.plateau.end_epoch}",
                   unit="step", disable=not env.is_main)
    for b in bar:
        t0 = time.perf_counter()
        if data.live is not None:
            images, texts, rows = _live_batch(next(loader), data.live, ctx, env.warn)
            if data.negatives is not None:
                texts.update({k: v.to(ctx.device) for k, v in data.negatives.batch(rows).items()})
        else:
            arrays = to_tensors(data.cache.batch(mine(batches[b]), keys), ctx.device)
            images, texts = {k: arrays[k] for k in head_cls.image_keys}, {k: arrays[k] for k in head_cls.text_keys}
            if data.negatives is not None:
                texts.update(to_tensors(data.negatives.batch(mine(batches[b]), head_cls.text_keys), ctx.device))
        out = compute_gradients(trained, images, texts, opts.accum_steps, ctx)
        lr = model.optimizer.param_groups[0]["lr"]
        lrs = {"lr_backbone": model.optimizer.param_groups[-1]["lr"]} if data.live is not None else {}
        reason = optimizer_step(model.trained, model.optimizer, out, opts, ctx)
        with warnings.catch_warnings():  # a skipped first step is not the misuse torch warns about
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
            model.scheduler.step()  # skipped steps count: the schedule follows the step number
        state.step, state.batch = state.step + 1, b + 1
        row = {"step": state.step, "epoch": epoch + (b + 1) / len(batches), "lr": lr, **lrs,
               **mean_over_ranks(out, ctx), "seconds": time.perf_counter() - t0,
               "skipped": int(reason is not None), "reason": reason or ""}
        run.logs.step(row)
        if reason is None:
            state.bad.good()
            bar.set_postfix(loss=f"{row['loss']:.4f}")
        else:
            _skipped_step(run, reason)
        if opts.save_every and state.step % opts.save_every == 0:
            save_state(run)
        if opts.stop_after_steps and state.step >= opts.stop_after_steps:
            state.stopped = True
            break
    bar.close()
    if state.stopped:
        save_state(run)
        env.say(f"stopped after step {state.step} (--stop-after-steps); continue with --resume")


def _skipped_step(run: Run, reason: str) -> None:
    """Count a step skipped as non-finite; stop the run after --max-bad-steps in a row (train.bad_steps)."""
    state = run.state
    stop = state.bad.bad(state.step)
    run.env.warn(state.bad.warning(state.step, reason))
    if stop:
        run.logs.close()
        path = run.env.state_path
        raise state.bad.stopped(str(path) if path.exists() else None, resume="--resume",
                                advice="lowering --lr, setting --grad-clip, or checking the cache for NaN features")


def end_epoch(run: Run, epoch: int) -> None:
    """Held-out figures after ``epoch`` when ``--eval-every`` says so, and after the last one (rank 0; with --unfreeze
    the split re-encoded by the backbone as it is now), logged and added to history.json; then the training state at
    the next epoch's start."""
    opts, env, data, state, plateau = run.opts, run.env, run.data, run.state, run.model.plateau
    done = epoch + 1
    if plateau is not None:  # without --epochs: the stopping rule's evaluations (train.adapter.stopping)
        due = plateau.due(done)
    else:
        due = opts.eval_every > 0 and (done % opts.eval_every == 0 or done == opts.epochs)
    score = None
    if env.is_main and due:
        if data.live is not None:
            data.val = data.live.heldout(opts.extract_batch_size, _workers(opts))
        metrics = _flat_metrics(evaluate_heldout(run.model.head, data.val, env.ctx.device, opts.eval_batch_size))
        row = {"epoch": done, "step": state.step, "model": opts.method, **metrics}
        if plateau is not None:
            row["held-out score"] = score = held_out_score(metrics)
        state.history.append(row)
        run.logs.scalars("val", {k: v for k, v in row.items() if k not in ("epoch", "step", "model")}, state.step)
        env.say(f"epoch {done}/{opts.epochs or plateau.end_epoch}: {data.val.name}: {_summary_line(metrics)}")
        (env.out / "history.json").write_text(json.dumps(state.history, indent=2) + "\n")
    elif data.live is not None:
        data.val = None  # encoded by an earlier backbone: the final evaluation encodes it again
    if plateau is not None:
        if env.is_main:
            for line in plateau.update(done, state.step, score, lambda e: len(_batches(opts, data, e))):
                env.say("  " + line)
        share_plateau(plateau, env.ctx)
    state.epoch, state.batch = done, 0
    save_state(run)


def _batches(opts: AdapterOptions, data: TrainData, epoch: int) -> list[np.ndarray]:
    """The global batches of ``epoch`` (caption rows; the same on every rank and on a --resume)."""
    return epoch_batches(data.train_rows, data.caption_image, data.global_batch, opts.seed, epoch, data.steps_per_epoch)


def _length(opts: AdapterOptions, plateau: Plateau | None = None) -> str:
    """How long the run trains, in words."""
    if opts.epochs is not None:
        return f"for {opts.epochs} epoch{'s' * (opts.epochs != 1)}"
    every = f" every {plateau.eval_every} epoch{'s' * (plateau.eval_every != 1)}" if plateau else ""
    return (f"until the held-out score stops improving ({opts.patience} evaluations{every}; at most "
            f"{opts.max_epochs} epochs)")


def finish(run: Run, summary: dict) -> dict:
    """Rank 0 after the last epoch: the head's inference-only parameters fitted on the held-out split, the adapter
    checkpoint (+ the fine-tuned backbone with --unfreeze), the final table, summary.json."""
    opts, env, data, model = run.opts, run.env, run.data, run.model
    head, device, out = model.head, env.ctx.device, env.out
    model.trained.eval()
    if data.live is not None and data.val is None:  # resumed after the last epoch's evaluation, or none was due
        data.val = data.live.heldout(opts.extract_batch_size, _workers(opts))
    image_reps, text_reps = encode_heldout(head, data.val, device, opts.eval_batch_size)
    fitted = head.fit_inference(image_reps, text_reps, data.val.caption_image)
    if fitted:
        env.say("fitted on the held-out split: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.items()))
    final_val = _flat_metrics(evaluate_heldout(head, data.val, device, opts.eval_batch_size))
    tuned = {}
    if data.live is not None:  # the fine-tuned backbone next to the adapter, named (and hashed) in its description
        tuned = {"backbone": {**save_backbone_weights(out / "backbone.safetensors", env.backbone.model),
                              "context_length": opts.context_length, "lr": opts.backbone_lr}}
        if data.live.report.skips:
            data.live.report.to_json(out / "data_report.json")
            env.warn(f"warning: skipped while training: {data.live.report.summary()} (listed in "
                     f"{out / 'data_report.json'})")
    # the detector of detected training boxes travels with the run (RUN/detector.pt), named with its SHA-256
    carried = save_detector(out, data.extraction)
    adapter_path = save_adapter(out / "adapter.safetensors", head, {
        "base": env.base_info, "extraction": data.extraction, "args": options_json(opts), "epoch": run.state.epoch,
        "step": run.state.step, "metrics": {"val": final_val}, "inference": fitted, "history": run.state.history,
        **tuned, **carried})
    env.say(f"checkpoint: {adapter_path} (held-out after fitting: {_summary_line(final_val)})")
    summary.update(adapter=str(adapter_path), val=final_val, inference=fitted)
    if model.plateau is not None:
        summary["stopping"] = model.plateau.summary()
    if tuned:
        summary["backbone"] = str(out / tuned["backbone"]["file"])
    if opts.final_eval and data.test:
        report = final_table(opts, adapter_path, data.test, device)
        summary.update(eval=report["results"], markdown=report["markdown"], reports=report["reports"])
    elif opts.final_eval:
        env.say("note: no test data (--test-data, --val-data or a toy world): no final table")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    env.accelerator.wait_for_everyone()
    return summary


def train(opts: AdapterOptions) -> dict:
    """The whole run (module docstring); ``opts`` gets the command line's checks first (:func:`resolve`).

    Returns a summary: ``out``, ``data``, ``steps``, ``skipped_steps``, ``stopped``, ``seconds``, ``history``, and
    after a finished run ``adapter`` (the checkpoint), ``val`` (held-out figures after fitting), ``inference``
    (fitted values), with the final table ``eval`` (train.eval's results), ``markdown`` (the table, not
    printed here) and ``reports``. Raises ValueError / OSError for what the user can fix, TrainingDiverged
    (exit status 3) after ``--max-bad-steps`` non-finite steps in a row."""
    opts = resolve(opts)
    env = setup(opts)                          # 1. processes, device, the backbone: absent weights fail here
    opts = place_run(opts, env)                #    the data (default: the toy world) and the run folder, claimed
    data = load_data(opts, env)                # 2. caches and the held-out split (raw splits with --unfreeze)
    model = build_model(opts, env, data)       # 3. head (+ backbone), optimizer, schedule
    state = start_or_resume(opts, env, model)  #    or the exact continuation of a saved state
    run = Run(opts, env, data, model, state, RunLogs(env.out, env.is_main, state.step if opts.resume else None))
    begin(run)
    started = time.perf_counter()
    plateau = model.plateau                    # 4. the loop: --epochs, or until the held-out score stops improving
    while state.epoch < (opts.epochs or plateau.end_epoch) and not (plateau is not None and plateau.done):
        train_epoch(run, state.epoch)
        if state.stopped:
            break
        end_epoch(run, state.epoch)
    run.logs.close()
    summary = {"out": str(env.out), "data": opts.data, "steps": state.step, "skipped_steps": state.bad.total,
               "stopped": state.stopped, "seconds": time.perf_counter() - started, "history": state.history}
    if state.stopped or not env.is_main:
        env.accelerator.wait_for_everyone()  # matched by rank 0's barrier after its final steps
        return summary
    return finish(run, summary)                # 5. fitted inference parameters, checkpoint, final table


train_adapter = train  # the name train.demo and other jobs may import without shadowing their own train()


# --------------------------------------------------------------------------------------------- helpers
def check_batch_fits(opts: AdapterOptions, world: int) -> None:
    """Raise ValueError when the global batch cannot be filled from the training images the data lists: a batch
    holds each image once, so it needs at least as many training images. Counted from the source's index before
    any extraction; the exact count after decoding (or of a given --cache) is checked again later."""
    from extract.common.source_args import source_options
    from train.adapter.data import listed_images

    if opts.cache:  # nothing expensive precedes the exact check a given cache gets in load_data()
        return
    options = {**source_options(opts),
               **({"image_root": opts.image_root} if opts.image_root and not is_toyworld(opts.data) else {})}
    n = listed_images(opts.data, "train" if is_toyworld(opts.data) else None, **options)
    if n is None:
        return
    held_out = 0
    if not opts.val_data and not is_toyworld(opts.data):  # --val-fraction of these images is held out
        held_out = max(1, int(round(n * opts.val_fraction)))
    global_batch = opts.batch_size * world
    if global_batch > n - held_out:
        raise ValueError(f"the global batch ({global_batch}) exceeds the {n - held_out} training images of "
                         f"{opts.data}" + (f" ({n} listed, {held_out} held out by --val-fraction)" if held_out else "")
                         + ": a batch holds each image at most once; lower --batch-size (checked before extraction)")


def _default_workers() -> int:
    from extract.options import DEFAULT_WORKERS

    return DEFAULT_WORKERS


def _workers(opts: AdapterOptions) -> int:
    return opts.workers if opts.workers is not None else _default_workers()


def _live_batch(batch: dict, live, ctx: AdapterRun, warn) -> tuple[dict, dict, np.ndarray]:
    """A loaded --unfreeze batch as (images, texts) inputs of LiveModel, and its caption rows. Undecodable images
    dropped their pairs; on several ranks every rank keeps as many pairs as the smallest local batch (gathered shapes
    must agree)."""
    from train.adapter.live import take

    for skip in live.note_skips(batch["skips"]):
        warn(f"warning: training image {skip.id} ({skip.location}) skipped: {skip.reason} {skip.detail}".rstrip())
    n = len(batch["rows"])
    if ctx.world > 1:
        import torch.distributed as dist

        t = torch.tensor([n], device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        n = int(t.item())
    if n == 0:
        raise ValueError("a whole training batch of undecodable images: check the data with python -m "
                         "extract.data.check (its report lists them)")
    batch = take(batch, n)
    rows = batch["rows"].numpy()
    from_data = live.batch_arrays(rows, batch["sizes"], batch["raws"])  # region masks, trees (heads that read them)
    images = {"pixels": batch["pixels"], **from_data[0]}
    texts = {"ids": batch["ids"], "attention_mask": batch["attention_mask"], **from_data[1]}
    return {k: v.to(ctx.device) for k, v in images.items()}, {k: v.to(ctx.device) for k, v in texts.items()}, rows


def final_table(opts: AdapterOptions, adapter_path: Path, test: dict, device) -> dict:
    """Frozen base vs base + adapter on the test data (``test``: EvaluateOptions data fields), through
    train.eval.evaluate (the checkpoint is rebuilt from the file alone, components extracted live). Returns
    train.eval's report, the table in ``markdown`` (not printed)."""
    from train.eval.evaluate import EvaluateOptions, evaluate

    return evaluate(EvaluateOptions(
        model=[opts.base, str(adapter_path)], pretrained=[opts.pretrained] if opts.pretrained is not None else [],
        tasks=opts.eval_tasks, out=str(Path(opts.out) / "eval"), device=str(device),
        batch_size=min(opts.eval_batch_size, 256), seed=opts.seed, **test))


def main(argv: Sequence[str] | None = None) -> int:
    def job(opts: AdapterOptions) -> None:
        summary = train(opts)
        if summary.get("markdown"):  # the final table, once
            print(summary["markdown"])
            say("reports: " + ", ".join(summary["reports"]))

    return run_job(job, parse_args(argv))
