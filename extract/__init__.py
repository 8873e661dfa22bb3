"""plugvlm extraction: frozen backbones, data sources, the toy world, components and the feature cache.

Library code: never imports ``train`` or ``serve``.
"""

from extract import numerics  # noqa: F401  MKL's reproducible mode before any matrix product
