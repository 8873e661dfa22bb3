"""A user's image-caption data: sources behind one interface (sources: CSV / TSV, COCO captions, webdataset, a
generated world's folder), decoding one image or caption (images), the records a source yields (records), the report
of what was refused (report), ``python -m extract.data.check`` (check), and ground-truth boxes from COCO instances,
Visual Genome or a generated world (boxes). The generated worlds themselves are :mod:`extract.worlds`."""
