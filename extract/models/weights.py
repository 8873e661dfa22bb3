"""Where a backbone's weights come from: a local file, an open_clip tag (hub cache or download), or none.

The rule is: find the file locally first; download only when the hub is reachable; otherwise fail at once
with a message that names the file and how to supply it. Without the reachability check, open_clip's
``hf_hub_download`` retries for ~45 s on a machine with no internet before giving up.
"""
from __future__ import annotations

import hashlib
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}
HUB_PROBE_TIMEOUT_S = 2.0  # with imports, an absent file must fail within 5 s even behind a silent firewall


class WeightsNotFoundError(FileNotFoundError):
    """Pretrained weights are neither on this machine nor downloadable; the message says how to supply them."""


@dataclass(frozen=True)
class ResolvedWeights:
    """Outcome of resolving ``--pretrained``.

    kind: "random" (no weights), "file" (a path the user gave) or "tag" (an open_clip tag, found in a cache
    or downloaded). ``path`` is set for "file" and "tag". ``tag_cfg`` is open_clip's pretrained config for
    a tag (preprocessing mean/std, quick_gelu, ...), empty otherwise.
    """

    kind: str
    path: Path | None = None
    tag: str | None = None
    tag_cfg: dict | None = None


def is_offline() -> bool:
    """True when the user asked for no network (HF_HUB_OFFLINE / PLUGVLM_OFFLINE)."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "PLUGVLM_OFFLINE"))


def _hub_host() -> str:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return urlparse(endpoint).hostname or "huggingface.co"


def probe_host(host: str, port: int = 443, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Return None if ``host:port`` accepts a TCP connection within ``timeout`` s, else the reason it did not.

    DNS resolution ignores socket timeouts, so the whole probe runs in a daemon thread with a hard deadline.
    """
    outcome: list[str | None] = []

    def attempt():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except OSError as e:  # gaierror, timeout, refused: all mean "not reachable from here"
            outcome.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:.0f} s"


def _hub_candidates(hf_hub: str) -> tuple[str, list[str]]:
    """open_clip writes hub entries as 'org/repo/' (default file names) or 'org/repo/file.bin'."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    repo_id, filename = os.path.split(hf_hub)
    if not filename:
        return repo_id, [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME]
    names = [filename]
    if filename.endswith((".bin", ".pth")) and filename != HF_WEIGHTS_NAME:
        names.insert(0, filename[:-4] + ".safetensors")
    return repo_id, names


def _find_cached(cfg: dict, cache_dir: str | None) -> tuple[Path | None, list[str]]:
    """Look for a tag's file in the hub cache and in open_clip's URL cache; return (path, places looked)."""
    looked: list[str] = []
    if cfg.get("file"):
        looked.append(cfg["file"])
        if Path(cfg["file"]).is_file():
            return Path(cfg["file"]), looked
    if cfg.get("hf_hub"):
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE

        repo_id, names = _hub_candidates(cfg["hf_hub"])
        for name in names:
            looked.append(f"hub cache ({cache_dir or HF_HUB_CACHE}): {repo_id}/{name}")
            hit = try_to_load_from_cache(repo_id, name, cache_dir=cache_dir)
            if isinstance(hit, str) and Path(hit).is_file():
                return Path(hit), looked
    if cfg.get("url"):
        local = Path(cache_dir or os.path.expanduser("~/.cache/clip")) / os.path.basename(cfg["url"])
        looked.append(str(local))
        if local.is_file():
            return local, looked
    return None, looked


def _how_to_supply(model: str, tag: str, cfg: dict) -> str:
    lines = ["To supply them, on a machine with internet either"]
    if cfg.get("hf_hub"):
        repo_id, names = _hub_candidates(cfg["hf_hub"])
        lines.append(f"  - run `huggingface-cli download {repo_id} {names[0]}` and copy the file here,"
                     " then pass --pretrained /path/to/" + names[0])
        lines.append("    (or copy the whole Hugging Face hub cache, ~/.cache/huggingface/hub, to this machine)")
    if cfg.get("url"):
        lines.append(f"  - download {cfg['url']} and pass --pretrained /path/to/{os.path.basename(cfg['url'])}")
    lines.append(f"  - or run once with network access: open_clip.create_model('{model}', pretrained='{tag}')")
    return "\n".join(lines)


def resolve_weights(model: str, pretrained: str | None, *, cache_dir: str | None = None,
                    offline: bool | None = None, hint: str | None = None) -> ResolvedWeights:
    """Resolve ``pretrained`` (None/"none"/"random", a file path, or an open_clip tag) for ``model``.

    Never builds the model, so it answers in well under a second; downloads only if the hub is reachable.
    ``hint`` is appended to errors (e.g. where NegCLIP's checkpoint comes from).
    Raises WeightsNotFoundError naming the file(s) and how to supply them.
    """
    import open_clip

    if pretrained is None or str(pretrained).lower() in ("", "none", "random"):
        return ResolvedWeights("random")
    path = Path(os.path.expanduser(str(pretrained)))
    if path.is_file():
        return ResolvedWeights("file", path=path)
    cfg = open_clip.get_pretrained_cfg(model, str(pretrained))
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model)
        looks_like_path = os.sep in str(pretrained) or Path(str(pretrained)).suffix in (".pt", ".pth", ".bin", ".safetensors")
        what = f"the file {path} does not exist" if looks_like_path else f"'{pretrained}' is not a file or a known tag"
        raise WeightsNotFoundError(
            f"Pretrained weights for {model}: {what}.\n"
            f"Known open_clip tags for {model}: {', '.join(tags) if tags else '(none)'}.\n"
            "Pass --pretrained TAG, --pretrained /path/to/checkpoint (.safetensors/.pt/.bin), or --pretrained none"
            " for random weights." + (f"\n{hint}" if hint else ""))

    found, looked = _find_cached(cfg, cache_dir)
    if found is not None:
        return ResolvedWeights("tag", path=found, tag=str(pretrained), tag_cfg=cfg)

    offline = is_offline() if offline is None else offline
    why = "offline mode is on (HF_HUB_OFFLINE / PLUGVLM_OFFLINE)" if offline else probe_host(_hub_host())
    if why is None:
        try:
            target = open_clip.download_pretrained(cfg, cache_dir=cache_dir)
        except Exception as e:  # network dropped mid-way, gated repo, disk full: same advice applies
            why = f"the download failed ({type(e).__name__}: {e})"
        else:
            return ResolvedWeights("tag", path=Path(target), tag=str(pretrained), tag_cfg=cfg)
    raise WeightsNotFoundError(
        f"Pretrained weights for {model} (open_clip tag '{pretrained}') are not on this machine and cannot be "
        f"downloaded: {why}.\nLooked for:\n" + "\n".join(f"  - {p}" for p in looked) + "\n"
        + _how_to_supply(model, str(pretrained), cfg) + (f"\n{hint}" if hint else ""))


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks (weights files are hundreds of MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


# A checkpoint written by ``python -m train.pretrain`` carries a JSON description next to its weights
# (``X.safetensors`` -> ``X.json``): the open_clip model name and config, QuickGELU, the method, the run.
SIDECAR_FORMAT = "plugvlm-pretrain"


def checkpoint_sidecar(path: str | os.PathLike) -> dict | None:
    """The description ``train.pretrain`` wrote next to checkpoint ``path`` (same name, ``.json``), or None
    when there is none (any other checkpoint)."""
    import json

    side = Path(path).with_suffix(".json")
    if not side.is_file():
        return None
    try:
        data = json.loads(side.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == SIDECAR_FORMAT else None
