"""Components of an image and its caption: text parses into entities, relations and phrase trees (text), hard negatives
(hard_negatives), region geometry (regions), random boxes (random_boxes), detectors and segmenters (detectors), the
toy-world YOLO (toy_detector)."""
