"""``python -m train.adapter``'s training state, ``RUN/checkpoints/last.safetensors``: written at epoch ends (and
every ``--save-every`` steps) only while the run is healthy, read back by ``--resume`` for an exact continuation
(weights, optimizer, schedule, RNG of every rank, position in the data order, the stopping rule's state), refused
when a setting that decides the continuation differs (:data:`RESUME_KEYS`)."""
from __future__ import annotations

from pathlib import Path

import torch

from adapters.checkpoint import load_training_state, read_meta, save_training_state
from extract.common.config import save_config
from extract.common.tensorfile import first_nonfinite
from train.bad_steps import BadSteps
from train.adapter.options import AdapterOptions, options_json
from train.adapter.run import Env, Model, Run, State

# options that must not change across --resume for the continuation to be exact
RESUME_KEYS = ("method", "base", "epochs", "patience", "min_delta", "cooldown", "max_epochs", "batch_size",
               "accum_steps", "lr", "weight_decay", "beta1", "beta2", "eps",
               "schedule", "warmup", "step_epochs", "gamma", "precision", "grad_clip", "seed", "unfreeze",
               "backbone_lr", "context_length")
# values of keys added since the first checkpoints, so those still resume
RESUME_KEY_DEFAULTS = {"unfreeze": False, "backbone_lr": None, "context_length": None, "patience": 3,
                       "min_delta": 0.5, "cooldown": 0.2, "max_epochs": 30}


def resume_key(opts: AdapterOptions, head_config: dict, env: Env, data_key: str, train_rows: int) -> dict:
    """What a ``--resume`` must agree on: the settings of :data:`RESUME_KEYS`, the head's config, the base's
    weights, the training data, the number of processes and of training captions."""
    return {k: getattr(opts, k) for k in RESUME_KEYS} | {
        "head_config": head_config, "weights_sha256": env.base_info["weights_sha256"],
        "cache": data_key, "world_size": env.ctx.world, "train_rows": int(train_rows)}


def start_or_resume(opts: AdapterOptions, env: Env, model: Model) -> State:
    """A fresh state, or (``--resume``) the saved one with weights, optimizer, schedule and RNG restored, refused
    when the settings that decide the continuation differ. Then ``config.json`` is written."""
    state = State(bad=BadSteps(opts.max_bad_steps))
    if opts.resume:
        path = Path(opts.resume) if opts.resume != "auto" else env.state_path
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no training state at {path} (a run saves it at every epoch end)")
        theirs = {**RESUME_KEY_DEFAULTS, **read_meta(path).get("resume_key", {})}
        diff = [f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in model.resume_key.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"--resume {path}: this run's settings differ from the checkpoint's, so it would not "
                             "continue the same run:\n  " + "\n  ".join(diff))
        meta = load_training_state(path, model.head, model.optimizer, model.scheduler, env.ctx.scaler, model.modules)
        state = State(meta["epoch"], meta["batch"], meta["step"], meta.get("history", []),
                      bad=BadSteps(opts.max_bad_steps))
        state.bad.load(meta)
        if model.plateau is not None:
            model.plateau.load(meta.get("plateau") or {})
        torch.set_rng_state(load_rng_for_rank(path, env.ctx.rank))
        env.say(f"resuming {path} at epoch {state.epoch}, batch {state.batch} (step {state.step})")
    if env.is_main:
        env.out.mkdir(parents=True, exist_ok=True)
        save_config(options_json(opts), env.out / "config.json")
    return state


def save_state(run: Run) -> bool:
    """The training state at the state's position; refused (False) during a run of skipped steps or when the
    weights are not finite, so the file on disk stays the last good state."""
    env, model, state = run.env, run.model, run.state
    path = env.state_path
    if not state.bad.clean or first_nonfinite(dict(model.trained.named_parameters())) is not None:
        why = (f"{state.bad.in_a_row} step(s) in a row skipped as non-finite" if not state.bad.clean
               else "the weights are not finite")
        kept = f"{path} keeps the last good state" if path.is_file() else "no good state has been saved yet"
        env.warn(f"warning: not saving at step {state.step}: {why}; {kept}")
        return False
    if env.is_main:
        save_training_state(path, model.head, model.optimizer, model.scheduler, env.ctx.scaler, {
            "epoch": state.epoch, "batch": state.batch, "step": state.step, **state.bad.state(),
            "history": state.history, "resume_key": model.resume_key,
            "plateau": model.plateau.state() if model.plateau is not None else None,
            "args": options_json(run.opts), "base": env.base_info, "extraction": run.data.extraction}, model.modules)
    save_rank_rng(path, env.ctx.rank)
    env.accelerator.wait_for_everyone()
    return True


def save_rank_rng(state_path: Path, rank: int) -> None:
    """Each rank's torch RNG next to the training state (rank 0's is also inside it)."""
    from adapters.checkpoint import save_atomic

    save_atomic({"torch": torch.get_rng_state()}, state_path.with_name(f"rng-rank{rank}.safetensors"))


def load_rng_for_rank(state_path: Path, rank: int) -> torch.Tensor:
    from adapters.checkpoint import read_tensors  # verified against the digest save_atomic wrote

    path = Path(state_path).with_name(f"rng-rank{rank}.safetensors")
    if path.is_file():
        return read_tensors(path)["torch"]
    return torch.get_rng_state()
