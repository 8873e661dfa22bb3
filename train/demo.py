"""The demo: the whole pipeline that exists so far, on the embedded default (the toy world).

``python -m train.demo`` generates the toy world, loads a frozen backbone (the tiny config with random
weights unless ``--base/--pretrained`` say otherwise), embeds the chosen split through the data-source
interface (bad inputs reported, never fatal), and prints what it did: counts, shapes, throughput, and a
first look at retrieval and hard-negative accuracy. It grows as the project does (feature cache,
adapters, evaluation suite).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from extract import toyworld
from extract.backbone import load_backbone
from extract.config import parse_with_config, save_config
from extract.data import SampleDataset, collate_skipping, open_source
from extract.weights import WeightsNotFoundError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--n", type=int, default=2000, help="toy-world scenes to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="test", choices=["train", "val", "test"], help="split to embed")
    p.add_argument("--base", default="tiny", help="backbone alias or open_clip model name")
    p.add_argument("--pretrained", default=None, help="tag, checkpoint path, or 'none' (default: the alias's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="data-loading worker processes")
    return parse_with_config(p, argv)


@torch.no_grad()
def embed_split(backbone, source, batch_size: int, workers: int):
    """Embed every good image and caption of ``source``.

    Returns (image_emb [N_img, D], caption_emb [N_cap, D], caption_to_image [N_cap] long, caption_ids,
    image_ids); bad images are skipped and recorded in ``source.report``.
    """
    dataset = SampleDataset(source, backbone.preprocess)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_skipping)
    image_emb, caption_texts, caption_to_image, caption_ids, image_ids = [], [], [], [], []
    for good, skips in tqdm(loader, desc=f"embedding {source.name}", unit="batch"):
        source.report.add_batch(good, skips)
        if good["images"] is None:
            continue
        image_emb.append(backbone.encode_images(good["images"]).embedding.cpu())
        for image_id, caps in zip(good["image_ids"], good["captions"]):
            for cap in caps:
                caption_texts.append(cap.text)
                caption_ids.append(cap.id)
                caption_to_image.append(len(image_ids))
            image_ids.append(image_id)
    text_emb = [backbone.encode_texts(caption_texts[i:i + batch_size]).embedding.cpu()
                for i in range(0, len(caption_texts), batch_size)]
    return torch.cat(image_emb), torch.cat(text_emb), torch.tensor(caption_to_image), caption_ids, image_ids


def recall_at_1(image_emb: torch.Tensor, text_emb: torch.Tensor, caption_to_image: torch.Tensor) -> dict:
    """Text->image and image->text R@1 (an image counts as hit when its top caption is one of its own)."""
    sims = text_emb @ image_emb.T
    t2i = (sims.argmax(1) == caption_to_image).float().mean().item()
    i2t = (caption_to_image[sims.argmax(0)] == torch.arange(len(image_emb))).float().mean().item()
    return {"t2i_r1": t2i, "i2t_r1": i2t, "t2i_chance": 1 / len(image_emb)}


@torch.no_grad()
def hard_negative_accuracy(backbone, image_emb, caption_ids, items, image_row) -> dict:
    """Per negative type: fraction of (image, positive, negative) triples where the positive scores higher."""
    wins, totals = defaultdict(int), defaultdict(int)
    cap_row = {cid: i for i, cid in enumerate(caption_ids)}
    usable = [it for it in items if str(it["caption_id"]) in cap_row and str(it["image_id"]) in image_row]
    texts = [it["positive"] for it in usable] + [neg["text"] for it in usable for neg in it["negatives"]]
    emb = torch.cat([backbone.encode_texts(texts[i:i + 512]).embedding for i in range(0, len(texts), 512)]) \
        if texts else torch.empty(0)
    k = len(usable)
    for i, it in enumerate(usable):
        img = image_emb[image_row[str(it["image_id"])]]
        pos = emb[i] @ img
        for neg in it["negatives"]:
            totals[neg["type"]] += 1
            wins[neg["type"]] += int(pos > emb[k] @ img)
            k += 1
    return {t: {"accuracy": wins[t] / totals[t], "n": totals[t]} for t in sorted(totals)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    save_config(args, out / "config.json")
    t_start = time.perf_counter()

    # the backbone first: missing weights must fail before any other work
    print(f"[1/3] backbone: {args.base} (pretrained: {args.pretrained or 'alias default'})")
    try:
        backbone = load_backbone(args.base, args.pretrained, device=args.device)
    except (WeightsNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    info = backbone.describe()
    print(f"  {info['model']}: {info['weights']} weights, embed dim {info['embed_dim']}, "
          f"{info['grid'][0]}x{info['grid'][1]} patches, {info['context_length']} tokens")

    print(f"[2/3] toy world: {args.n} scenes, seed {args.seed} -> {out / 'toyworld'}")
    summary = toyworld.generate(out / "toyworld", args.n, args.seed)
    print(toyworld.format_summary(summary))

    print(f"[3/3] embedding the {args.split} split through the data-source interface")
    source = open_source(out / "toyworld", split=args.split)
    t0 = time.perf_counter()
    image_emb, text_emb, cap2img, caption_ids, image_ids = embed_split(backbone, source, args.batch_size, args.workers)
    dt = time.perf_counter() - t0
    print(f"  {len(image_ids)} images -> {tuple(image_emb.shape)}, {len(caption_ids)} captions -> "
          f"{tuple(text_emb.shape)} in {dt:.1f} s ({len(image_ids) / dt:.0f} images/s incl. captions)")
    print(f"  data report: {source.report.summary()}")
    retrieval = recall_at_1(image_emb, text_emb, cap2img)
    items = [it for it in json.loads((out / "toyworld" / "negatives.json").read_text())["items"]
             if it["split"] == args.split]
    negatives = hard_negative_accuracy(backbone, image_emb, caption_ids, items,
                                       {iid: r for r, iid in enumerate(image_ids)})
    print(f"  retrieval R@1: text->image {retrieval['t2i_r1']:.3f}, image->text {retrieval['i2t_r1']:.3f} "
          f"(chance {retrieval['t2i_chance']:.4f})")
    print("  hard negatives (positive beats negative; chance 0.5): "
          + ", ".join(f"{t} {v['accuracy']:.3f} (n={v['n']})" for t, v in negatives.items()))
    if info["weights"] == "random":
        print("  note: random weights, so these figures sit near chance; pass --pretrained to use trained ones.")
    report = {"backbone": info, "split": args.split, "images": len(image_ids), "captions": len(caption_ids),
              "retrieval": retrieval, "hard_negatives": negatives, "data_report": source.report.counts(),
              "seconds": time.perf_counter() - t_start}
    (out / "demo_report.json").write_text(json.dumps(report, indent=2) + "\n")
    source.report.to_json(out / "data_report.json")
    print(f"done in {report['seconds']:.1f} s: {out / 'demo_report.json'}, {out / 'data_report.json'}, "
          f"{out / 'config.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
