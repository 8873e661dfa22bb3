"""extract.common.run_dir: default run folders, and a run never silently overwriting another."""
from __future__ import annotations

import json

import pytest

from extract.common.run_dir import claim, default_out


def test_default_out_names_the_run_by_its_parts():
    assert str(default_out("ViT-B-32", "comalign")) == "runs/ViT-B-32-comalign"
    assert str(default_out("pretrain", "hf-hub:org/model", "clip")) == "runs/pretrain-hf-hub_org_model-clip"


def test_claim_refuses_a_folder_holding_another_run(tmp_path):
    out = tmp_path / "run"
    claim(out, {"method": "comalign", "lr": 1e-3})  # absent: fine (and created)
    (out / "config.json").write_text(json.dumps({"method": "comalign", "lr": 1e-3, "device": "cpu", "workers": 2}))
    claim(out, {"method": "comalign", "lr": 1e-3, "device": "cuda", "workers": 8})  # same run, other machine
    with pytest.raises(ValueError, match=r"holds another run \(lr: 0.001 there, 0.0002 now\).*--out NEW_FOLDER"):
        claim(out, {"method": "comalign", "lr": 2e-4})
    claim(out, {"method": "comalign", "lr": 2e-4}, resume=True)  # continuing checks its own settings


def test_claim_creates_the_folder_and_refuses_one_it_cannot_write(tmp_path):
    """An unusable --out (under a file, as /etc/passwd/x) failed only at the run's first write, after
    extraction, with "[Errno 20] Not a directory" alone."""
    out = tmp_path / "a" / "run"
    claim(out, {"method": "comalign"})
    assert out.is_dir() and list(out.iterdir()) == []  # created, and the write test leaves nothing behind
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=rf"^--out {afile}/run cannot be used as the run folder \(Not a directory\)"):
        claim(afile / "run", {})
    with pytest.raises(ValueError, match=rf"^--out {afile} is a file, not a folder"):
        claim(afile, {}, resume=True)  # resuming checks it too
