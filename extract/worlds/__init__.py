"""The generated worlds: the project's own data, made by rule, each with its truth, captions, hard negatives, splits
and controlled tests (``python -m extract.worlds.toyworld``).

- ``toyworld`` (the version-2 world, the embedded default: flat shapes on black; the command line for all three),
  with its rules in ``toyrules``;
- ``hardworld`` (support, depth and clutter: What'sUp's Controlled-A / -B analogues);
- ``world3d`` (CLEVR's objects path-traced by Mitsuba 3) and ``world3d_layout`` (those scenes written in the worlds'
  layout), with ``language3d`` (the rules of what people say of a 3D scene: phrases by any attribute, counts,
  between, next to, phrasings) and ``captions3d`` (the captions and negatives of ``--language wide``);
- ``shared``: what all three share (vocabulary, splits and hold-out, caption text, hard-negative mutations, the files
  every reader expects, the controlled tests' layout).

A world on disk is read like a user's data (:mod:`extract.data`: sources, boxes); nothing here reads a user's data.
"""
