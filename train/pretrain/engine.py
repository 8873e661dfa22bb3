"""``python -m train.pretrain``: pre-train an open_clip CLIP model from scratch with CLIP, FLIP, FILIP, CLIP-PGS
or PowerCLIP, on one process or many.

    python -m train.pretrain --method powerclip                     # the embedded toy world, a few minutes on a CPU
    python -m train.pretrain --method clip --data toy --epochs 10 --out runs/pt-clip          # CPU, one process
    torchrun --nproc_per_node 8 -m train.pretrain --method powerclip --model ViT-B-16 \\
        --data 'cc12m/{00000..01242}.tar' --train-num-samples 10968539 --batch-size 512 --precision amp_bf16
    accelerate launch --multi_gpu --num_processes 8 -m train.pretrain ...
    srun python -m train.pretrain ...   # SLURM: ranks from SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR/PORT exported

A run is a function of its options: ``pretrain(PretrainOptions(method="clip", data="toy", epochs=10))`` does
what the command line with those flags does (the same checks, the same files); the command line only parses
into :class:`PretrainOptions`. Without ``--data`` a run trains on the embedded toy world
(``extract.worlds.toyworld.ensure``: ``runs/toy``, generated on first use) for ``TOY_EPOCHS`` epochs unless ``--epochs``
says otherwise (``EPOCHS`` on data you name); without ``--out`` it writes ``runs/pretrain-MODEL-METHOD``. A run
folder holding another run's settings is refused (``extract.common.run_dir.claim``), ``--resume`` continues it.

The engine follows open_clip's trainer (``open_clip_train``): AdamW (0.9, 0.98, eps 1e-6), lr 1e-3, weight
decay 0.2 on every tensor but gains, biases and the logit scale, cosine schedule with linear warm-up, autocast
(``--precision amp`` / ``amp_bf16``; fp32 by default, the CPU choice), ``--compile`` (the towers, in place:
``adapters.objectives.towers.compile_towers``), fused AdamW on CUDA, gradient checkpointing, gradient
accumulation with cached features (``--accum-freq``, open_clip's method: the negatives are the whole
accumulated batch, see below), features gathered over ranks *with* gradient and a local loss (so N ranks
give one process's loss and gradients), the logit scale clamped to ln(100) after every step.

What a method is -- its batch, its change to the forward, its loss on one or many ranks, its own flags --
lives in ``adapters/objectives/<method>.py`` (the ``PRETRAIN`` registry); this file never asks which method runs.
By role: options (``train.pretrain.options``), ranks (``dist``), model and optimizer step (``trainer``), logs
(``logs``), checkpoints (``checkpoint``), data (``data``); this module runs them in order.

Gradient accumulation: every micro-batch's features are first computed without gradients; then each
micro-batch is recomputed with gradients and the loss is evaluated on the concatenation of its fresh features
with the others' cached ones, and back-propagated. Summed over micro-batches this is exactly the gradient of
the loss on the whole accumulated batch -- for contrastive losses, whose negatives couple the samples, plain
per-micro-batch accumulation would instead optimise a different (smaller-batch) objective. The price is one
extra forward pass per micro-batch.

Reliability: ``--resume latest`` continues exactly where the run stopped (weights, optimizer, scheduler, data
position; tested against an uninterrupted run after kill -9); a non-finite loss or gradient skips the step (logged),
and ``--max-bad-steps`` of them in a row stop the run (exit status 3) with a message naming the last good
checkpoint, the checkpoints already written untouched. With fused AdamW (CUDA's default) the step needs nothing from
the host, and the metrics of several steps are read at once (:meth:`PretrainRun.read_pending`): every
min(``--log-every-n-steps``, ``--max-bad-steps``) steps and before anything that needs them, so a diverging run
stops within twice ``--max-bad-steps`` steps, with the same log and checkpoints. Checkpoints are open_clip's
safetensors plus JSON (``train/pretrain/checkpoint.py``); ``--keep-checkpoints N`` keeps the N newest, the best
evaluated one and the one ``latest`` names.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from extract.models.backbone import image_grid  # noqa: E402
from extract.common.cli import check_options, progress, run_job, say  # noqa: E402
from extract.common.config import save_config  # noqa: E402
from extract.components.hard_negatives import parse_types  # noqa: E402
from extract.common.source_args import source_options  # noqa: E402
from extract.common.tensorfile import first_nonfinite  # noqa: E402
from extract.worlds.toyworld import is_toyworld  # noqa: E402
from train.bad_steps import BadSteps, TrainingDiverged  # noqa: E402
from train.pretrain import checkpoint as ckpt  # noqa: E402
from train.pretrain.data import SeededTransform, build_train_data  # noqa: E402
from train.pretrain.prefetch import to_device_ahead  # noqa: E402
from train.pretrain.dist import Dist, init_distributed  # noqa: E402
from train.pretrain.logs import RunLog  # noqa: E402
from train.pretrain.options import (EPOCHS, TOY_EPOCHS, PretrainOptions, build_objective, build_parser,  # noqa: E402
                                    parse_args, resolve_method_options, run_config)
from train.pretrain.trainer import (Readout, Trainer, cosine_lr, create_model, read_steps,  # noqa: E402
                                   resolve_architecture)
from extract.common.run_dir import claim, default_out  # noqa: E402

# --------------------------------------------------------------------------------------------- evaluation hook
def eval_tasks(opts: PretrainOptions) -> dict:
    """The per-epoch evaluation's data (``train.eval.evaluate.load_tasks``), read once before training so a bad
    ``--val-data`` fails before the first step."""
    from train.eval import evaluate as ev

    return ev.load_tasks(ev.EvaluateOptions(data=opts.val_data, split=opts.val_split, tasks=list(opts.eval_tasks),
                                            seed=opts.seed))


def evaluate_checkpoint(weights: Path, arch: str, opts: PretrainOptions, device, tasks: dict | None = None
                        ) -> dict[str, float]:
    """Evaluate saved weights with the evaluation suite (``train.eval``'s functions) on the toy world's
    ``val_split``: retrieval R@k, zero-shot, compositional per type. ``tasks``: from :func:`eval_tasks` (read
    here when None). Returns the flat headline numbers."""
    from adapters.load import load_scorer
    from train.eval import evaluate as ev
    from train.eval.report import headline

    tasks = eval_tasks(opts) if tasks is None else tasks
    scorer = load_scorer(arch, str(weights), device=device)
    res: dict[str, Any] = {}
    if "retrieval" in tasks:
        res["retrieval"] = ev.run_retrieval(scorer, tasks["retrieval"], 128)
    if "zeroshot" in tasks:
        res["zeroshot"] = ev.run_zeroshot(scorer, *tasks["zeroshot"], 128)
    if "compositional" in tasks:
        res["compositional"] = {bm.name: ev.run_compositional(scorer, bm, 128) for bm in tasks["compositional"]}
    if "linear_probe" in tasks:
        res["linear_probe"] = ev.run_linear_probe(scorer, *tasks["linear_probe"], 128, opts.seed)
    return headline(res)


def retrieval_score(metrics: dict[str, float]) -> float | None:
    """What "best checkpoint" means: the mean of the evaluation's retrieval R@1 (T2I and I2T); None without
    retrieval numbers."""
    r1 = [v for k, v in metrics.items() if k.startswith("retrieval") and k.endswith("R@1")]
    return sum(r1) / len(r1) if r1 else None


# --------------------------------------------------------------------------------------------- a run
def _silent(*args, **kwargs) -> None:
    pass


def resolve_options(opts: PretrainOptions, dist: Dist) -> tuple[PretrainOptions, list[str]]:
    """The options with data, epochs, out and val_data filled in where they were left to the run
    (:class:`PretrainOptions`), and one line per choice made, for the run's first lines. The embedded toy world
    is generated here when it is needed."""
    notes, changes = [], {}
    if opts.data is None:
        from extract.worlds import toyworld

        # module attributes read now, not bound as defaults, so a test can make the default world small
        where, n, seed = toyworld.DEFAULT_PATH, toyworld.DEFAULT_N, toyworld.DEFAULT_SEED
        if dist.is_main:
            toyworld.ensure(where, n, seed, say=say)
        dist.barrier()
        changes["data"] = str(where)
        notes.append(f"data: the embedded toy world {where} ({n} scenes, seed {seed}; no --data given)")
    if opts.epochs is None:
        changes["epochs"] = TOY_EPOCHS if opts.data is None else EPOCHS
        notes.append(f"epochs: {changes['epochs']} (the default " + (
            f"on the embedded toy world, {EPOCHS} on data you name" if opts.data is None else "")
            + "; --epochs N to change it)")
    if opts.out is None:
        changes["out"] = str(default_out("pretrain", opts.model, opts.method))
        notes.append(f"out: {changes['out']} (no --out given)")
    data = changes.get("data", opts.data)
    if opts.val_data is None and is_toyworld(data):
        changes["val_data"] = data
    return dataclasses.replace(opts, **changes), notes


def _describe(opts: PretrainOptions, arch: str, objective, data, step: int, epoch: float, samples: int,
              metrics=None) -> dict:
    """model.json: what the weights are (see train/pretrain/checkpoint.py)."""
    import open_clip

    return {"model": arch, "model_cfg": open_clip.get_model_config(arch), "quick_gelu": bool(opts.quick_gelu),
            "method": objective.name, "method_config": objective.config(), "step": step, "epoch": epoch,
            "samples_seen": samples, "data": {**data.description, "skipped": data.report.counts()},
            "args": dataclasses.asdict(opts),  # PretrainOptions(**args) is this run's options
            "versions": {"open_clip": open_clip.__version__, "torch": torch.__version__},
            "metrics": metrics or {},
            "load": {"open_clip": f"open_clip.create_model_and_transforms({arch!r}"
                                  + (", force_quick_gelu=True" if opts.quick_gelu else "") + ", pretrained=PATH)",
                     "plugvlm": f"extract.models.backbone.load_backbone({arch!r}, PATH)"}}


VOCAB_CAPTIONS = 20000  # the hard negatives' vocabulary: at most this many training captions, evenly spaced


def with_hard_negatives(objective, opts: PretrainOptions):
    """``objective`` with NegCLIP's hard-negative columns (:mod:`adapters.objectives.hard_negatives`); its
    vocabulary is filled by :func:`fill_vocabulary` once the training data is open. On a toy world, no negative
    names one of its held-out (colour, shape) combinations."""
    from adapters.objectives.hard_negatives import WithHardNegatives
    from extract.components.hard_negatives import HardNegatives, Vocabulary

    from extract.worlds.toyworld import heldout_of

    forbid = heldout_of(opts.data) if opts.data and is_toyworld(opts.data) else frozenset()
    generator = HardNegatives(Vocabulary(), parse_types(opts.hard_negatives), forbid)
    return WithHardNegatives(objective, generator, opts.hard_negative_weight, opts.seed)


def fill_vocabulary(generator, opts: PretrainOptions, data) -> str:
    """Build the hard negatives' vocabulary from ``--hard-negative-vocab`` or the training captions (at most
    VOCAB_CAPTIONS, evenly spaced; words seen twice when there are more than 5,000). Returns a line for the log."""
    import numpy as np

    from extract.components.hard_negatives import Vocabulary
    from extract.components.text import read_captions

    if opts.hard_negative_vocab:
        captions, where = read_captions(opts.hard_negative_vocab), opts.hard_negative_vocab
    else:
        records = getattr(data.loader.dataset, "records", None)
        if records is None:
            raise ValueError("--hard-negatives on webdataset shards needs --hard-negative-vocab CAPTIONS (a file of "
                             "training captions the replacements draw from)")
        captions, where = [c.text for r in records for c in r.captions], "the training captions"
    if not captions:
        raise ValueError(f"--hard-negatives: no captions in {where}")
    picked = [captions[i] for i in np.linspace(0, len(captions) - 1, min(len(captions), VOCAB_CAPTIONS)).astype(int)]
    generator.vocab = Vocabulary.build(generator.structures(picked), min_count=2 if len(picked) > 5000 else 1)
    v = generator.vocab
    return (f"hard negatives: vocabulary of {len(picked)} captions from {where}: {len(v.nouns)} nouns, "
            + ", ".join(f"{len(w)} {c}" for c, w in sorted(v.attributes.items())) + f", {len(v.predicates)} predicates")


@dataclass(frozen=True)
class PendingStep:
    """A step done on the device whose metrics the host has not read yet (:meth:`PretrainRun.read_pending`)."""

    step: int
    epoch: float
    lr: float
    data_time: float
    readout: Readout


class PretrainRun:
    """One pre-training run, in the order :func:`pretrain` calls its steps: ``__init__`` (model, objective,
    :meth:`open_data`, optimizer), :meth:`resume`, :meth:`start`, then per epoch :meth:`train_epoch` (each step:
    :meth:`train_step`) and :meth:`end_epoch` (:meth:`checkpoint`, :meth:`evaluate`), and :meth:`finish` (the
    final weights).

    Where the run stands -- ``step`` (optimizer steps done, so the k-th step is numbered k everywhere),
    ``epoch`` (epochs done), ``in_epoch`` (steps done in the current one), ``samples``, ``bad_in_a_row`` -- is
    what a checkpoint stores and :meth:`resume` restores."""

    def __init__(self, opts: PretrainOptions, dist: Dist):
        """Setup: the model, the objective, the data, the optimizer and the evaluation's data."""
        self.opts, self.dist = opts, dist
        self.say = say if dist.is_main else _silent
        self.warn = print if dist.is_main else _silent  # warnings stay under --quiet
        self.out = Path(opts.out)
        self.ckpt_dir = self.out / "checkpoints"
        self.arch = resolve_architecture(opts.model)
        self.objective = build_objective(opts.method, opts.method_options)
        model, train_tf, eval_tf, tokenizer = create_model(self.arch, opts.quick_gelu, opts.seed, opts.pretrained)
        fixed = bool(getattr(self.objective, "needs_fixed_geometry", False))
        if fixed and opts.augment != "none":
            self.say(f"note: {opts.method} with these settings needs the evaluation geometry; training without "
                     "augmentation")
        plain = fixed or opts.augment == "none"
        self.resume_path = ckpt.find_resume(self.out, opts.resume) if opts.resume else None
        if opts.hard_negatives != "none":
            self.objective = with_hard_negatives(self.objective, opts)
        self.data = self.open_data(tokenizer, SeededTransform(eval_tf if plain else train_tf, random=not plain))
        if opts.hard_negatives != "none":  # before the first batch: the loader's workers start with it
            self.say(fill_vocabulary(self.objective.generator, opts, self.data))
        self.objective.setup(model, {"source": opts.data, "data": opts.data, "model": opts.model,
                                     "image_ids": self.data.image_ids, "grid": image_grid(model.visual)})
        self.evaluates = bool(dist.is_main and opts.eval_every_n_epochs and opts.val_data)
        self.tasks = eval_tasks(opts) if self.evaluates else None  # a bad --val-data fails before training
        self.trainer = Trainer(opts, dist, model, self.objective)
        self.total_steps = self.data.steps_per_epoch * opts.epochs
        if opts.max_steps is not None:
            self.total_steps = min(self.total_steps, opts.max_steps)
        # 10k warm-up steps on a 500-step toy run would be all of it
        self.warmup = min(opts.warmup, max(1, self.total_steps // 10))
        self.global_batch = opts.batch_size * dist.world_size * opts.accum_freq
        self.step = self.epoch = self.in_epoch = self.samples = 0
        self.bad = BadSteps(opts.max_bad_steps)  # skipped steps (train.bad_steps: the policy of both engines)
        self.last_ckpt: Path | None = None
        self.evals: dict[str, dict] = {}  # checkpoint name -> its evaluation (OUT/eval/<name>.json)
        self.log: RunLog | None = None
        self.pbar = None
        self.pending: list[PendingStep] = []  # steps whose metrics are still on the device (read_pending)
        self.read_every = 1

    # -- data
    def open_data(self, tokenizer, transform: SeededTransform):
        """This rank's training data (``train.pretrain.data``), positioned where the resumed checkpoint stopped."""
        o, dist = self.opts, self.dist
        resume_state = json.loads((self.resume_path / "state.json").read_text()) if self.resume_path else None
        return build_train_data(o.data, batch_size=o.batch_size, rank=dist.rank, world_size=dist.world_size,
                                accum_freq=o.accum_freq, seed=o.seed, tokenizer=tokenizer, objective=self.objective,
                                transform=transform, workers=o.workers, split=o.split, image_root=o.image_root,
                                source_options=source_options(o), train_num_samples=o.train_num_samples,
                                resampled=o.dataset_resampled, shuffle_buffer=o.shuffle_buffer,
                                resume_state=resume_state, pin_memory=dist.device.type == "cuda")

    # -- resume
    def resume(self) -> None:
        """Continue from ``--resume``'s checkpoint: weights, optimizer, scaler, RNG, position; the evaluations
        already made (which the best checkpoint is chosen from)."""
        if self.resume_path is None:
            if self.opts.resume:
                self.say(f"note: --resume {self.opts.resume}: no checkpoint in {self.ckpt_dir} yet; starting a new run")
            return
        t = self.trainer
        state = ckpt.load_checkpoint(self.resume_path, t.model, t.optimizer, t.param_names, t.scaler)
        self.step, self.epoch, self.in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        self.samples = state["samples_seen"]
        self.bad.load(state)
        self.last_ckpt = self.resume_path
        if state.get("global_batch") != self.global_batch:
            self.say(f"note: the checkpoint was trained with a global batch of {state.get('global_batch')}; the data "
                     "order after this resume differs from an uninterrupted run's")
        self.say(f"resumed from {self.resume_path} at step {self.step} (epoch {self.epoch}, step {self.in_epoch} of "
                 f"{self.data.steps_per_epoch})")
        for path in sorted((self.out / "eval").glob("*.json")):
            try:
                self.evals[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass  # a report cut by the kill: that epoch just does not compete for "best"

    # -- start
    def start(self, notes: Sequence[str] = ()) -> None:
        """The run folder (config.json, leftovers of a killed run removed), the logs, and the run's first lines:
        what was chosen for the user and what will run."""
        o, d = self.opts, self.data
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.ckpt_dir.is_dir():
                ckpt.clean_partial(self.ckpt_dir)
            save_config(run_config(o), self.out / "config.json")
        self.dist.barrier()
        self.log = RunLog(self.out, o.tensorboard, self.dist.is_main)
        for line in notes:
            self.say(line)
        self.say(f"objective: {self.objective.describe()}")
        samples = d.description.get("images", d.description.get("samples_per_epoch"))
        self.say(f"{self.arch} on {o.data}: {samples} samples/epoch, {d.steps_per_epoch} steps/epoch of "
                 f"{self.global_batch} ({self.dist.world_size} rank(s) x {o.accum_freq} x {o.batch_size}), "
                 f"{self.total_steps} steps, device {self.dist.device}, {o.precision}")
        evaluation = (f"evaluated on {o.val_data} ({o.val_split}) every {o.eval_every_n_epochs} epoch(s)"
                      if self.evaluates else "no per-epoch evaluation")
        kept = "all kept" if o.keep_checkpoints == 0 else f"the newest {o.keep_checkpoints} and the best kept"
        self.say(f"writing {self.out}: checkpoints {kept}, {evaluation}")
        self.pbar = progress(total=self.total_steps, initial=self.step, desc=o.method, unit="step",
                             disable=not self.dist.is_main)
        # With a step that never waits for the device (fused AdamW), the host reads the metrics every few steps
        # instead of every step, so it queues the next step while the device finishes this one (open_clip reads
        # only at log steps). Bounded by --max-bad-steps, so a diverging run stops within twice that many steps.
        self.read_every = min(o.log_every_n_steps, o.max_bad_steps) if self.trainer.defers else 1
        self.t_last = time.perf_counter()

    # -- one epoch, one step
    def running(self) -> bool:
        return self.epoch < self.opts.epochs and self.step < self.total_steps

    def train_epoch(self) -> bool:
        """The current epoch's steps from where the run stands, up to its end or the step budget. Returns True
        when the epoch was completed."""
        todo = max(0, min(self.data.steps_per_epoch - self.in_epoch, self.total_steps - self.step))
        # never a batch past the steps that run: the data report counts only what trained
        batches = itertools.islice(self.data.epoch_batches(self.epoch, self.in_epoch), todo)
        t_data = time.perf_counter()
        for micro in to_device_ahead(batches, self.dist.device):  # the next copy overlaps this step
            self.train_step(micro, data_time=time.perf_counter() - t_data)
            t_data = time.perf_counter()
        return self.in_epoch >= self.data.steps_per_epoch

    def train_step(self, micro: list[dict], data_time: float) -> None:
        """One optimizer step; its metrics are read (log rows, the bad-step count, which raises TrainingDiverged)
        when :meth:`read_due`; then a step checkpoint if one is due."""
        o = self.opts
        ctx = self.trainer.context(self.step, self.epoch, o.epochs)
        lr = cosine_lr(o.lr, self.warmup, self.total_steps, self.step)
        readout = self.trainer.step_async(micro, ctx, lr)
        self.step += 1
        self.in_epoch += 1
        self.samples += self.global_batch
        # Steps are numbered from 1 everywhere (console, log.csv, checkpoint names): step k is the k-th update.
        self.pending.append(PendingStep(self.step, self.epoch + self.in_epoch / self.data.steps_per_epoch, lr,
                                        data_time, readout))
        self.pbar.update(1)
        if self.read_due():
            self.read_pending()
        if o.save_every_n_steps and self.step % o.save_every_n_steps == 0 and self.in_epoch < self.data.steps_per_epoch:
            self.checkpoint(f"step_{self.step:08d}")
            self.dist.barrier()

    def read_due(self) -> bool:
        """Whether the steps not yet read must be read now: every ``read_every`` steps (:meth:`start`), at the
        first step, a log step, a checkpoint or the end of an epoch or of the run."""
        o, s = self.opts, self.step
        return (len(self.pending) >= self.read_every or s == 1 or s % o.log_every_n_steps == 0
                or s >= self.total_steps or self.in_epoch >= self.data.steps_per_epoch
                or bool(o.save_every_n_steps and s % o.save_every_n_steps == 0))

    def read_pending(self) -> None:
        """Read the steps not yet read with one synchronisation; in step order, their log rows (the first step,
        log steps and every skipped one) and the bad-step count. A row's ``batch_time`` is the mean over the steps
        read together: the host queues them ahead of the device, so only their sum is measured."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        results = read_steps([p.readout for p in pending])
        now = time.perf_counter()
        batch_time, self.t_last = (now - self.t_last) / len(pending), now
        every = self.opts.log_every_n_steps
        for p, (metrics, ok) in zip(pending, results):
            # the row is written before a possible abort, so the last bad step is in the log too
            if self.dist.is_main and (p.step % every == 0 or p.step == 1 or not ok):
                skipped = sum(sum(v.values()) for k, v in self.data.report.counts().items() if k != "converted")
                self.log.write(p.step, {"step": p.step, "epoch": p.epoch, "lr": p.lr, **metrics,
                                        "skipped_step": int(not ok),
                                        "samples_per_second": self.global_batch / max(batch_time, 1e-9),
                                        "batch_time": batch_time, "data_time": p.data_time, "data_skipped": skipped})
                self.pbar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{p.lr:.2e}")
            self.count_bad(p.step, ok, metrics)

    def count_bad(self, step: int, ok: bool, metrics: dict) -> None:
        """Skipped (non-finite) steps in a row; ``--max-bad-steps`` of them stop the run (train.bad_steps)."""
        if ok:
            self.bad.good()
            return
        stop = self.bad.bad(step)
        self.warn(self.bad.warning(step, f"non-finite loss or gradient: loss {metrics.get('loss')}"))
        if stop:
            raise self.bad.stopped(str(self.last_ckpt) if self.last_ckpt else None, resume="--resume latest",
                                   advice="lowering --lr, setting --grad-clip-norm 1.0, or switching --precision to "
                                   "amp_bf16 / fp32; check the data with python -m extract.data.check.")

    # -- checkpoints and evaluation
    def checkpoint(self, name: str) -> Path | None:
        """Checkpoint ``name`` at the current position, only from a good state: after a step that was not
        skipped, with finite weights (a run of skipped steps, or weights blown up to inf, must never overwrite
        what --resume would use). Then the old ones beyond ``--keep-checkpoints`` go."""
        self.read_pending()  # the bad-step count must be current
        t = self.trainer
        if not self.bad.clean or first_nonfinite(t.model.state_dict()) is not None:
            self.warn(f"warning: not writing checkpoint {name}: " + (
                f"the last {self.bad.in_a_row} step(s) were skipped as non-finite" if not self.bad.clean
                else "the weights are not finite") + (
                f"; the last good one is {self.last_ckpt}" if self.last_ckpt else "; no good checkpoint exists yet"))
            return None
        if not self.dist.is_main:
            return None
        spe = self.data.steps_per_epoch
        state = {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.in_epoch, "samples_seen": self.samples,
                 **self.bad.state(), "global_batch": self.global_batch,
                 "world_size": self.dist.world_size, "data_state": self.data.resume_state(self.step),
                 "method": self.opts.method, "model": self.arch, "data_skipped": self.data.report.counts()}
        description = _describe(self.opts, self.arch, self.objective, self.data, self.step,
                                self.epoch + self.in_epoch / spe, self.samples)
        self.last_ckpt = ckpt.save_checkpoint(self.ckpt_dir, name, t.model, t.optimizer, t.param_names, t.scaler,
                                              state, description)
        self.prune()
        return self.last_ckpt

    def best(self) -> str | None:
        """The evaluated checkpoint with the highest :func:`retrieval_score` that still exists."""
        scored = [(s, name) for name, m in self.evals.items()
                  if (s := retrieval_score(m)) is not None and (self.ckpt_dir / name).is_dir()]
        return max(scored)[1] if scored else None

    def prune(self) -> None:
        ckpt.prune(self.ckpt_dir, self.opts.keep_checkpoints, keep_also=[self.best()])

    def end_epoch(self) -> None:
        """After a completed epoch: its checkpoint (every ``--save-frequency`` epochs, and the last) and its
        evaluation (every ``--eval-every-n-epochs``, and the last)."""
        o = self.opts
        self.epoch += 1
        self.in_epoch = 0
        name = f"epoch_{self.epoch:04d}"
        last = self.epoch == o.epochs
        if (o.save_frequency and self.epoch % o.save_frequency == 0) or last:
            self.checkpoint(name)
        if (self.evaluates and self.last_ckpt is not None and self.last_ckpt.name == name
                and (self.epoch % o.eval_every_n_epochs == 0 or last)):
            self.evaluate(name)
        self.dist.barrier()
        self.t_last = time.perf_counter()  # checkpoint and evaluation time is not a step's time

    def evaluate(self, name: str) -> dict[str, float]:
        """Evaluate checkpoint ``name`` into ``OUT/eval/<name>.json`` and the logs; mark the best one."""
        res = evaluate_checkpoint(self.ckpt_dir / name / "model.safetensors", self.arch, self.opts, self.dist.device,
                                  self.tasks)
        self.evals[name] = res
        self.log.write(self.step, res, prefix="eval")
        (self.out / "eval").mkdir(exist_ok=True)
        (self.out / "eval" / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
        best = self.best()
        if best is not None:
            ckpt.mark_best(self.ckpt_dir, best)
        self.say(f"epoch {self.epoch} eval: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                                          if k.startswith("retrieval") and k.endswith("R@1"))
                 + (f" (best so far: {best})" if best else ""))
        self.prune()
        return res

    # -- the end
    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
        if self.log is not None:
            self.log.close()

    def finish(self) -> dict:
        """The final weights (``OUT/model.safetensors`` + ``model.json``) and data report; returns the summary."""
        self.read_pending()
        last_eval = self.evals[max(self.evals)] if self.evals else {}
        if first_nonfinite(self.trainer.model.state_dict()) is not None:  # a "good" last step can overflow to inf
            raise TrainingDiverged("stopped: the final weights are not finite, so they were not saved; "
                                  + (f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt
                                     else "no good checkpoint exists") + ". Lower --lr or set --grad-clip-norm 1.0.")
        best = self.best()
        weights = self.out / "model.safetensors"
        if self.dist.is_main:
            epochs = self.epoch + self.in_epoch / self.data.steps_per_epoch
            ckpt.save_final(self.out, self.trainer.model, _describe(self.opts, self.arch, self.objective, self.data,
                                                                    self.step, epochs, self.samples, last_eval))
            self.data.report.to_json(self.out / "data_report.json")
            self.say(f"done: {self.step} steps, {self.samples} samples; weights {weights} (+ model.json)"
                     + (f"; best evaluated checkpoint {self.ckpt_dir / best}" if best else ""))
            self.say(f"data: {self.data.report.summary()}")
        self.dist.barrier()
        return {"step": self.step, "epoch": self.epoch, "samples": self.samples, "out": str(self.out),
                "weights": str(weights), "eval": last_eval, "best": str(self.ckpt_dir / best) if best else None,
                "bad_steps": self.bad.steps, "options": self.opts}


def pretrain(opts: PretrainOptions) -> dict:
    """Run (or resume) the pre-training ``opts`` describes; returns ``{"step", "epoch", "samples", "out",
    "weights", "eval" (the last evaluation's headline numbers), "best" (the best evaluated checkpoint or None),
    "bad_steps", "options" (resolved)}``. Raises ValueError for bad options (the command line's checks) or a run
    folder holding another run, TrainingDiverged when training diverges."""
    check_options(opts, build_parser())
    opts = dataclasses.replace(opts, method_options=resolve_method_options(opts.method, opts.method_options))
    build_objective(opts.method, opts.method_options)  # its own checks too, before a file is written
    dist = init_distributed(opts.device, opts.dist_url)
    opts, notes = resolve_options(opts, dist)
    # continuing a checkpoint checks its own settings; "--resume latest" with nothing to resume is a new run
    resuming = bool(opts.resume) and ckpt.find_resume(Path(opts.out), opts.resume) is not None
    claim(Path(opts.out), run_config(opts), resume=resuming)
    dist.barrier()  # every rank has checked the folder before rank 0 writes its config.json
    run = PretrainRun(opts, dist)
    run.resume()
    run.start(notes)
    try:
        while run.running():
            if not run.train_epoch():  # stopped by --max-steps inside the epoch
                break
            run.end_epoch()
    finally:
        run.close()
    return run.finish()


train = pretrain  # the name this job had before it took options (train.demo, older scripts)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        return run_job(pretrain, opts)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
