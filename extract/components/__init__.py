"""Components of an image and its caption: text parses into entities, relations and phrase trees (text) and their
packed arrays (text_pack), hard negatives (hard_negatives), region geometry (regions), random boxes (random_boxes),
detectors and segmenters (detectors), the toy worlds' YOLO (toy_detector) and oracle masks (toy_segmenter), who owns an
overlap (overlap)."""
