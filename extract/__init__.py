"""plugvlm extraction: frozen backbones, data sources, the toy world, components and the feature cache.

Library code: never imports ``train`` or ``serve``.
"""
