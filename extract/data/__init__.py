"""Image-caption data: sources behind one interface (sources), decoding one image or caption (images), the report of what
was refused (report), ``python -m extract.data.check`` (check), the toy world (toyworld), ground-truth boxes from
COCO instances, Visual Genome or a toy world (boxes)."""
